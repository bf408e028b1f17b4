"""EngineCore: the one owner of the engine's state, on one thread fed by an inbox.

Everything the engine holds -- the scheduler, the one per-request table, deadlines, the step function's waves in
flight, the stage links, counters and timing -- is read and written only by the core's loop thread (the model of
vLLM v1's ``EngineCore``). Every other thread talks to it by posting to the inbox: front ends post calls
(``call``: admit, stats; ``post``: abort), the executor posts each wave's result and each progress tick from its
call thread (:mod:`omni_core.executor.calls`), the stage processes' readers post their results and deaths. The
loop drains the inbox at the top of each iteration, expires deadlines, then schedules and sends the next waves
(:mod:`omni_core.engine.steps`); it waits on the inbox with the next deadline as its timeout. The loop never runs
the model, so a caller's admission or abort is answered at once even while a long wave runs; a running request's
abort reaches the runner at once through ``executor.abort`` (thread-safe) and takes effect at its next step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from omni_core.engine.collective_calls import CollectiveCalls
from omni_core.engine.deadlines import Deadlines
from omni_core.engine.handle import RequestHandle
from omni_core.engine.inbox import Inbox
from omni_core.engine.model_info import ProgressFn
from omni_core.engine.records import (RequestRecord, close_output, count_wave, embedding_cache_summary, new_timing,
                                      timing_summary)
from omni_core.engine.stage_links import StageLinks
from omni_core.engine.steps import steps_for
from omni_core.engine.stream import OutputStream
from omni_core.errors import ConfigError, EngineDeadError, OmniError, QueueFullError
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched.interface import DiffusionRequestStatus as Status
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.pipelines.stages import DECODE, ENCODE
from omni_core.worker.stage_contract import pending_decode
from omni_core.worker.transport import Sealed

logger = logging.getLogger("omni_core.engine")

IDLE_CHECK_S = 0.5  # the loop's longest wait for an event: it then checks that the executor lives
CLOSE_WAIT_S = 30.0  # how long a closing loop waits for its (aborted) waves in flight before it stops anyway


class EngineCore:
    """The loop and everything it owns (see the module docstring). Its methods other than :meth:`post`,
    :meth:`call`, :meth:`start` and :meth:`join` run on the loop's thread only."""

    def __init__(self, plan: Any, scheduler: Any = None, executor: Any = None) -> None:
        self.plan, self.config, self.mode = plan, plan.config, plan.mode
        self.scheduler = scheduler or plan.scheduler_cls(plan.capacity)
        if scheduler is None:  # the policy knobs (docs/scheduling.md)
            self.scheduler.configure(plan.config)
        self._inbox = Inbox()
        #: every admitted request that has not ended, by id: the engine's only per-request table
        self._records: dict[str, RequestRecord] = {}
        self._deadlines = Deadlines(self._watched)
        #: ids the runner still held state for after the last wave (it may outlive a record; stats shows it)
        self._runner_held: set[str] = set()
        self._closing: float | None = None  # when close began (time.monotonic())
        self._stopped = False
        #: why the engine died, or None; written once by the loop, read by any thread
        self.dead: str | None = None
        #: ``requests_timed_out`` are also counted in ``requests_failed``; ``step_waves_replaced``: queued step waves
        #: whose step the worker skipped for a wave that replaced them (``PipelinedSteps``)
        self.counters = {"requests_added": 0, "requests_completed": 0, "requests_aborted": 0, "requests_failed": 0,
                         "denoise_steps": 0, "requests_timed_out": 0, "step_waves_replaced": 0,
                         "requests_out_of_memory": 0}
        #: why the engine serves but not as it should (the last request to end ran out of memory), or None
        self._degraded: str | None = None
        #: where the loop's time went, summed over waves (``wave_timing``)
        self._timing = new_timing()
        #: inside ``apply`` (a progress listener that submits there must not schedule in the middle of it)
        self.applying = False
        #: collective calls asked for and not yet answered: waves pause until each has run
        self._calls = CollectiveCalls()
        #: set once the loop has handled the last progress tick (written by the thread that sends ticks)
        self._tick_handled = threading.Event()
        self._tick_handled.set()
        self.executor = executor or plan.executor_cls(plan.config, plan.resolved, on_progress=self._progress_tick)
        #: the stage processes' links (``encode_workers`` / ``decode_workers``), launched to load while the model does
        self.stages = StageLinks(self)
        self.stages.start_with(self.executor)
        self.steps = steps_for(self)
        self._thread = threading.Thread(target=self._run, name="omni-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, in posting order; nothing waits for it (dropped once the loop stopped)."""
        self._inbox.post(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop and return its result (or raise its exception). On the loop's thread, or
        once the loop has stopped (nothing else owns the state then), it runs here."""
        if threading.current_thread() is self._thread or self._stopped_for_good():
            return fn(*args)
        return self._inbox.call(fn, args, self._stopped_for_good)

    def _stopped_for_good(self) -> bool:
        return self._stopped and not self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        """Wait for the loop to stop (after ``begin_close`` or a death); False if it still runs."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _progress_tick(self, request_id: str, step: int, total: int, preview: Any = None) -> None:
        """The runner's per-step callback (request mode; the executor's call thread or its watcher).

        It runs at most one tick ahead of the loop: it waits until the loop has handled the previous tick. A
        small model's step is shorter than the GIL's switch interval (5 ms), so on a busy machine an unbounded
        runner ran several steps before the loop saw the first tick; bounded, a listener that aborts on step k
        stops the request by step k + 1. On a real model the loop is always done long before the next step."""
        previous = self._tick_handled
        while not previous.wait(0.1):
            if self._stopped or self.dead is not None:  # a stopped loop drops posts: never wait on one
                break
        handled = threading.Event()
        self._tick_handled = handled
        self.post(self.progress, request_id, step, total, handled, preview)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while True:
                self._inbox.drain(self._wait_s())
                if self.dead is None and not self.executor.is_alive():
                    self.die(self.executor.death_reason or "the engine is dead: a worker died")
                self._expire()
                if self.dead is not None:
                    break
                if self._closing is not None:
                    if not self.steps.busy() or time.monotonic() - self._closing > CLOSE_WAIT_S:
                        break
                    continue
                if self._calls.active:
                    if not self.steps.busy():
                        self._calls.start_next(self.executor, self.post)
                else:
                    self.steps.pump()
        except BaseException:  # noqa: BLE001 - a bug here must not leave callers waiting forever
            logger.exception("the engine's loop failed")
            self.die("the engine is dead: its loop failed (see the log)")
        finally:
            self._stop()

    def _wait_s(self) -> float:
        due = self._deadlines.next_due()
        wait = IDLE_CHECK_S if due is None else min(IDLE_CHECK_S, max(0.0, due - time.monotonic()))
        return min(wait, 0.05) if self._closing is not None else wait

    def _stop(self) -> None:
        """The loop ends: every request still recorded gets its final output, every pending call an answer."""
        if self.dead is None:
            for rid in list(self._records):
                self.finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ABORTED,
                                                   error="the engine was closed"))
            self.stages.clear()  # finalized just above (aborted); a late stage result finds none
            self.scheduler.fail_all("the engine was closed")
            self.scheduler.schedule()  # flush finished ids
            self._runner_held = set()
        self._calls.fail_all(EngineDeadError(self.dead) if self.dead else OmniError("the engine was closed"))
        self._stopped = True
        self._inbox.drain(0)  # calls posted before ``_stopped`` was seen: admit refuses, stats answers

    # ------------------------------------------------------------------ admission
    def admit(self, requests: list[OmniDiffusionRequest], on_progress: ProgressFn | None = None
              ) -> list[RequestHandle]:
        """Queue checked requests at once: all or none, seen together by the next scheduling round."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if self._closing is not None or self._stopped:
            raise OmniError("the engine is closed")
        ids = [r.request_id for r in requests]
        for rid in ids:
            if rid in self._records or ids.count(rid) > 1:
                raise ConfigError(f"request_id {rid!r} is already in use", field="request_id")
        limit = self.config.max_waiting_requests
        waiting = self.scheduler.num_waiting + self.stages.waiting[ENCODE]
        if limit is not None and waiting + len(requests) > limit:
            raise QueueFullError(f"the engine has {waiting} waiting requests "
                                 f"(max_waiting_requests={limit}); retry later")
        handles = []
        now = time.monotonic()
        try:
            for request in requests:
                record = RequestRecord(request=request, stream=OutputStream(), arrival=now, on_progress=on_progress,
                                       previews=bool(self.config.streaming_output and request.stream_previews))
                timeout = getattr(request.sampling_params, "timeout", None)
                if timeout is not None:
                    record.deadline = now + timeout
                    self._deadlines.add(request.request_id, record.deadline)
                self._records[request.request_id] = record
                handles.append(RequestHandle(request, record.stream, self._abort_from_handle))
                if not self.stages.admit(record):  # queued now, or once the encode stage encoded it
                    self.scheduler.add_request(request)
        except BaseException:  # all or none: nothing half-queued that no caller holds a handle for
            for handle in handles:  # still waiting: the scheduler ends them now (the runner never saw them)
                if self.stages.drop(self._records[handle.request_id]) is None:
                    self.scheduler.abort_request(handle.request_id)
                del self._records[handle.request_id]
            raise
        self.counters["requests_added"] += len(handles)
        self.stages.flush()
        self.steps.send_now()
        return handles

    def _abort_from_handle(self, request_id: str) -> None:
        self.post(self.abort, [request_id])

    # ------------------------------------------------------------------ abort and deadlines
    def abort(self, request_ids: list[str]) -> None:
        """A waiting request ends now, a running one at its next step boundary."""
        running = [rid for rid in request_ids if self._end(rid)]
        if running:
            self.steps.send_now()
            self.mode.stop_running(self.executor, running)

    def _end(self, request_id: str) -> bool:
        """Have the scheduler end a request: a waiting one ends now; True for a running one, which ends at the
        next step boundary once the runner has let it go (request mode: ``mode.stop_running``). One waiting for
        its encode or decode ends now; the stage drops it."""
        record = self._records.get(request_id)
        aborted = self.stages.drop(record) if record is not None else None
        if aborted is not None:
            self.finalize(request_id, aborted)
            return False
        status = self.scheduler.abort_request(request_id)
        if status == Status.FINISHED_ABORTED:
            self.finalize(request_id, DiffusionOutput(request_id=request_id, status=Status.FINISHED_ABORTED))
            return False
        return status is not None

    def _watched(self, request_id: str, deadline: float) -> bool:
        record = self._records.get(request_id)
        return record is not None and record.deadline == deadline and not record.timed_out

    def _expire(self) -> None:
        """End the requests past their deadline: a waiting one now, a running one at its next step."""
        running = []
        for rid in self._deadlines.pop_due(time.monotonic()):
            record = self._records.get(rid)
            if record is None or record.timed_out:
                continue
            record.timed_out = True
            if self._end(rid):
                running.append(rid)
        if running:  # step mode: the next wave leaves them out (mp: one replacing the queued wave now)
            self.steps.send_now()
            self.mode.stop_running(self.executor, running)  # request mode: the runner stops them

    def begin_close(self) -> list[str]:
        """Abort everything; the loop stops once the waves in flight are back. Returns the ids it aborted."""
        if self._closing is not None:
            return []
        self._closing = time.monotonic()
        ids = list(self._records)
        for rid in ids:
            self.scheduler.abort_request(rid)
        if ids and self.executor.is_alive():
            self.executor.abort(ids)
        return ids

    # ------------------------------------------------------------------ collective calls
    def begin_collective(self, method: str, args: tuple, kwargs: dict, timeout: float | None
                         ) -> concurrent.futures.Future:
        """Queue a collective call: new waves pause, it runs once none is in flight, then waves resume (a dead
        executor's failure kills the engine, as a wave's does). Returns the future of its result."""
        if self.dead:
            raise EngineDeadError(self.dead)
        if self._closing is not None or self._stopped:
            raise OmniError("the engine is closed")
        reply = self._calls.add(method, args, kwargs, timeout)
        reply.add_done_callback(self._after_call)
        return reply

    def _after_call(self, reply: concurrent.futures.Future) -> None:
        error = reply.exception()
        if isinstance(error, EngineDeadError) and self.dead is None and not self._stopped:
            self.post(self.die, str(error))

    # ------------------------------------------------------------------ waves (the step function's calls)
    def request_ids(self) -> list[str]:
        """Every request the engine holds (waiting, running, decoding): a weight operation waits for none."""
        return list(self._records)

    def record(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    @property
    def stopping(self) -> bool:
        """Closing, dead, or a collective call pending or running: no new wave is sent."""
        return self._closing is not None or self.dead is not None or self._calls.active

    def mark_ending(self, request_ids: list[str]) -> None:
        """The scheduler ended these: those still recorded were running and end once the runner has let them
        go (``finalize_aborted``); a later request reusing an id is not one of them."""
        for rid in request_ids:
            record = self._records.get(rid)
            if record is not None and record.stage != DECODE:  # a decoding one ended its denoise
                record.ending = True

    def mark_started(self, sched: DiffusionSchedulerOutput) -> None:
        now = time.monotonic()
        for req in sched.new_requests:
            record = self._records.get(req.request_id)
            if record is not None and record.started is None:
                record.started = now

    def released(self, request_ids: list[str], held: set[str]) -> None:
        """A wave that only let ended requests go came back: the runner still holds ``held``."""
        self._runner_held = set(held)
        self.finalize_aborted(request_ids)

    def finalize_aborted(self, request_ids: Any) -> None:
        for rid in request_ids:  # aborted while running: ends once the runner has dropped it
            record = self._records.get(rid)
            if record is not None and record.ending:
                self.finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ABORTED))

    def apply(self, sched: DiffusionSchedulerOutput, result: RunnerOutput, t0: float,
              released: list[str] | tuple = ()) -> None:
        """Apply a wave's result. Requests that ended while running (``sched.finished_ids``, and ``released``:
        those a skipped wave's runner let go of early) end here, once the runner no longer holds them."""
        self.applying = True
        try:
            self._apply(sched, result, t0, released)
        finally:
            self.applying = False

    def _apply(self, sched: DiffusionSchedulerOutput, result: RunnerOutput, t0: float,
               released: list[str] | tuple) -> None:
        ended = self.scheduler.update_from_output(sched, result)
        self._runner_held = set(result.held_ids)
        self.finalize_aborted([*sched.finished_ids, *(r for r in released if r not in self._runner_held)])
        if result.skipped:
            self.counters["step_waves_replaced"] += 1
        else:
            self.counters["denoise_steps"] += self.mode.wave_steps(sched)
        for rid, out in result.outputs.items():
            record = self._records.get(rid)
            if record is None:
                continue  # already ended here (aborted while the wave ran)
            if rid in ended:
                if ended[rid] == Status.FINISHED_ERROR and out.status != Status.FINISHED_ERROR:
                    out.status, out.error = Status.FINISHED_ERROR, out.error or "request failed"
                elif ended[rid] == Status.FINISHED_COMPLETED and self.mode.final_output_is_a_step:
                    record.step(record.last_step_preview(out))  # the finishing step counts like the others
                if ended[rid] == Status.FINISHED_COMPLETED and pending_decode(out):
                    self.stages.hold(record, out)
                else:
                    self.finalize(rid, out)
            elif not out.finished:
                record.step(out)
        self.stages.flush()
        for rid in ended:  # ended without an output (lost by the runner)
            if rid in self._records and self._records[rid].stage is None:
                self.finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ERROR,
                                                   error="the runner returned no output for this request"))
        # a wave that only releases ended requests (the pipelined loop sends those as waves) is no step wave
        if sched.scheduled_ids and not result.skipped:
            wall_s = time.perf_counter() - t0
            count_wave(self._timing, wall_s, result.metrics)
            # the scheduler learns each shape's step cost (docs/scheduling.md)
            self.scheduler.observe_wave(sched, result.metrics.get("denoise_s") or wall_s)

    def progress(self, request_id: str, step: int, total: int, handled: threading.Event, preview: Any = None) -> None:
        """A request-mode step ran (posted by ``_progress_tick``), with its preview when the pipeline streams them
        from its own loop (``previews_in_request_mode``)."""
        try:
            record = self._records.get(request_id)
            if record is not None:
                record.progress(step, total)
                if preview is not None and record.previews:
                    record.stream.put(DiffusionOutput(request_id=request_id, finished=False, preview=preview,
                                                      step_index=step, num_steps=total))
            self.counters["denoise_steps"] += self.mode.steps_per_progress
        finally:
            handled.set()

    def finalize(self, request_id: str, out: DiffusionOutput) -> None:
        """Deliver the final output and forget the request."""
        record = self._records.pop(request_id)
        unused = record.request.text_encodings
        if isinstance(unused, Sealed) and record.started is None:
            unused.discard()  # never sent to the model: shared memory is opened once and dropped; a ref, dropped below
        record.request.text_encodings = None  # the encode stage's tensors: a caller's handle keeps the request
        status = close_output(record, out)
        if record.timed_out and status != Status.FINISHED_COMPLETED:
            self.counters["requests_timed_out"] += 1
        self.counters[status.counter] += 1
        if out.metrics.get("out_of_memory"):
            self.counters["requests_out_of_memory"] += 1
            self._degraded = f"a request ran out of memory: {out.error}"
        elif status == Status.FINISHED_COMPLETED:
            self._degraded = None
        if status == Status.FINISHED_COMPLETED:  # post-processing runs in the reader's thread, not the loop
            request, cls = record.request, self.plan.pipeline_cls
            record.stream.put(out, finish=lambda o: cls.post_process(o, request))
        else:
            record.stream.put(out)

    def die(self, reason: str) -> None:
        """Mark the engine dead and fail every request it holds; the loop stops."""
        if self.dead:
            return
        self.dead = reason
        self.stages.clear()  # finalized below with the reason, as every record
        self.scheduler.fail_all(reason)
        self.scheduler.schedule()  # nothing will run again: drop the release list too
        for rid in list(self._records):
            self.finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ERROR, error=reason))
        self._runner_held = set()

    # ------------------------------------------------------------------ state
    def wave_timing(self) -> dict[str, float]:
        """Where the loop's time went, summed since start (:func:`omni_core.engine.records.timing_summary`)."""
        return timing_summary(self._timing)

    def note_embedding_cache(self, snap: dict) -> None:
        """A stage's embedding-cache counters (``stats()["embedding_cache"]`` sums them with the model's)."""
        self._timing.setdefault("embedding_caches", {})[snap["source"]] = snap

    def stats(self) -> dict[str, Any]:
        tracked = set(self._records) | self.scheduler.tracked_ids() | self._runner_held
        return {"waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                "tracked_requests": sorted(tracked), "execution_mode": self.mode.mode.value,
                "dead": self.dead, "degraded": self._degraded, **self.counters, "timing": self.wave_timing(),
                "requests_preempted": self.scheduler.num_preemptions, "model_bytes": self.executor.model_bytes(),
                "embedding_cache": embedding_cache_summary(self._timing), **self.stages.stats()}


__all__ = ["EngineCore"]
