"""The on-disk format of a data directory and its readers, and the reader of UTF-8 text inputs.

A data directory holds

    DIR/train.bin, DIR/val.bin  token ids, flat little-endian uint16 (uint32 when vocab_size > 65536)
    DIR/tokenizer.json          the tokenizer that made them (Hugging Face format)
    DIR/meta.json               vocab_size, dtype, eot_id, tokens and UTF-8 bytes of text per split,
                                n_documents, and what it was made from

A chat data directory (meta.json's "kind": "chat") holds conversations instead
(`decoderlm.data.chat`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from decoderlm.checkpoint import TOKENIZER_FILE
from decoderlm.errors import DecoderLMError
from decoderlm.files import require_file

META_FILE = "meta.json"
SPLITS = ("train", "val")
# What `prepare` writes.
DATA_FILES = (*(f"{split}.bin" for split in SPLITS), TOKENIZER_FILE, META_FILE)
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # little-endian on every machine
META_KEYS = (
    "vocab_size",
    "dtype",
    "tokenizer",
    "eot_id",
    "train_tokens",
    "val_tokens",
    "train_bytes",
    "val_bytes",
    "n_documents",
)
CHAT_META_KEYS = (
    "vocab_size",
    "source",
    "train_tokens",
    "val_tokens",
    "train_trained_tokens",
    "val_trained_tokens",
)
DATA_FORMAT = 1  # bump when the files' meaning changes: it is part of the default corpus' cache key


def read_text_file(path: str | Path) -> str:
    """The contents of a UTF-8 text file, with a one-line error if it is missing, not a regular
    file or not UTF-8."""
    path = require_file(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DecoderLMError(f"{path} is not UTF-8 text: {exc}") from None


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """meta.json of a prepared data directory, checked for the keys every reader relies on."""
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    if not data_dir.is_dir():
        raise DecoderLMError(f"no such data directory: {data_dir}")
    if not path.is_file():
        raise DecoderLMError(
            f"{data_dir} is not a prepared data directory: {META_FILE} is missing "
            f"(run `decoderlm prepare --out {data_dir}`)"
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DecoderLMError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise DecoderLMError(f"{path} is not a JSON object")
    chat = meta.get("kind") == "chat"  # conversations: decoderlm.data.chat
    missing = [k for k in (CHAT_META_KEYS if chat else META_KEYS) if k not in meta]
    if missing:
        raise DecoderLMError(f"{path} lacks {', '.join(missing)}: prepare the data again")
    if not chat and meta["dtype"] not in DTYPES:
        raise DecoderLMError(f"{path}: dtype {meta['dtype']!r} is not one of {sorted(DTYPES)}")
    return meta


def load_split(data_dir: str | Path, split: str) -> np.ndarray:
    """The token ids of `split` ("train" or "val") as a read-only 1-D memmap."""
    if split not in SPLITS:
        raise DecoderLMError(f"split={split!r} must be one of {SPLITS}")
    meta = read_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    dtype = DTYPES[meta["dtype"]]
    n_tokens = meta[f"{split}_tokens"]
    if not path.is_file():
        raise DecoderLMError(f"{path} is missing: prepare the data again")
    size = path.stat().st_size
    if size != n_tokens * dtype.itemsize:
        raise DecoderLMError(
            f"{path} has {size} bytes but meta.json says {n_tokens} {meta['dtype']} tokens "
            f"({n_tokens * dtype.itemsize} bytes): prepare the data again"
        )
    if n_tokens == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
