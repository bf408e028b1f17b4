"""Where a wave's time goes: inside the model's pipeline or in the engine around it.

The runner times every call into the pipeline during a wave, so the engine can subtract it from the wave's
wall time and report its own cost per denoising step (scheduling, transport, bookkeeping, progress and
preview events, output delivery). That split is what ``bench/hot_path.py`` prints and what
``engine.stats()`` accumulates; it costs two ``perf_counter`` calls per pipeline call.

Inside ``denoise_step``, an ``instrument``-stage hook (:mod:`omni_core.worker.instrument`, the outermost stage
of :mod:`omni_core.hooks`' registry) on every declared denoiser counts the calls into the denoiser itself and their
time (``denoiser_calls``, ``denoiser_s``), as the caller made them: with a cache, reused calls count too (they
are cheap), and a call a cache splits per request counts once. ``denoise_s - denoiser_s`` is then the step's
own cost around the model (CFG combination, the scheduler step, latent packing). The times are host wall time:
on an accelerator a call returns once its kernels are queued, so there ``denoiser_s`` can be far below the
model's device time (``denoise_s``, whose scheduler step waits for the result, is the upper bound).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

#: keys a ``RunnerOutput.metrics`` carries for its wave (merged across data-parallel replicas by ``max``,
#: as replicas run side by side): seconds inside pipeline calls, of which inside ``denoise_step``, and how
#: many ``denoise_step`` calls (denoising steps of the wave) there were; seconds inside the declared denoisers'
#: forward calls and how many such calls (CFG branches and experts each count)
WAVE_TIMING_KEYS = ("pipeline_s", "denoise_s", "denoise_calls", "denoiser_s", "denoiser_calls")


_local = threading.local()


def lane_clock(default: WaveClock) -> WaveClock:
    """The clock of the CPU lane running on this thread (``default`` outside lanes; ``omni_core.worker.lanes``)."""
    return getattr(_local, "clock", None) or default


@contextlib.contextmanager
def on_lane_clock(clock: WaveClock) -> Iterator[None]:
    """Count this thread's pipeline calls on ``clock`` (a lane's) while the block runs."""
    _local.clock = clock
    try:
        yield
    finally:
        _local.clock = None


class WaveClock:
    """Accumulates pipeline time for the current wave; ``take()`` returns it and starts the next."""

    def __init__(self) -> None:
        self.pipeline_s = 0.0
        self.denoise_s = 0.0
        self.denoise_calls = 0
        #: inside the declared denoisers' forward (the :class:`DenoiserTimer` hooks)
        self.denoiser_s = 0.0
        self.denoiser_calls = 0
        #: time spent in the runner's own callbacks while ``forward`` runs (request path): not the model's
        self._excluded_s = 0.0
        #: callables whose dicts ``take()`` adds (cumulative snapshots, e.g. the embedding cache's counters)
        self.sources: list[Callable[[], dict]] = []

    def timed(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``, counted as pipeline time."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.pipeline_s += time.perf_counter() - t0

    def wrap_denoise(self, denoise_step: Callable) -> Callable:
        """``denoise_step`` that also counts its calls and time (installed on the pipeline instance, so
        the base ``forward`` loop and the step path are both seen); inside a lane, on the lane's clock."""
        def timed_denoise_step(states: list) -> list:
            t0 = time.perf_counter()
            try:
                return denoise_step(states)
            finally:
                clock = lane_clock(self)
                clock.denoise_s += time.perf_counter() - t0
                clock.denoise_calls += 1

        timed_denoise_step.__wrapped__ = denoise_step  # type: ignore[attr-defined]
        return timed_denoise_step

    def excluded(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` run from inside a timed pipeline call but not counted as the model's time (the
        abort poll and progress callbacks of ``forward``)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._excluded_s += time.perf_counter() - t0

    def absorb_lanes(self, lanes: list[WaveClock]) -> None:
        """Add what lanes that ran side by side inside one timed call counted: the slowest lane's denoise
        time, calls and callback time (their sum would count the same wall time twice)."""
        self.denoise_s += max(c.denoise_s for c in lanes)
        self.denoise_calls += max(c.denoise_calls for c in lanes)
        self.denoiser_s += max(c.denoiser_s for c in lanes)
        self.denoiser_calls += max(c.denoiser_calls for c in lanes)
        self._excluded_s += max(c._excluded_s for c in lanes)

    def take(self) -> dict[str, float]:
        out = {"pipeline_s": max(0.0, self.pipeline_s - self._excluded_s), "denoise_s": self.denoise_s,
               "denoise_calls": self.denoise_calls, "denoiser_s": self.denoiser_s,
               "denoiser_calls": self.denoiser_calls}
        self.pipeline_s = self.denoise_s = self.denoiser_s = self._excluded_s = 0.0
        self.denoise_calls = self.denoiser_calls = 0
        for source in self.sources:
            out.update(source())
        return out


def merge_wave_timings(parts: list[dict[str, Any]]) -> dict[str, float]:
    """One wave's timing from the replicas that ran parts of it side by side (the slowest decides)."""
    merged = {k: max((p.get(k, 0) for p in parts), default=0) for k in WAVE_TIMING_KEYS}
    caches = [snap for p in parts for snap in p.get("embedding_cache", ())]  # one per replica: all kept
    if caches:
        merged["embedding_cache"] = caches
    return merged
