"""Batches of windows drawn from a token array: `BatchSampler`.

`BatchSampler` draws (x, y) windows from a split, y = x shifted by one token, from a counter-based
seeded stream: batch k depends only on (seed, k), so its whole state is a step counter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from decoderlm.errors import DecoderLMError

CHUNK_TOKENS = 1 << 18  # tokens a BatchSampler draws at once, at most


class BatchSampler:
    """Random (x, y) windows of `context_length` tokens from a 1-D token array.

    Batches are drawn `chunk` at a time (one generator, one gather, up to 64 batches and 2¹⁸
    tokens): chunk c from `numpy.random.Generator(PCG64(SeedSequence([seed, mode, c])))`. Batch k
    is row k mod chunk of chunk k // chunk, so the state is just k (`step`) and a resumed sampler
    continues the same stream exactly. (Drawn one at a time, the numpy calls of each batch run on
    caches a training step has just cooled, a measurable share of a small model's step.)

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
        self.chunk = max(1, min(64, CHUNK_TOKENS // (self.global_batch * (context_length + 1))))
        self._chunk_id = -1
        self._x = self._y = torch.zeros(0, dtype=torch.int64)

    @property
    def epoch(self) -> int:
        """Passes over the data so far, counted in non-overlapping windows."""
        return self.step * self.global_batch // self.n_blocks

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (x, y), int64 tensors of shape (batch_size, context_length)."""
        chunk_id, row = divmod(self.step, self.chunk)
        if chunk_id != self._chunk_id:
            self._x, self._y = self._draw_chunk(chunk_id)
            self._chunk_id = chunk_id
        self.step += 1
        return self._x[row], self._y[row]

    def _draw_chunk(self, chunk_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's windows of batches chunk_id·chunk … (chunk_id + 1)·chunk − 1: x, y (chunk, B, T)."""
        n = self.chunk * self.global_batch
        if self.without_replacement:  # positions in the stream of all epochs' windows
            starts = self._block_ids(chunk_id * n, n) * self.context_length
        else:
            starts = self._rng(0, chunk_id).integers(0, self.n_starts, size=n)
        starts = starts.reshape(self.chunk, self.world_size, self.batch_size)[:, self.rank]
        index = starts[..., None] + np.arange(self.context_length + 1)  # (chunk, B, T+1)
        window = torch.from_numpy(self.tokens[index].astype(np.int64))  # (chunk, B, T+1)
        return window[..., :-1].contiguous(), window[..., 1:].contiguous()  # y_t = x_{t+1}

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
        self._chunk_id = -1  # drawn for the old seed

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
