"""Per-layer inference state: the KV caches a model decodes over, and the contract they keep.

The contract (`protocol`): attention sees one layer's state through `LayerCache` — `update(k, v)`
stores this step's keys/values and returns those to attend, `key_padding_mask` (None: the
caller's) masks them, `attend_in_place(q, k, v, scale)` may attend the step itself (None: not
handled, `update` is used), `rollback(n)` forgets the last n tokens written (a recurrent state:
back to its `checkpoint()`, `forgets(n)` ≥ n tokens). `BaseLayerCache` has the defaults (no mask
of its own, nothing in place, no rollback, no checkpoint); `LayerCaches` holds every layer.

The step (`step`): before each forward pass the caller fills one `CacheStep` — the new tokens'
cache slots, the end of the keys attended, which new tokens are real — and hands it to the whole
cache with `seek(step)`; every cache here has that one signature. (The paged pool of
`decoderlm.engine.kv_pool` is seeked by block tables, whose positions differ per row.)

The caches: `static` (`StaticKVCache`: max_len slots per layer), `ring` (`RingKVCache`: W slots per
windowed layer), `recurrent` (`HybridCache`: a recurrent layer's conv and matrix state, a static
layer for each attention layer; `state_parts`: a sequence's states laid out as raw bytes, which
the engine keeps in pages); `make_cache` picks one from the config. Their storage (`storage`) is
a tensor in the model's dtype or an `Int8Buffer` (kv_cache_dtype "int8"): a storage choice, not a
cache type. `sizes` counts their bytes.

A new kind of state (a recurrent layer's conv and matrix state, say) is a new module here: a
`BaseLayerCache` subclass keyed by the same `CacheStep`, its cache a `LayerCaches` with `seek`.
"""

from decoderlm.model.cache.make import make_cache
from decoderlm.model.cache.protocol import BaseLayerCache, LayerCache, LayerCaches
from decoderlm.model.cache.recurrent import (
    HybridCache,
    RecurrentLayerCache,
    StatePart,
    recurrent_state_bytes,
    recurrent_state_dtype,
    recurrent_state_shapes,
    state_parts,
)
from decoderlm.model.cache.ring import RingKVCache, RingLayerCache
from decoderlm.model.cache.sizes import (
    KVDtype,
    attention_kind,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_table,
)
from decoderlm.model.cache.static import StaticKVCache, StaticLayerCache
from decoderlm.model.cache.step import CacheStep
from decoderlm.model.cache.storage import (
    KV_CACHE_DTYPES,
    Int8Buffer,
    check_kv_cache_dtype,
    kv_buffer,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "BaseLayerCache",
    "CacheStep",
    "HybridCache",
    "Int8Buffer",
    "KVDtype",
    "LayerCache",
    "LayerCaches",
    "RecurrentLayerCache",
    "RingKVCache",
    "RingLayerCache",
    "StatePart",
    "StaticKVCache",
    "StaticLayerCache",
    "attention_kind",
    "check_kv_cache_dtype",
    "kv_buffer",
    "kv_cache_bytes",
    "kv_cache_bytes_per_token",
    "kv_cache_table",
    "make_cache",
    "recurrent_state_bytes",
    "recurrent_state_dtype",
    "recurrent_state_shapes",
    "state_parts",
]
