"""Old home of `decoderlm.model.cache.sizes`, kept only for serving/engine.py and
serving/playground.py, which another branch is rewriting: delete once they import
`decoderlm.model.cache`."""

from decoderlm.model.cache.sizes import attention_kind, kv_cache_bytes_per_token, kv_cache_table

__all__ = ["attention_kind", "kv_cache_bytes_per_token", "kv_cache_table"]
