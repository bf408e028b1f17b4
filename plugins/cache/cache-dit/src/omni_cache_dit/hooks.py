"""Entry-point module: registers the ``cache_dit`` backend. Imports nothing heavy (not even cache_dit)."""

from omni_core import hookimpl
from omni_core.plugins.types import CacheBackendSpec

from omni_cache_dit.config import OPTIONS


@hookimpl
def omni_register_cache_backends():
    return [CacheBackendSpec(
        name="cache_dit",
        impl="omni_cache_dit.backend:CacheDiTBackend",
        requires=("cache_dit",),
        description="cache-dit DBCache (Fn/Bn compute blocks, residual threshold, warmup, TaylorSeer, SCM); "
                    "a cache context per request, CFG branch and expert",
        options=OPTIONS,
        # decisions on each rank's share of the sequence are not agreed across the group (the core refuses the pair)
        refuses={sp: "cache_dit takes its skip decisions on each rank's share of the sequence and they are not agreed "
                     "across the sequence-parallel group (tea_cache's are: use it instead)" for sp in ("ulysses", "ring")},
    )]
