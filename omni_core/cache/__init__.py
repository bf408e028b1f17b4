"""Cache backend interface (concrete backends are plugins: ``tea_cache``, ``cache_dit``) and the per-row
helpers they share."""

from omni_core.cache.base import CacheBackend

__all__ = ["CacheBackend"]
