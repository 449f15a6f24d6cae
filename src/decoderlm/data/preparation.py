"""Text files into a data directory (`decoderlm.data.format`): `prepare`, the default corpus.

`prepare` makes one from text files: each file is a document, followed by the end-of-text token;
files are read in sorted-path order; the tokenizer (BPE or char) is trained on the whole corpus. The
val split is the last `val_fraction` of the corpus by characters (nanoGPT-style split by position;
the document at the cut is cut in two), so a single file such as Tiny Shakespeare splits too, and
train_bytes/val_bytes are exact. With no inputs the corpus is the Python standard library's source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from decoderlm.checkpoint import TOKENIZER_FILE
from decoderlm.data.format import DATA_FORMAT, DTYPES, META_FILE, SPLITS, load_split
from decoderlm.errors import DecoderLMError
from decoderlm.files import atomic_path, atomic_write, require_file, write_json
from decoderlm.tokenizer import Tokenizer

# What a directory input picks up unless `include` says otherwise: text and source code.
_TEXT_EXTENSIONS = (
    "txt md rst tex py pyi c h cc cpp hpp rs go java js ts sh html css json toml yaml yml"
)
DEFAULT_INCLUDE = tuple(f"*.{ext}" for ext in _TEXT_EXTENSIONS.split())
# Never descended into (nor any hidden directory such as .git): caches and installed packages.
SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "dist-packages"})
# The default corpus also leaves out the standard library's own test suites (test/, tkinter/test/,
# lib2to3/tests/, idlelib/idle_test/, ...) and encodings/, 1.4 MB of generated charmap tables
# ("LATIN SMALL LETTER ..." lines) that filled the main job's early samples.
STDLIB_SKIP_DIRS = SKIP_DIRS | {"test", "tests", "idle_test", "encodings"}
STDLIB_INCLUDE = ("*.py",)
ENCODE_CHUNK = 64  # documents per encode_batch call: parallel in Rust, bounded memory


def prepare(
    inputs: Sequence[str | Path] | None,
    out_dir: str | Path,
    tokenizer: str | Path | Tokenizer = "bpe",
    vocab_size: int = 8192,
    val_fraction: float = 0.1,
    include: Sequence[str] | None = None,
    max_files: int | None = None,
    progress: bool = True,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Tokenize files and directories into `out_dir` and return its meta.json.

    `inputs`: files (taken as they are) and directories (searched recursively for `include` globs,
    default `DEFAULT_INCLUDE`); None means the Python standard library (`*.py`, tests excluded).
    `tokenizer`: "bpe" (trained, `vocab_size` tokens), "char" (trained), a tokenizer.json path (or a
    directory holding one), or a `Tokenizer`. `dtype`: None picks uint16 or uint32 from the vocab.
    """
    _check_prepare_args(tokenizer, vocab_size, val_fraction, max_files, dtype)
    if inputs is None:
        inputs, include = [stdlib_dir()], STDLIB_INCLUDE
        files = collect_files(inputs, include, skip_dirs=STDLIB_SKIP_DIRS)
    elif isinstance(inputs, (str, Path)) or not inputs:
        raise DecoderLMError(f"inputs={inputs!r} must be a non-empty list of paths, or None")
    else:
        include = list(include or DEFAULT_INCLUDE)
        files = collect_files(inputs, include)
    source = {
        "inputs": [str(p) for p in inputs],
        "include": list(include),
        "max_files": max_files,
        "val_fraction": val_fraction,
        "val_split": "the last val_fraction of the characters, files in sorted-path order",
    }
    files = files[:max_files]
    return _prepare_files(files, out_dir, tokenizer, vocab_size, dtype, source, progress)


