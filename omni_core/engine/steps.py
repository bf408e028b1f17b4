"""The busy loop's step function, chosen once when the engine is built: how the next wave is taken, run and applied.

The engine's loop (``DiffusionEngine._run``) waits for work, asks for the next wave under the lock, runs it
without the lock and hands the result back; the waiting, the engine-death handling and a failed wave are written
there once. :class:`PlainSteps` applies each wave's result before scheduling the next; :class:`PipelinedSteps`
(step mode over an executor that queues waves, ``mp``) keeps ``depth`` waves in flight.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from omni_core.engine.records import RequestRecord
from omni_core.errors import EngineDeadError
from omni_core.outputs import DiffusionOutput
from omni_core.sched.interface import DiffusionRequestStatus
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput


logger = logging.getLogger("omni_core.engine")


def failed_wave(sched: DiffusionSchedulerOutput, exc: Exception) -> RunnerOutput:
    """The result of a wave the executor failed: every scheduled request fails with the exception."""
    return RunnerOutput(outputs={rid: DiffusionOutput(request_id=rid, status=DiffusionRequestStatus.FINISHED_ERROR,
                                                      error=f"{type(exc).__name__}: {exc}")
                                 for rid in sched.scheduled_ids})


def steps_for(engine: Any) -> PlainSteps:
    """The step function of ``engine`` (a ``DiffusionEngine``, whose lock and tables it shares) for its mode and
    executor (``mode.pipeline_depth``)."""
    depth = engine.mode.pipeline_depth(engine.executor)
    return PipelinedSteps(engine, depth) if depth > 1 else PlainSteps(engine)


class PlainSteps:
    """Each wave's result is applied before the next wave is scheduled."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def has_work(self) -> bool:
        return self.engine.scheduler.has_work()

    def next_wave(self) -> tuple[DiffusionSchedulerOutput, float] | None:
        """The wave to run and when it was scheduled, or None to wait again (lock held)."""
        t0 = time.perf_counter()
        sched = self.engine.scheduler.schedule()
        self.engine._mark_ending(sched.finished_ids)
        return sched, t0

    def run(self, sched: DiffusionSchedulerOutput) -> RunnerOutput | None:
        """Run the wave (lock not held); None for a wave that only releases ended requests."""
        e = self.engine
        if sched.is_empty:
            if sched.finished_ids:  # ended while running: the runner drops them first
                held = e.executor.release(sched.finished_ids)
                with e._lock:
                    e._runner_held = held
                    e._finalize_aborted(sched.finished_ids)
            return None
        e._mark_started(sched)
        return e.mode.execute(e.executor, sched)

    def done(self, sched: DiffusionSchedulerOutput, t0: float, result: RunnerOutput | None) -> None:
        if result is not None:
            self.engine._apply(sched, result, t0)

    def send_now(self) -> None:
        """Nothing is queued behind a running wave: the loop schedules next anyway."""

    def forget(self, request_id: str) -> None:
        """The request ended (lock held)."""


