"""Built-in plugin: the ``none`` cache backend (every step computed), the default ``cache_backend``."""

from omni_core.plugins.hookspecs import hookimpl
from omni_core.plugins.types import CacheBackendSpec


@hookimpl(trylast=True)
def omni_register_cache_backends():
    return [CacheBackendSpec(name="none", impl="omni_core.cache.none:NoCacheBackend",
                             description="no step cache: every denoising step is computed")]