def prepare_default_corpus(
    tokenizer: str | Path = "bpe",
    vocab_size: int = 8192,
    max_files: int | None = None,
    progress: bool = True,
) -> Path:
    """The Python standard library prepared once into the cache; later calls return it at once.

    The cache directory is `$DECODERLM_CACHE/data/<name>` (default `~/.cache/decoderlm/data/`),
    where the name carries a fingerprint of the files (paths, sizes, mtimes), the tokenizer and the
    format. It is prepared in a private temporary directory and renamed into place, so a killed
    run or two concurrent runs never leave a half-written cache.
    """
    _check_prepare_args(tokenizer, vocab_size, 0.1, max_files, None)
    root = stdlib_dir()
    files = collect_files([root], STDLIB_INCLUDE, skip_dirs=STDLIB_SKIP_DIRS)[:max_files]
    if tokenizer in ("bpe", "char"):
        kind = f"bpe{vocab_size}" if tokenizer == "bpe" else "char"
    else:  # a tokenizer file: its content is part of the key
        content = Tokenizer.from_file(tokenizer).backend.to_str().encode()
        kind = "file" + hashlib.sha256(content).hexdigest()[:12]
    stats = [(f.relative_to(root).as_posix(), f.stat()) for f in files]
    key = [DATA_FORMAT, kind, [(rel, st.st_size, st.st_mtime_ns) for rel, st in stats]]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    final = cache_dir() / "data" / f"stdlib-{python}-{kind}-{digest}"  # e.g. stdlib-py311-bpe8192-…
    if _is_complete(final):
        return final
    tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        prepare(None, tmp, tokenizer, vocab_size, max_files=max_files, progress=progress)
        try:
            os.replace(tmp, final)  # fails if another process has published a non-empty one
        except OSError:
            if not _is_complete(final):
                shutil.rmtree(final)
                os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def cache_dir() -> Path:
    """Where decoderlm caches prepared data: `$DECODERLM_CACHE`, default `~/.cache/decoderlm`."""
    return Path(os.environ.get("DECODERLM_CACHE") or Path.home() / ".cache" / "decoderlm")


def stdlib_dir() -> Path:
    """The running interpreter's standard library source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_files(
    inputs: Sequence[str | Path],
    include: Sequence[str] = DEFAULT_INCLUDE,
    skip_dirs: frozenset[str] = SKIP_DIRS,
) -> list[Path]:
    """Files of `inputs`, sorted: files as given, directories searched for `include` globs.

    A glob matches a file's path relative to its input directory from the right (`PurePath.match`):
    "*.py" matches any Python file, "docs/*.md" the Markdown files directly in a `docs` folder.
    """
    found: dict[Path, Path] = {}  # resolved path -> path as the user spelled it (dedupes overlaps)
    for item in inputs:
        path = Path(item)
        if path.is_file():
            found.setdefault(path.resolve(), path)
        elif path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if d not in skip_dirs and not d.startswith(".")]
                for name in names:
                    file = Path(root, name)
                    rel = file.relative_to(path)
                    if any(rel.match(glob) for glob in include) and file.is_file():
                        found.setdefault(file.resolve(), file)
        elif path.exists():
            require_file(path)  # a FIFO, socket or device: the error says so
        else:
            raise DecoderLMError(f"no such file or directory: {item}")
    return sorted(found.values())


def split_documents(docs: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val): train is the first int((1 - val_fraction) · characters), as in nanoGPT."""
    total = sum(len(doc) for doc in docs)
    cut = int(total * (1 - val_fraction))  # characters that go to train
    train: list[str] = []
    val: list[str] = []
    seen = 0
    for doc in docs:
        if seen + len(doc) <= cut:
            train.append(doc)
        elif seen >= cut:
            val.append(doc)
        else:  # the document at the cut
            train.append(doc[: cut - seen])
            val.append(doc[cut - seen :])
        seen += len(doc)
    return train, val


def _prepare_files(
    files: Sequence[Path],
    out_dir: str | Path,
    tokenizer: str | Path | Tokenizer,
    vocab_size: int,
    dtype: str | None,
    source: dict[str, Any],
    progress: bool,
) -> dict[str, Any]:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DecoderLMError(f"output {out} exists and is not a directory")
    docs, skipped = _read_documents(files, progress)
    if not docs:
        where = ", ".join(source["inputs"])
        raise DecoderLMError(
            f"no readable text found in {where} (files matching {' '.join(source['include'])})"
        )
    tok, kind = _make_tokenizer(tokenizer, vocab_size, docs, progress)
    dtype = _choose_dtype(tok.vocab_size, dtype)
    if tok.eot_id is None:
        warnings.warn(
            "the tokenizer has no end-of-text token: documents are joined without a separator",
            stacklevel=3,
        )
    train_docs, val_docs = split_documents(docs, source["val_fraction"])

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DecoderLMError(f"cannot create {out}: {exc.strerror}") from None
    (out / META_FILE).unlink(missing_ok=True)  # incomplete until meta.json is written, last
    atomic_write(out / TOKENIZER_FILE, tok.save)
    total = sum(len(doc) for doc in docs)
    with tqdm(
        total=total, desc="encoding", unit="char", unit_scale=True, disable=not progress
    ) as bar:
        train_tokens = _write_tokens(out / "train.bin", train_docs, tok, DTYPES[dtype], bar)
        val_tokens = _write_tokens(out / "val.bin", val_docs, tok, DTYPES[dtype], bar)
    meta = {
        "format": DATA_FORMAT,
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "tokenizer": TOKENIZER_FILE,
        "eot_id": tok.eot_id,
        "train_tokens": train_tokens,
        "val_tokens": val_tokens,
        "train_bytes": sum(len(doc.encode("utf-8")) for doc in train_docs),
        "val_bytes": sum(len(doc.encode("utf-8")) for doc in val_docs),
        "n_documents": len(docs),
        "source": {
            **source,
            "files": len(files),
            "skipped": skipped,
            "tokenizer": kind,
            "vocab_size": vocab_size if kind == "bpe" else None,
        },
    }
    write_json(out / META_FILE, meta)
    return meta


