"""What a KV cache costs: bytes per token and at a context, for a model and its MHA and MQA
twins."""

from __future__ import annotations

import dataclasses

import torch

from decoderlm.model.cache.storage import KV_SCALE_DTYPE
from decoderlm.model.config import ModelConfig

# A cache's element type: a torch dtype, or "int8" for int8 storage
# (`decoderlm.model.cache.storage`: int8 values and one KV_SCALE_DTYPE scale per token and head).
KVDtype = torch.dtype | str


def kv_cache_bytes_per_token(config: ModelConfig, dtype: KVDtype = torch.float32) -> int:
    """Bytes the cache stores per token and sequence: 2 (K and V) · attention layers · n_kv_heads ·
    (head_dim · size + scale), scale = 4 bytes for "int8" (its float32 scale), else 0."""
    if dtype in ("int8", torch.int8):
        element, scale = 1, KV_SCALE_DTYPE.itemsize
    else:
        element, scale = torch.empty((), dtype=dtype).element_size(), 0
    return 2 * config.n_attention_layers * config.n_kv_heads * (config.head_dim * element + scale)


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
    n_layers = config.n_attention_layers  # the layers that keep K/V
    n_windowed = n_layers if window_layers is None else window_layers
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
            per_layer = kv_cache_bytes_per_token(twin, dtype) // max(n_layers, 1)
            rows[-1]["bytes_at_windowed"] = {
                n: per_layer * (n_windowed * min(n, window) + (n_layers - n_windowed) * n)
                for n in contexts
            }
    return rows
