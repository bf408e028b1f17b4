"""The ``none`` cache: a cache backend that caches nothing, registered by a built-in plugin like any other, so
``cache_backend="none"`` (the default) goes through the same registry and the same loading as ``tea_cache``."""

from __future__ import annotations

from typing import Any

from omni_core.cache.base import CacheBackend


class NoCacheBackend(CacheBackend):
    """Computes every step: ``enable``/``disable`` install nothing and requests get no cache metrics."""

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """Accept any ``cache_config``: without a cache it has nothing to configure and is ignored (as it
        always was), so switching ``cache_backend`` off never makes a config invalid."""
