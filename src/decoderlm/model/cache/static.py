"""A static key/value cache for autoregressive decoding (the gpt-fast layout).

Each layer's keys and values live in buffers allocated once per generation, shaped
(batch, n_kv_heads, max_len, head_dim). A forward pass writes its new K/V (after RoPE) into them
with `index_copy_` at the cache slots of its `CacheStep`, then attends to the slots filled so far —
so a decoding step allocates no new K/V memory and never re-attends the prompt from scratch.

With grouped-query (Ainslie et al., 2023) or multi-query attention (Shazeer, 2019) only the
n_kv_heads shared heads are stored: the cache is n_kv_heads / n_heads the size of an MHA cache.
With kv_cache_dtype "int8" the buffers are `Int8Buffer`s (`decoderlm.model.cache.storage`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from decoderlm.model.cache.protocol import BaseLayerCache, LayerCaches
from decoderlm.model.cache.step import CacheStep, check_rollback
from decoderlm.model.cache.storage import Int8Buffer, layer_kv_buffers
from decoderlm.model.config import ModelConfig


class StaticLayerCache(BaseLayerCache):
    """One layer's buffers, k and v (B, Hkv, max_len, hd): `update(k, v)` stores this step's K/V
    at the step's slots and returns the keys/values of slots [0, end)."""

    def __init__(
        self, k: Tensor | Int8Buffer, v: Tensor | Int8Buffer, step: CacheStep | None = None
    ) -> None:
        super().__init__(k, v)
        self.seek(step or CacheStep(torch.zeros(1, dtype=torch.long, device=k.device)))

    def seek(self, step: CacheStep) -> None:
        self.slots = step.slots  # (T,) the slots written by the next update
        self.end = step.end  # attend to slots [0, end); None = the whole buffer

    def store(self, k: Tensor, v: Tensor) -> None:
        """k, v (B, Hkv, T, hd) go to `slots` (int8 storage quantizes them)."""
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """`store(k, v)`; returns the (B, Hkv, end or max_len, hd) keys and values, in the model's
        dtype (a view of a tensor buffer, the dequantized vectors of an int8 one)."""
        self.store(k, v)
        return self.k[:, :, : self.end], self.v[:, :, : self.end]

    def rollback(self, n: int) -> None:
        """Attend n slots fewer: the next step writes where the forgotten tokens were."""
        check_rollback(n, self.end, type(self).__name__)
        self.end -= n


class StaticKVCache(LayerCaches):
    """A `StaticLayerCache` of `max_len` slots for every layer.

    Before each forward call `seek(step)` (`CacheStep`): the new tokens go to slots `step.slots`
    (T,) and attention sees slots [0, step.end). Filling slots 0..T−1 with end = T is a prefill
    whose causal mask (aligned bottom-right by the attention) is the usual triangle. `end=None`
    attends the whole buffer, a fixed shape for `torch.compile`; the caller's key mask then hides
    the unfilled slots. Left padding too is the caller's key mask (`step.valid` is not needed).

    dtype: the model's, in which attention receives the keys and values; kv_cache_dtype: None
    (buffers in `dtype`) or "int8" (`Int8Buffer`s). `nbytes` =
    `kv_cache_bytes(config, max_len, batch_size, kv_cache_dtype or dtype)`.
    """

    layers: list[StaticLayerCache]

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str | None = None,
    ) -> None:
        self.max_len = max_len
        buffers = (config, batch_size, max_len, dtype, device, kv_cache_dtype)
        super().__init__(
            [StaticLayerCache(*layer_kv_buffers(*buffers)) for _ in range(config.n_layers)]
        )

    def seek(self, step: CacheStep) -> None:
        for layer in self.layers:
            layer.seek(step)
