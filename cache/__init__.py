"""Content-addressed cache of compiled kernels (see ``key.py`` and ``store.py``)."""

from hipc.cache.key import CacheKey
from hipc.cache.store import KernelCache, default_cache_dir, max_bytes_from_env

__all__ = ["CacheKey", "KernelCache", "default_cache_dir", "max_bytes_from_env"]
