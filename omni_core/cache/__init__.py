"""Cache backend interface (concrete backends are plugins: ``tea_cache``, ``cache_dit``) and the helpers they
share: :mod:`omni_core.cache.rows` (pick, slice and join a call's rows) and :mod:`omni_core.cache.calls` (which
requests a denoiser call covers, running only some of them). Imports no torch."""

from omni_core.cache.base import CacheBackend

__all__ = ["CacheBackend"]
