"""The runner's instrumentation through the hook registry: an ``instrument``-stage hook on every declared
denoiser that counts the calls into it and their time on the :class:`~omni_core.worker.timing.WaveClock` of the
lane running it (``denoiser_calls``, ``denoiser_s`` of a wave; ``engine.stats()["timing"]`` sums them). Being
the outermost stage, it sees each call as ``denoise_step`` made it, caches and compiled blocks included. Kept
apart from :mod:`omni_core.worker.timing`, which the engine's process imports, because the registry imports
diffusers.
"""

from __future__ import annotations

import time
from typing import Any

from omni_core.hooks import STAGES, ModuleHook, add_hook, get_hook
from omni_core.worker.timing import WaveClock, lane_clock

#: the registry name of the timing hook on every declared denoiser
INSTRUMENT_HOOK = "instrument.timing"


class DenoiserTimer(ModuleHook):
    """``instrument``-stage hook: times each call into a denoiser (everything below it: caches, LoRA, compiled
    blocks, the model) on the clock of the lane running it."""

    order = STAGES["instrument"]

    def __init__(self, clock: WaveClock) -> None:
        super().__init__()
        self.clock = clock

    def new_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn_ref.original_forward(*args, **kwargs)
        finally:
            clock = lane_clock(self.clock)
            clock.denoiser_s += time.perf_counter() - t0
            clock.denoiser_calls += 1


def instrument_denoisers(pipeline: Any, clock: WaveClock) -> list[str]:
    """Put a :class:`DenoiserTimer` on every denoiser ``pipeline`` declares (none for a pipeline that declares
    none); returns the denoisers' names."""
    specs = pipeline.denoisers() if hasattr(pipeline, "denoisers") else []
    names = []
    for spec in specs or []:
        if get_hook(spec.module, INSTRUMENT_HOOK) is None:  # two specs may share one module
            add_hook(spec.module, INSTRUMENT_HOOK, DenoiserTimer(clock))
        names.append(spec.name)
    return names
