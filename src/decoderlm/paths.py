"""The paths commands are given: input files that must be regular files, and outputs that must not
be written over.

Every command with `--out` calls `refuse_overwrite` before it writes anything: no command writes
over a file it did not create in the same invocation unless told to (`--overwrite`, or `--resume`
where a command continues what is there).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from decoderlm.errors import DecoderLMError

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
