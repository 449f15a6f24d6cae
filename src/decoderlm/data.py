"""Corpora as token files (nanoGPT's `prepare.py` format), and batches of windows drawn from them.

A data directory holds

    DIR/train.bin, DIR/val.bin  token ids, flat little-endian uint16 (uint32 when vocab_size > 65536)
    DIR/tokenizer.json          the tokenizer that made them (Hugging Face format)
    DIR/meta.json               vocab_size, dtype, eot_id, tokens and UTF-8 bytes of text per split,
                                n_documents, and what it was made from

`BatchSampler` draws (x, y) windows from a split, y = x shifted by one token, from a counter-based
seeded stream: batch k depends only on (seed, k), so its whole state is a step counter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decoderlm.errors import DecoderLMError

META_FILE = "meta.json"
SPLITS = ("train", "val")
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
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DecoderLMError(f"{path} lacks {', '.join(missing)}: prepare the data again")
    if meta["dtype"] not in DTYPES:
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


class BatchSampler:
    """Random (x, y) windows of `context_length` tokens from a 1-D token array.

    Batch k is drawn from `numpy.random.Generator(PCG64(SeedSequence([seed, mode, k])))`, so the
    state is just k (`step`) and a resumed sampler continues the same stream exactly.

    - With replacement (default): window starts uniform in [0, len(tokens) - context_length).
    - `without_replacement`: the non-overlapping windows starting at multiples of context_length,
      in a seeded permutation per epoch; the stream of windows is the concatenation of the epochs'
      permutations, so every window is used once per epoch and a batch may straddle two epochs.

    Distributed: every rank draws the same global batch of world_size·batch_size windows and
    returns rows [rank·batch_size, (rank+1)·batch_size), so one process with
    batch_size·world_size sees exactly the union of the ranks' batches.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        context_length: int,
        seed: int = 0,
        without_replacement: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("context_length", context_length),
            ("world_size", world_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise DecoderLMError(f"{name}={value!r} must be a positive integer")
        if not isinstance(seed, int) or seed < 0:
            raise DecoderLMError(f"seed={seed!r} must be a non-negative integer")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DecoderLMError(f"rank={rank!r} must be in [0, world_size={world_size})")
        if tokens.ndim != 1:
            raise DecoderLMError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        check_context_length(tokens, context_length)
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.seed = seed
        self.without_replacement = without_replacement
        self.rank = rank
        self.world_size = world_size
        self.step = 0  # global batches drawn so far
        self.global_batch = batch_size * world_size
        self.n_starts = len(tokens) - context_length  # possible starts of a window of T+1 tokens
        self.n_blocks = (len(tokens) - 1) // context_length  # non-overlapping windows
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """Passes over the data so far, counted in non-overlapping windows."""
        return self.step * self.global_batch // self.n_blocks

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y), int64 tensors of shape (batch_size, context_length)."""
        first = self.rank * self.batch_size  # this rank's rows of the global batch
        if self.without_replacement:
            position = self.step * self.global_batch + first  # in the stream of all epochs
            starts = self._block_ids(position, self.batch_size) * self.context_length
        else:
            rng = self._rng(0, self.step)
            starts = rng.integers(0, self.n_starts, size=self.global_batch)
            starts = starts[first : first + self.batch_size]
        self.step += 1
        index = starts[:, None] + np.arange(self.context_length + 1)  # (B, T+1)
        window = torch.from_numpy(self.tokens[index].astype(np.int64))  # (B, T+1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()  # y_t = x_{t+1}

    def state_dict(self) -> dict[str, Any]:
        """Small and JSON-serialisable: the position in the stream plus what it depends on."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "context_length": self.context_length,
            "n_tokens": len(self.tokens),
            "without_replacement": self.without_replacement,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream of `state`; the data and the global batch geometry must match."""
        mine = self.state_dict()
        for key in ("global_batch", "context_length", "n_tokens", "without_replacement"):
            if key not in state:
                raise DecoderLMError(f"sampler state lacks {key!r}")
            if state[key] != mine[key]:
                raise DecoderLMError(
                    f"cannot resume the data stream: it was saved with {key}={state[key]!r}, "
                    f"this run has {key}={mine[key]!r}"
                )
        self.seed = int(state["seed"])
        self.step = int(state["step"])

    def _rng(self, mode: int, counter: int) -> np.random.Generator:
        return np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([self.seed, mode, counter]))
        )

    def _block_ids(self, position: int, count: int) -> np.ndarray:
        """Ids of the windows at [position, position + count) of the concatenated epochs."""
        parts = []
        while count > 0:
            epoch, offset = divmod(position, self.n_blocks)
            if epoch != self._perm_epoch:  # one permutation cached: batches walk forward
                self._perm = self._rng(1, epoch).permutation(self.n_blocks)
                self._perm_epoch = epoch
            take = min(count, self.n_blocks - offset)
            parts.append(self._perm[offset : offset + take])
            position += take
            count -= take
        return np.concatenate(parts)


def check_context_length(tokens: np.ndarray, context_length: int) -> None:
    """Raise a one-line error if `tokens` cannot hold one window of context_length + 1 tokens."""
    if len(tokens) < context_length + 1:
        name = getattr(tokens, "filename", None) or "the token array"
        raise DecoderLMError(
            f"{name} has {len(tokens)} tokens, fewer than context_length + 1 = "
            f"{context_length + 1}: use a shorter context or more data"
        )
