"""The loop's step function, chosen once when the engine is built: how waves are scheduled, sent and applied.

The engine's loop (:mod:`omni_core.engine.core`) calls ``pump()`` after handling its inbox; the step function
schedules and hands waves to the executor (``run_async``: they run off the loop), and each wave's result comes
back through the inbox to ``done``. :class:`PlainSteps` applies each wave's result before scheduling the next;
:class:`PipelinedSteps` (step mode over an executor that queues waves, ``mp``) keeps ``depth`` waves in flight.
Both run on the loop's thread only and use the core's public members.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Any

from omni_core.errors import EngineDeadError
from omni_core.outputs import DiffusionOutput
from omni_core.sched.interface import DiffusionRequestStatus
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput

logger = logging.getLogger("omni_core.engine")


def failed_wave(sched: DiffusionSchedulerOutput, exc: BaseException) -> RunnerOutput:
    """The result of a wave the executor failed: every scheduled request fails with the exception."""
    return RunnerOutput(outputs={rid: DiffusionOutput(request_id=rid, status=DiffusionRequestStatus.FINISHED_ERROR,
                                                      error=f"{type(exc).__name__}: {exc}")
                                 for rid in sched.scheduled_ids})


def steps_for(core: Any) -> PlainSteps:
    """The step function of ``core`` (an ``EngineCore``) for its mode and executor (``mode.pipeline_depth``)."""
    depth = core.mode.pipeline_depth(core.executor)
    return PipelinedSteps(core, depth) if depth > 1 else PlainSteps(core)


class PlainSteps:
    """Each wave's result is applied before the next wave is scheduled."""

    def __init__(self, core: Any) -> None:
        self.core = core
        #: the wave handed to the executor and when it was scheduled, until its result is back
        self.inflight: tuple[DiffusionSchedulerOutput, float] | None = None

    def busy(self) -> bool:
        """A wave is in flight (a closing loop waits for it)."""
        return self.inflight is not None

    def pump(self) -> None:
        """Schedule and send the next wave if none is in flight."""
        c = self.core
        if self.inflight is not None or c.stopping or not c.scheduler.has_work():
            return
        t0 = time.perf_counter()
        sched = c.scheduler.schedule()
        c.mark_ending(sched.finished_ids)
        executor = c.executor
        if sched.is_empty:
            if sched.finished_ids:  # ended while running: the runner drops them first
                ids = list(sched.finished_ids)
                self.inflight = (sched, t0)
                executor.run_async(functools.partial(executor.release, ids), self._post(self._released, sched))
            return
        c.mark_started(sched)
        self.inflight = (sched, t0)
        executor.run_async(functools.partial(c.mode.execute, executor, sched), self._post(self._done, sched))

    def _post(self, handler: Any, sched: DiffusionSchedulerOutput) -> Any:
        """``done(result, error)`` for the executor's thread: posts ``handler(sched, result, error)`` to the loop."""
        return lambda result, error: self.core.post(handler, sched, result, error)

    def _released(self, sched: DiffusionSchedulerOutput, held: Any, error: BaseException | None) -> None:
        self.inflight = None
        if error is not None:
            self._failed(sched, error)
            return
        self.core.released(sched.finished_ids, held)

    def _done(self, sched: DiffusionSchedulerOutput, result: RunnerOutput | None, error: BaseException | None) -> None:
        _, t0 = self.inflight
        self.inflight = None
        if error is not None:
            result = self._failed(sched, error)
            if result is None:
                return
        self.core.apply(sched, result, t0)

    def _failed(self, sched: DiffusionSchedulerOutput, error: BaseException) -> RunnerOutput | None:
        """A dead executor kills the engine (None); any other failure fails the wave's requests."""
        if isinstance(error, EngineDeadError):
            self.core.die(str(error))
            return None
        logger.error("executor failed a wave", exc_info=error)
        return failed_wave(sched, error)

    def send_now(self) -> None:
        """Nothing is queued behind a running wave: the loop schedules next anyway."""


