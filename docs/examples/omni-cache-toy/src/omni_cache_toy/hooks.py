"""Entry-point module: registers the ``every_other`` cache backend. Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import CacheBackendSpec


@hookimpl
def omni_register_cache_backends():
    return [CacheBackendSpec(
        name="every_other",
        impl="omni_cache_toy.backend:EveryOtherStep",
        requires=("torch",),
        description="worked example: compute the denoiser on every `interval`-th step of a request, reuse it between",
    )]
