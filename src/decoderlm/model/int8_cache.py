"""Old home of `decoderlm.model.cache.storage`, kept only for serving/engine.py, which another
branch is rewriting: delete once it imports `decoderlm.model.cache`."""

from decoderlm.model.cache.storage import check_kv_cache_dtype

__all__ = ["check_kv_cache_dtype"]
