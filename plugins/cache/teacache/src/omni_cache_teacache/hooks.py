"""Entry-point module: registers the ``tea_cache`` backend and the ``omni cache calibrate`` command. Imports
nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import CacheBackendSpec

from omni_cache_teacache.config import OPTIONS


@hookimpl
def omni_register_cache_backends():
    return [CacheBackendSpec(
        name="tea_cache",
        impl="omni_cache_teacache.backend:TeaCacheBackend",
        requires=("torch", "numpy"),
        description="TeaCache: skip the transformer blocks while the timestep-modulated input barely moves; "
                    "per-request decisions (batches, step batching, CFG branches, experts); any model that declares a "
                    "DenoiserSpec with modulated_input",
        options=OPTIONS,
    )]


@hookimpl
def omni_register_commands(subparsers):
    from omni_cache_teacache.calibrate import add_parser

    add_parser(subparsers)