class PipelinedSteps(PlainSteps):
    """Step mode over an executor that queues waves (``mp``): wave N+1 is sent before wave N's result is read,
    so the worker starts the next step at once instead of waiting for the engine's round trip (result
    transport, bookkeeping, scheduling, dispatch; ~1 ms a step on a 2-core CPU, more than a small model's
    step). A wave is scheduled before the previous one's result, so a request the engine expects to finish in
    a wave in flight (its step count says so) is left out of the next. A change that should not wait for the
    queued wave (an urgent request, an abort) sends a wave that replaces it (:meth:`send_now`). A wrong guess
    costs a step's gap or a skipped id, never a wrong result: the runner ignores ids it no longer holds, and
    outputs are applied in wave order."""

    def __init__(self, engine: Any, depth: int) -> None:
        super().__init__(engine)
        self.depth = depth
        #: (wave, time scheduled): sent, result not yet applied
        self.inflight: collections.deque[tuple[DiffusionSchedulerOutput, float]] = collections.deque()
        #: the records with step waves in flight (``RequestRecord.in_flight > 0``)
        self.records: dict[str, RequestRecord] = {}
        self.last_done = time.perf_counter()

    def has_work(self) -> bool:
        return bool(self.inflight) or self.engine.scheduler.has_work()

    def next_wave(self) -> tuple[DiffusionSchedulerOutput, float] | None:
        e, inflight = self.engine, self.inflight
        if len(inflight) < self.depth and e.scheduler.has_work() and self._schedule_and_send():
            if len(inflight) < self.depth:
                return None  # fill the pipeline before waiting
        if e._closed or e._dead or not inflight:
            return None
        return inflight[0]

    def run(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return self.engine.executor.recv_step()

    def done(self, sched: DiffusionSchedulerOutput, t0: float, result: RunnerOutput | None) -> None:
        e, inflight = self.engine, self.inflight
        with e._lock:
            inflight.popleft()
            self._hold(sched, -1)
            # a skipped wave's runner also released what the wave replacing it ends (mp_worker._replaced)
            released = inflight[0][0].finished_ids if result.skipped and inflight else ()
            e._apply(sched, result, max(t0, self.last_done), released)  # each counts from the previous end
        self.last_done = time.perf_counter()

    def forget(self, request_id: str) -> None:
        self.records.pop(request_id, None)

    def _schedule_and_send(self, replaces_queued: bool = False) -> bool:
        """Schedule the next step wave and queue it on the executor (lock held, so waves are sent in the order
        they were scheduled, whichever thread sends). A replacement is scheduled as if the queued wave it
        replaces will not run (its steps are not counted as in flight), so a request whose last step is in it
        keeps its slot and takes that step in the replacement. False if there was nothing to send."""
        e = self.engine
        t0 = time.perf_counter()
        queued = self.inflight[-1][0] if replaces_queued else None
        sched = e.scheduler.schedule(finishing=self._finishing(queued))
        e._mark_ending(sched.finished_ids)
        if sched.is_empty and not sched.finished_ids:
            return False
        sched.replaces_queued, sched.may_be_replaced = replaces_queued, True
        self._hold(sched, +1)
        try:
            e._mark_started(sched)
            e.executor.send_step(sched)
        except EngineDeadError as exc:
            e._die(str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - the wave fails, the engine lives on
            logger.exception("executor failed to send a wave")
            self._hold(sched, -1)
            e._apply(sched, failed_wave(sched, exc), t0)
            return False
        self.inflight.append((sched, t0))
        return True

    def send_now(self) -> None:
        """After an arrival or an abort (lock held): while the loop waits on a wave's result, send the next wave
        now if it would change something (start, resume or preempt a request, end an aborted one), replacing
        the wave already queued behind the running one. So an urgent request starts, and an aborted one stops,
        at the next step boundary rather than one queued step later."""
        e, inflight = self.engine, self.inflight
        if not inflight or len(inflight) > self.depth or e._closed or e._dead:
            return  # the loop schedules next anyway; at most one replacement queued
        if e._applying:
            return  # an on_progress listener inside _apply: the loop schedules right after it anyway
        replaces = len(inflight) >= self.depth
        try:
            if e.scheduler.would_start(self._finishing(inflight[-1][0] if replaces else None)):
                self._schedule_and_send(replaces_queued=replaces)
        except Exception:  # noqa: BLE001 - the caller's submit or abort stands; the loop schedules as usual
            logger.exception("scheduling a wave early failed")

    def _hold(self, sched: DiffusionSchedulerOutput, delta: int) -> None:
        e = self.engine
        with e._lock:
            for rid in sched.scheduled_ids:
                record = e._records.get(rid)
                if record is not None:
                    record.in_flight += delta
                    if record.num_steps is None:
                        record.num_steps = record.request.sampling_params.num_inference_steps
                    if record.in_flight > 0:
                        self.records[rid] = record
                    else:
                        self.records.pop(rid, None)

    def _finishing(self, not_counting: DiffusionSchedulerOutput | None = None) -> set[str]:
        """Running requests whose last step is in a wave already sent, leaving out the steps of ``not_counting``
        (a queued wave about to be replaced; lock held). Looks only at the requests in flight, so it costs the
        same with any number waiting."""
        skipped: Any = set(not_counting.scheduled_ids) if not_counting is not None else ()
        return {rid for rid, r in self.records.items()
                if r.num_steps is not None and r.steps + r.in_flight - (rid in skipped) >= r.num_steps}


__all__ = ["PipelinedSteps", "PlainSteps", "failed_wave", "steps_for"]
