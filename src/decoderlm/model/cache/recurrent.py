"""The inference state of a recurrent layer: a fixed-size conv state and matrix state per sequence.

A recurrent mixer (`decoderlm.model.linear_attention`, `.gated_deltanet`, `.mamba2`) folds each
new token into a state S of fixed size, S_t = f(S_{t−1}, x_t), and reads its output from it, so
what it keeps between steps does not grow with the tokens: per layer and sequence a conv state
(C, K − 1), the last K − 1 inputs of its short convolution (none for linear attention), and a
matrix state (H, d_k, d_v) (linear attention: (H, d_k, d_v + 1), its normaliser z as the last
column). `RecurrentLayerCache` holds them, keyed by the same `CacheStep` as the KV caches:

- a step whose first slot is 0 starts a new sequence: the state is zeroed (a fresh prefill, a refill);
- `step.valid` (B, T) marks the real tokens; the mixer keeps a padded token out of the state
  (`decoderlm.model.scans.mask_padding`: it leaves S and the conv state as they were — with left
  padding, the zero state it started from);
- `rollback` goes back to a checkpoint: the state before the last n tokens is not kept (S_{t−n}
  cannot be recovered from S_t), so `checkpoint()` copies the states (fixed size: cheap) before
  tokens that may be dropped, e.g. a speculative verification pass over [t, d_1 … d_k], and a
  rollback of n > 0 of them restores that copy and forgets every token written since; the caller
  writes the kept ones again (`LayerCaches.rollback` returns how many tokens were forgotten and
  rolls the attention layers back as far, so they rewrite the same keys and values).

`HybridCache` holds one layer cache per layer: a `StaticLayerCache` for each attention layer, a
`RecurrentLayerCache` for each recurrent one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decoderlm.errors import DecoderLMError
from decoderlm.model.cache.protocol import BaseLayerCache, LayerCaches
from decoderlm.model.cache.static import StaticLayerCache
from decoderlm.model.cache.step import CacheStep
from decoderlm.model.cache.storage import layer_kv_buffers
from decoderlm.model.config import ModelConfig


def recurrent_state_shapes(
    config: ModelConfig, layer_type: str, batch_size: int
) -> tuple[tuple[int, ...] | None, tuple[int, ...]]:
    """(conv state shape or None, matrix state shape) of one recurrent layer of `layer_type`."""
    heads, _, d_k, d_v = config.recurrent_dims
    b, k = batch_size, config.recurrent_conv
    if layer_type == "linear_attention":  # no conv; the normaliser z is S's last column
        return None, (b, heads, d_k, d_v + 1)
    return (b, config.recurrent_conv_channels, k - 1), (b, heads, d_k, d_v)


def recurrent_state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The matrix states' dtype beside conv states in `dtype`: float32 at least (the scans')."""
    return torch.promote_types(dtype, torch.float32)


