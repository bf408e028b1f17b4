"""CPU lanes: a wave of several requests split across the cores, one torch thread per lane.

Why our own: torch's intra-op threads split each op, and the ops of a diffusion transformer at small sizes
(64-256 tokens per image) are too small for that to pay: on the 2-core CI machine a wave of 8 ``shapes``
requests ran 1.27x faster with two intra-op threads than with one, and when another process held one core
it ran 3-20x *slower*, every op waiting at an OpenMP barrier for the descheduled thread. Splitting the
wave's requests into one sub-batch per core and running the sub-batches side by side (torch releases the
GIL inside its kernels) keeps every core busy with whole ops and has no barrier to wait at: the same wave
ran 1.6x faster than one thread, and degraded gracefully under load (``bench/hot_path.py``, docs/benchmarks.md).

A wave of one request gets one lane with every thread (its ops are the largest there are). Lanes only run
where splitting a batch cannot change what it computes or who it talks to: on the CPU, with a single
process (no parallel groups whose collectives each rank must call in the same order), no cache backend
(caches keep per-call state) and a pipeline that declares ``concurrent_calls_safe``. Results are the same
as one call per sub-batch, which for a batch-invariant model (shapes) are the bits of the whole batch.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from typing import Any, Callable

from omni_core.worker.timing import WaveClock, on_lane_clock


class CpuLanes:
    """Runs ``fn(sub_batch)`` for contiguous sub-batches of a wave on up to ``threads`` lanes."""

    def __init__(self, threads: int, enabled: bool, gauge: Any = None) -> None:
        #: the process's torch thread budget (the ``cpu_threads`` policy)
        self.budget = max(1, threads)
        #: the count the next wave runs with: the budget, or 1 while ``gauge`` (a
        #: :class:`~omni_core.platforms.threads.ContentionGauge`, None = never lower it) says the CPU is contended
        self.threads = self.budget
        self.enabled = enabled and self.budget > 1
        self.gauge = gauge
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def lanes_for(self, n: int) -> int:
        return min(self.threads, n) if self.enabled else 1

    def map(self, fn: Callable[[list], list], items: list, clock: WaveClock) -> list:
        """``fn`` over sub-batches of ``items`` side by side; results in the order of ``items``. The caller
        times the whole call; each lane counts its own denoiser calls and runner callbacks, and the wave is
        charged the slowest lane's (as data-parallel replicas are)."""
        if self.gauge is not None:
            self.threads = self.gauge.threads(self.budget)
        lanes = self.lanes_for(len(items))
        if lanes == 1:
            # the policy's count whatever another thread set (torch's count for threads not yet initialised is
            # the last one set anywhere); a no-op when it already holds, which it does but for the first wave
            _use_threads(self.threads)
            return fn(items)
        size, extra = divmod(len(items), lanes)
        chunks, start = [], 0
        for i in range(lanes):
            end = start + size + (1 if i < extra else 0)
            chunks.append(items[start:end])
            start = end
        if self._pool is None:
            # every lane on a pool thread, the caller waiting: each thread keeps its count from wave to wave
            # (the caller's would otherwise go to one thread and back every split wave: see _use_threads)
            self._pool = concurrent.futures.ThreadPoolExecutor(self.budget, thread_name_prefix="omni-lane")
        import torch

        intra = max(1, self.threads // lanes)
        clocks = [WaveClock() for _ in chunks]  # each lane's denoise calls and callbacks, merged below
        # grad and inference mode are per thread: the lanes run under the caller's
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        futures = [self._pool.submit(contextvars.copy_context().run, self._lane, fn, chunk, lane_clock_, intra,
                                     modes) for chunk, lane_clock_ in zip(chunks, clocks)]
        done = [f.exception() or f.result() for f in futures]  # wait for every lane before going on
        clock.absorb_lanes(clocks)
        for result in done:
            if isinstance(result, BaseException):
                raise result
        return [r for part in done for r in part]

    @staticmethod
    def _lane(fn: Callable[[list], list], chunk: list, clock: WaveClock, threads: int,
              modes: tuple[bool, bool]) -> list:
        import torch

        _use_threads(threads)
        with on_lane_clock(clock), torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
            return fn(chunk)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _use_threads(n: int) -> None:
    """This thread's torch count to ``n``, only if it differs: ``torch.set_num_threads`` also empties oneDNN's
    cache of convolution primitives, so calling it every step rebuilt them every step (one probe on 2 cores,
    ``shapes``, step vs request mode at ``max_num_seqs=1``: 0.92x with a call per step, 0.99x without; later
    runs show that is not the whole gap, docs/benchmarks.md). ``get_num_threads`` reads the thread's own
    OpenMP count (initialising it first), so the check is exact."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def lanes_allowed(config: Any, pipeline: Any, device: Any) -> bool:
    """Whether a wave may be split into lanes here (see the module docstring)."""
    return (getattr(device, "type", str(device)) == "cpu" and config.world_size == 1
            and config.cache_backend == "none" and bool(getattr(pipeline, "concurrent_calls_safe", False)))
