"""Cache backend interface (concrete backends are plugins: ``tea_cache``, ``cache_dit``)."""

from omni_core.cache.base import CacheBackend

__all__ = ["CacheBackend"]
