"""The cache a model decodes over, chosen from its config: the one place that picks a cache type."""

from __future__ import annotations

import torch

from decoderlm.model.cache.recurrent import HybridCache
from decoderlm.model.cache.ring import RingKVCache
from decoderlm.model.cache.static import StaticKVCache
from decoderlm.model.config import ModelConfig


def make_cache(
    config: ModelConfig,
    batch_size: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    kv_cache_dtype: str | None = None,
) -> StaticKVCache | RingKVCache | HybridCache:
    """Rings for a windowed model, attention and recurrent layers' states for a model with
    recurrent layers, else static buffers; the K/V either in `dtype` or int8."""
    if config.has_recurrent_layers:
        cache = HybridCache
    elif config.sliding_window is not None:
        cache = RingKVCache
    else:
        cache = StaticKVCache
    return cache(config, batch_size, max_len, dtype, device, kv_cache_dtype)
