"""Entry-point module: registers the ``every_other`` cache backend and declares its one ``cache_config`` key.
Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.options import Option
from omni_core.plugins.types import CacheBackendSpec

#: the keys of ``cache_config``: the core checks them before any worker starts, ``omni env`` and ``--help`` list them
OPTIONS = (Option(name="interval", type="int", min=1, default=2,
                  help="compute the denoiser every this many steps of a request (1: every step, no reuse)"),)


@hookimpl
def omni_register_cache_backends():
    return [CacheBackendSpec(
        name="every_other",
        impl="omni_cache_toy.backend:EveryOtherStep",
        requires=("torch",),
        description="worked example: compute the denoiser on every `interval`-th step of a request, reuse it between",
        options=OPTIONS,
    )]
