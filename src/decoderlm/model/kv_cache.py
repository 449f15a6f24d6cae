"""A static key/value cache for autoregressive decoding (the gpt-fast layout).

Each layer's keys and values live in buffers allocated once per generation, shaped
(batch, n_kv_heads, max_len, head_dim). A forward pass writes its new K/V (after RoPE) into them
with `index_copy_` at the cache slots it is told, then attends to the slots filled so far — so a
decoding step allocates no new K/V memory and never re-attends the prompt from scratch.

With grouped-query (Ainslie et al., 2023) or multi-query attention (Shazeer, 2019) only the
n_kv_heads shared heads are stored: the cache is n_kv_heads / n_heads the size of an MHA cache.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from decoderlm.model.config import ModelConfig

# A cache's element type: a torch dtype, or "int8" for the quantized cache of
# `decoderlm.model.int8_cache` (int8 values and one KV_SCALE_DTYPE scale per token and head).
KVDtype = torch.dtype | str
KV_SCALE_DTYPE = torch.float32


def kv_cache_bytes_per_token(config: ModelConfig, dtype: KVDtype = torch.float32) -> int:
    """Bytes the cache stores per token and sequence: 2 (K and V) · n_layers · n_kv_heads ·
    (head_dim · size + scale), scale = 4 bytes for "int8" (its float32 scale), else 0."""
    if dtype in ("int8", torch.int8):
        element, scale = 1, KV_SCALE_DTYPE.itemsize
    else:
        element, scale = torch.empty((), dtype=dtype).element_size(), 0
    return 2 * config.n_layers * config.n_kv_heads * (config.head_dim * element + scale)


def kv_cache_bytes(
    config: ModelConfig, n_tokens: int, batch_size: int = 1, dtype: KVDtype = torch.float32
) -> int:
    """Bytes of a cache holding `n_tokens` tokens for each of `batch_size` sequences."""
    return batch_size * n_tokens * kv_cache_bytes_per_token(config, dtype)


def attention_kind(config: ModelConfig) -> str:
    """ "MHA", "GQA" or "MQA" from the number of K/V heads."""
    if config.n_kv_heads == config.n_heads:
        return "MHA"
    return "MQA" if config.n_kv_heads == 1 else "GQA"


def kv_cache_table(
    config: ModelConfig,
    contexts: tuple[int, ...] = (4096, 32768, 131072),
    dtype: KVDtype = torch.float32,
    window: int | None = None,
    window_layers: int | None = None,
) -> list[dict[str, object]]:
    """Cache bytes per token and at each context (batch 1) for this model and its MHA and MQA twins.

    The twins keep every other number of the shape (layers, heads, head_dim), so the rows differ
    only in n_kv_heads: the memory GQA and MQA save at long context. With a sliding `window` of W
    tokens in `window_layers` of the layers (None: all), "bytes_at_windowed" holds what a cache
    keeps at context n: per layer and token bytes · (L_w · min(n, W) + (n_layers − L_w) · n).
    """
    n_windowed = config.n_layers if window_layers is None else window_layers
    variants = {"model": config.n_kv_heads, "MHA": config.n_heads, "MQA": 1}
    rows = []
    for name, n_kv in variants.items():
        twin = dataclasses.replace(config, n_kv_heads=n_kv)
        rows.append(
            {
                "variant": name,
                "attention": attention_kind(twin),
                "n_kv_heads": n_kv,
                "bytes_per_token": kv_cache_bytes_per_token(twin, dtype),
                "bytes_at": {n: kv_cache_bytes(twin, n, 1, dtype) for n in contexts},
            }
        )
        if window is not None:
            per_layer = kv_cache_bytes_per_token(twin, dtype) // config.n_layers
            rows[-1]["bytes_at_windowed"] = {
                n: per_layer * (n_windowed * min(n, window) + (config.n_layers - n_windowed) * n)
                for n in contexts
            }
    return rows


class StaticLayerCache:
    """One layer's buffers. `update(k, v)` stores this step's K/V and returns the keys/values to attend."""

    def __init__(self, k: Tensor, v: Tensor, slots: Tensor | None = None) -> None:
        self.k, self.v = k, v  # (B, Hkv, max_len, hd) each
        # (T,) the slots written by the next update
        self.slots = torch.zeros(1, dtype=torch.long, device=k.device) if slots is None else slots
        self.end: int | None = None  # attend to slots [0, end); None = the whole buffer

    def store(self, k: Tensor, v: Tensor) -> None:
        """k, v (B, Hkv, T, hd) go to `slots`."""
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """`store(k, v)`; returns the (B, Hkv, end or max_len, hd) keys and values to attend."""
        self.store(k, v)
        if self.end is None:
            return self.k, self.v
        return self.k[:, :, : self.end], self.v[:, :, : self.end]


class StaticKVCache:
    """The caches of all layers, indexed as `kv_caches[i]` by `DecoderLM.forward`.

    Before each forward call `seek(slots, end)`: the new tokens go to cache slots `slots` (T,), and
    attention sees slots [0, end). Filling slots 0..T−1 with end = T is a prefill whose causal mask
    (aligned bottom-right by the attention) is the usual triangle. `end=None` attends the whole
    buffer, a fixed shape for `torch.compile`; the caller's key mask then hides the unfilled slots.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_len = max_len
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        zeros = functools.partial(torch.zeros, shape, dtype=dtype, device=device)
        self.layers = [StaticLayerCache(zeros(), zeros()) for _ in range(config.n_layers)]

    def __getitem__(self, i: int) -> StaticLayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def seek(self, slots: Tensor, end: int | None) -> None:
        for layer in self.layers:
            layer.slots, layer.end = slots, end

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)