def recurrent_state_bytes(config: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of every recurrent layer's state for one sequence: the conv states in `dtype`, the
    matrix states in `recurrent_state_dtype(dtype)`. Independent of the context."""
    return sum(part.nbytes for part in state_parts(config, dtype))


@dataclass(frozen=True)
class StatePart:
    """One recurrent layer's conv or matrix state in a sequence's state bytes (`state_parts`)."""

    layer: int
    name: str  # "state" (the matrix state) or "conv"
    shape: tuple[int, ...]  # (1, ...): one sequence's
    dtype: torch.dtype
    offset: int  # its first byte

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def state_parts(config: ModelConfig, dtype: torch.dtype) -> list[StatePart]:
    """Where every recurrent layer's states lie in one sequence's `recurrent_state_bytes`, a
    model's states kept as raw bytes (the serving engine's pages): the matrix states first, then
    the conv states, so that every part starts at a multiple of its element size."""
    states: list[tuple[int, str, tuple[int, ...], torch.dtype]] = []
    convs: list[tuple[int, str, tuple[int, ...], torch.dtype]] = []
    for i in range(config.n_layers):
        kind = config.layer_type(i)
        if kind != "attention":
            conv, state = recurrent_state_shapes(config, kind, 1)
            states.append((i, "state", state, recurrent_state_dtype(dtype)))
            convs += [] if conv is None else [(i, "conv", conv, dtype)]
    parts, offset = [], 0
    for i, name, shape, part_dtype in states + convs:
        parts.append(StatePart(i, name, shape, part_dtype, offset))
        offset += parts[-1].nbytes
    return parts


class RecurrentLayerCache(BaseLayerCache):
    """One recurrent layer's state: `conv` (B, C, K − 1) or None, `state` (B, H, d_k, d_v), and
    the step's `valid` (B, T) or None; the mixer reads them and writes back the new ones."""

    def __init__(self, conv: Tensor | None, state: Tensor) -> None:
        self.conv, self.state = conv, state
        self.valid: Tensor | None = None
        self.saved: tuple[Tensor | None, Tensor] | None = None  # (conv, state) at the checkpoint
        self.since = 0  # tokens written since the checkpoint

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (0 if self.conv is None else self.conv.nbytes)

    def seek(self, step: CacheStep) -> None:
        # The first new slot, from host integers where the step has them (no device read).
        start = int(step.slots[0]) if step.end is None else step.end - step.slots.shape[0]
        if start == 0:  # a new sequence starts from the zero state
            self.state = torch.zeros_like(self.state)
            self.conv = None if self.conv is None else torch.zeros_like(self.conv)
            self.saved = None
        self.valid = step.valid
        self.since += step.slots.shape[0]

    def checkpoint(self) -> None:
        """Keep a copy of the states: a later `rollback` returns to them."""
        self.saved = (None if self.conv is None else self.conv.clone(), self.state.clone())
        self.since = 0

    def forgets(self, n: int) -> int:
        """0 for n = 0; else every token since the checkpoint (n where there is none: refused)."""
        return self.since if n and self.saved is not None else n

    def rollback(self, n: int) -> None:
        """n = 0: nothing; n = the tokens since the checkpoint: restore the checkpoint's states."""
        if n == 0:
            return
        if self.saved is None or n != self.since:
            raise DecoderLMError(
                f"a recurrent layer's state cannot roll back {n!r} tokens: the states before them "
                f"are not kept; it rolls back to its checkpoint only ({self.since} tokens since, "
                "or none taken): call checkpoint() before writing them"
            )
        (self.conv, self.state), self.saved, self.since = self.saved, None, 0


class HybridCache(LayerCaches):
    """A `StaticLayerCache` of `max_len` slots per attention layer, a `RecurrentLayerCache` per
    recurrent layer (`config.layer_types`); `seek(step)` as `StaticKVCache.seek`. max_len is
    unused when no layer is attention. kv_cache_dtype: the attention layers' storage (the
    recurrent states are kept in `dtype`, their matrix state in float32 at least)."""

    layers: list[StaticLayerCache | RecurrentLayerCache]

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str | None = None,
    ) -> None:
        state_dtype = recurrent_state_dtype(dtype)
        layers: list[StaticLayerCache | RecurrentLayerCache] = []
        for i in range(config.n_layers):
            kind = config.layer_type(i)
            if kind == "attention":
                kv = layer_kv_buffers(config, batch_size, max_len, dtype, device, kv_cache_dtype)
                layers.append(StaticLayerCache(*kv))
                continue
            conv, state = recurrent_state_shapes(config, kind, batch_size)
            layers.append(
                RecurrentLayerCache(
                    None if conv is None else torch.zeros(conv, dtype=dtype, device=device),
                    torch.zeros(state, dtype=state_dtype, device=device),
                )
            )
        super().__init__(layers)

    def seek(self, step: CacheStep) -> None:
        for layer in self.layers:
            layer.seek(step)
