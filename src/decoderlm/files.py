"""Files written safely and read carefully: atomic writes, never over what a command did not
create, inputs that must be regular files.

Every file is written to a temporary name in the same directory, fsync'ed and renamed over the old
one, so a process killed mid-write leaves the previous file intact.

Every command with `--out` calls `refuse_overwrite` before it writes anything: no command writes
over a file it did not create in the same invocation unless told to (`--overwrite`, or `--resume`
where a command continues what is there).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from decoderlm.errors import DecoderLMError

# ---- atomic writes --------------------------------------------------------------------------

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read the process umask (the call sets it; this restores it)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual mode
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    finally:
        tmp_path.unlink(missing_ok=True)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call `write(tmp_path)` and atomically move the result to `path`."""
    with atomic_path(path) as tmp:
        write(tmp)


def write_json(path: str | Path, data: Any) -> None:
    """Write `data` as indented JSON to `path`, atomically."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- outputs and inputs ---------------------------------------------------------------------

OVERWRITE_FLAG = "--overwrite"
ANY_ENTRY = ("*",)  # `inside` for an output directory that must be new or empty


def add_overwrite_argument(parser: argparse.ArgumentParser, *aliases: str) -> None:
    """--overwrite: let the command write over what --out already holds."""
    parser.add_argument(
        OVERWRITE_FLAG,
        *aliases,
        dest="overwrite",
        action="store_true",
        help="write over the files --out already holds (default: refuse)",
    )


def refuse_overwrite(
    out: str | Path,
    *,
    overwrite: bool,
    inside: Sequence[str] | None = None,
    other: str = "",
) -> None:
    """A one-line error if writing `out` would replace something that is there, unless `overwrite`.

    `inside` None: `out` is the file the command writes. Otherwise `out` is a directory and
    `inside` the names the command writes in it (`ANY_ENTRY`: the directory must be new or
    empty). `other` names another way through, e.g. "or --resume to continue the run".
    """
    out = Path(out)
    if inside is not None and _exists(out) and not out.is_dir():
        raise DecoderLMError(f"--out {out} exists and is not a directory")
    if inside is None and out.is_dir():
        raise DecoderLMError(f"--out {out} is a directory; give the path of the file to write")
    if overwrite:
        return
    how = f"pass {OVERWRITE_FLAG} to write over it" + (f", {other}" if other else "")
    if inside == ANY_ENTRY:
        entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        if entries:
            raise DecoderLMError(f"--out {out} is not empty ({out / entries[0]} is there): {how}")
        return
    for path in [out] if inside is None else [out / name for name in inside]:
        if _exists(path):
            raise DecoderLMError(f"{path} already exists: {how}")


def require_file(path: str | Path) -> Path:
    """`path` if it is a regular file, else a one-line error saying what it is instead."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        raise DecoderLMError(f"{path} is a directory, not a file")
    if _exists(path):
        raise DecoderLMError(f"{path} is not a regular file (a FIFO, socket or device)")
    raise DecoderLMError(f"no such file: {path}")


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()  # a dangling link would be written through too