def _read_documents(files: Sequence[Path], progress: bool) -> tuple[list[str], list[str]]:
    """(non-empty texts, skipped paths): binary, non-UTF-8 and unreadable files are skipped."""
    docs: list[str] = []
    skipped: list[str] = []
    for file in tqdm(files, desc="reading", unit="file", disable=not progress):
        try:
            raw = file.read_bytes()
            if b"\0" in raw:  # text files never hold NUL bytes; images, archives, .pyc do
                raise ValueError("a binary file")
            text = raw.decode("utf-8")
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc
            warnings.warn(f"skipping {file}: {reason}", stacklevel=3)
            skipped.append(str(file))
            continue
        if text:
            docs.append(text)
    return docs, skipped


def _make_tokenizer(
    spec: str | Path | Tokenizer, vocab_size: int, docs: list[str], progress: bool
) -> tuple[Tokenizer, str]:
    """The tokenizer and how it was made: "bpe", "char" or the file it was loaded from."""
    if isinstance(spec, Tokenizer):
        return spec, "given"
    if spec in ("bpe", "char"):
        if progress:
            chars = sum(len(doc) for doc in docs)
            what = f"byte-level BPE ({vocab_size} tokens)" if spec == "bpe" else "a char tokenizer"
            tqdm.write(f"training {what} on {chars:,} characters", file=sys.stderr)
        tok = Tokenizer.train_bpe(docs, vocab_size) if spec == "bpe" else Tokenizer.train_char(docs)
        return tok, str(spec)
    return Tokenizer.from_file(spec), str(spec)


def _choose_dtype(vocab_size: int, dtype: str | None) -> str:
    if dtype is None:
        return "uint16" if vocab_size <= 2**16 else "uint32"
    limit = int(np.iinfo(DTYPES[dtype]).max) + 1
    if vocab_size > limit:
        raise DecoderLMError(
            f"a vocabulary of {vocab_size} tokens does not fit in {dtype} "
            f"(at most {limit} ids): use uint32"
        )
    return dtype


def _write_tokens(path: Path, docs: list[str], tok: Tokenizer, dtype: np.dtype, bar: tqdm) -> int:
    """Encode `docs` (each followed by end-of-text) into a flat binary file; return the count."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for i in range(0, len(docs), ENCODE_CHUNK):
            chunk = docs[i : i + ENCODE_CHUNK]
            eot = [] if tok.eot_id is None else [tok.eot_id]
            ids = np.concatenate(
                [np.asarray(d + eot, dtype=dtype) for d in tok.encode_batch(chunk)]
            )
            f.write(ids.tobytes())
            count += len(ids)
            bar.update(sum(len(doc) for doc in chunk))
    return count


def _check_prepare_args(
    tokenizer: Any, vocab_size: Any, val_fraction: Any, max_files: Any, dtype: Any
) -> None:
    if not isinstance(tokenizer, (str, Path, Tokenizer)):
        raise DecoderLMError(f"tokenizer={tokenizer!r} must be 'bpe', 'char' or a tokenizer.json")
    named = isinstance(tokenizer, (str, Path)) and tokenizer not in ("bpe", "char")
    if named and not Path(tokenizer).exists():
        raise DecoderLMError(
            f"tokenizer={str(tokenizer)!r} must be 'bpe', 'char' or an existing tokenizer.json"
        )
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise DecoderLMError(f"vocab_size={vocab_size!r} must be a positive integer")
    if not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise DecoderLMError(f"val_fraction={val_fraction!r} must be between 0 and 1 (exclusive)")
    if max_files is not None and (not isinstance(max_files, int) or max_files < 1):
        raise DecoderLMError(f"max_files={max_files!r} must be a positive integer")
    if dtype is not None and dtype not in DTYPES:
        raise DecoderLMError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")


def _is_complete(data_dir: Path) -> bool:
    """Whether `data_dir` holds a finished preparation (meta.json and bins of matching sizes)."""
    try:
        for split in SPLITS:
            load_split(data_dir, split)
    except DecoderLMError:
        return False
    return (data_dir / TOKENIZER_FILE).is_file()