class PipelinedSteps(PlainSteps):
    """Step mode over an executor that queues waves (``mp``): wave N+1 is sent before wave N's result is read,
    so the worker starts the next step at once instead of waiting for the engine's round trip (result
    transport, bookkeeping, scheduling, dispatch; ~1 ms a step on a 2-core CPU, more than a small model's
    step). A wave is scheduled before the previous one's result, so a request the engine expects to finish in
    a wave in flight (its step count says so) is left out of the next. A change that should not wait for the
    queued wave (an urgent request, an abort) sends a wave that replaces it (:meth:`send_now`). A wrong guess
    costs a step's gap or a skipped id, never a wrong result: the runner ignores ids it no longer holds, and
    outputs are applied in wave order."""

    def __init__(self, core: Any, depth: int) -> None:
        super().__init__(core)
        self.depth = depth
        #: (wave, time scheduled): sent, result not yet applied
        self.waves: collections.deque[tuple[DiffusionSchedulerOutput, float]] = collections.deque()
        self.last_done = time.perf_counter()

    def busy(self) -> bool:
        return bool(self.waves)

    def pump(self) -> None:
        c = self.core
        while len(self.waves) < self.depth and not c.stopping and c.scheduler.has_work():
            if not self._schedule_and_send():
                return

    def _done(self, sched: DiffusionSchedulerOutput, result: RunnerOutput | None, error: BaseException | None) -> None:
        c, waves = self.core, self.waves
        if not waves or waves[0][0] is not sched:
            return  # the engine died (or closed) and forgot its waves
        _, t0 = waves.popleft()
        self._hold(sched, -1)
        if error is not None:
            result = self._failed(sched, error)
            if result is None:
                return
        # a skipped wave's runner also released what the wave replacing it ends (mp_worker._replaced)
        released = waves[0][0].finished_ids if result.skipped and waves else ()
        c.apply(sched, result, max(t0, self.last_done), released)  # each counts from the previous end
        self.last_done = time.perf_counter()

    def _schedule_and_send(self, replaces_queued: bool = False) -> bool:
        """Schedule the next step wave and queue it on the executor. A replacement is scheduled as if the queued
        wave it replaces will not run (its steps are not counted as in flight), so a request whose last step is
        in it keeps its slot and takes that step in the replacement. False if there was nothing to send."""
        c = self.core
        t0 = time.perf_counter()
        queued = self.waves[-1][0] if replaces_queued else None
        sched = c.scheduler.schedule(finishing=self._finishing(queued))
        c.mark_ending(sched.finished_ids)
        if sched.is_empty and not sched.finished_ids:
            return False
        sched.replaces_queued, sched.may_be_replaced = replaces_queued, True
        self._hold(sched, +1)
        executor = c.executor
        try:
            c.mark_started(sched)
            executor.send_step(sched)
        except EngineDeadError as exc:
            c.die(str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - the wave fails, the engine lives on
            logger.exception("executor failed to send a wave")
            self._hold(sched, -1)
            c.apply(sched, failed_wave(sched, exc), t0)
            return False
        self.waves.append((sched, t0))
        executor.run_async(executor.recv_step, self._post(self._done, sched))
        return True

    def send_now(self) -> None:
        """After an arrival or an abort: while a wave runs, send the next wave now if it would change something
        (start, resume or preempt a request, end an aborted one), replacing the wave already queued behind the
        running one. So an urgent request starts, and an aborted one stops, at the next step boundary rather
        than one queued step later."""
        c, waves = self.core, self.waves
        if not waves or len(waves) > self.depth or c.stopping:
            return  # the loop schedules next anyway; at most one replacement queued
        if c.applying:
            return  # a progress listener inside apply: the loop schedules right after it anyway
        replaces = len(waves) >= self.depth
        try:
            if c.scheduler.would_start(self._finishing(waves[-1][0] if replaces else None)):
                self._schedule_and_send(replaces_queued=replaces)
        except Exception:  # noqa: BLE001 - the caller's submit or abort stands; the loop schedules as usual
            logger.exception("scheduling a wave early failed")

    def _hold(self, sched: DiffusionSchedulerOutput, delta: int) -> None:
        for rid in sched.scheduled_ids:
            record = self.core.record(rid)
            if record is not None:
                record.in_flight += delta
                if record.num_steps is None:
                    record.num_steps = record.request.sampling_params.num_inference_steps

    def _finishing(self, not_counting: DiffusionSchedulerOutput | None = None) -> set[str]:
        """Running requests whose last step is in a wave already sent, leaving out the steps of ``not_counting``
        (a queued wave about to be replaced). Looks only at the requests of the waves in flight (the core's
        records, no index of its own), so it costs the same with any number waiting."""
        skipped: Any = set(not_counting.scheduled_ids) if not_counting is not None else ()
        in_flight = {rid for sched, _ in self.waves for rid in sched.scheduled_ids}
        records = ((rid, self.core.record(rid)) for rid in in_flight)
        return {rid for rid, r in records
                if r is not None and r.num_steps is not None and r.steps + r.in_flight - (rid in skipped) >= r.num_steps}


__all__ = ["PipelinedSteps", "PlainSteps", "failed_wave", "steps_for"]
