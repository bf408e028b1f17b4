"""DiffusionEngine: admission, the busy loop, per-request records, abort.

The engine runs a finished :class:`~omni_core.engine.plan.EnginePlan` (``plan_engine``: every check of the config
happened there). One busy-loop thread drives ``scheduler.schedule() -> mode.execute ->
scheduler.update_from_output`` through the step function chosen once (:mod:`omni_core.engine.steps`) and pushes
outputs into per-request streams. Callers ``submit`` requests and read them through the returned handles from any
thread or asyncio loop. Abort, consumer cancellation and deadlines (:mod:`omni_core.engine.deadlines`) travel the
other way: the scheduler finalises the request, the runner stops it within one denoising step (both modes), and
the engine forgets its record. Everything the engine holds for a request is one ``RequestRecord`` in one table.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.engine import warmup
from omni_core.engine.deadlines import DeadlineWatcher
from omni_core.engine.delivery import OutputDelivery
from omni_core.engine.handle import RequestHandle
from omni_core.engine.model_info import ModelInfo, ProgressFn
from omni_core.engine.modes import DiffusionExecutionMode
from omni_core.engine.plan import EnginePlan, plan_engine
from omni_core.engine.records import (RequestRecord, close_output, count_wave, embedding_cache_summary, new_timing,
                                      timing_summary)
from omni_core.engine.steps import failed_wave, steps_for
from omni_core.engine.stream import OutputStream
from omni_core.errors import ConfigError, EngineDeadError, OmniError, QueueFullError
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched.interface import DiffusionRequestStatus as Status
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.engine.admission import RequestChecker
from omni_core.engine.stage_links import StageLinks
from omni_core.worker.stage_contract import pending_decode

logger = logging.getLogger("omni_core.engine")

__all__ = ["DiffusionEngine", "DiffusionExecutionMode", "QueueFullError", "RequestRecord", "make_engine"]


class DiffusionEngine:
    """The in-process engine; front ends use it as an :class:`~omni_core.engine.client.EngineClient`.

    ``DiffusionEngine(config)`` plans (:func:`~omni_core.engine.plan.plan_engine`), then runs; a caller that
    planned already passes the plan."""

    def __init__(self, plan: EnginePlan | OmniDiffusionConfig, *, scheduler: Any = None, executor: Any = None) -> None:
        plan = plan if isinstance(plan, EnginePlan) else plan_engine(plan)
        self.plan = plan
        self.config, self.resolved, self.pipeline_cls = plan.config, plan.resolved, plan.pipeline_cls
        self.limits = plan.limits  # every request is checked against these (config.limits over the model's)
        self.performance = plan.performance
        #: the execution-mode strategy, chosen once (every mode difference lives in it)
        self.mode = plan.mode
        self.scheduler = scheduler or plan.scheduler_cls(plan.capacity)
        if scheduler is None:  # the policy knobs (docs/scheduling.md)
            self.scheduler.configure(plan.config)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        #: every admitted request that has not ended, by id: the engine's only per-request table
        self._records: dict[str, RequestRecord] = {}
        #: validates each request once (``prepare_request``; ``submit`` re-checks only what was replaced since)
        self._checker = RequestChecker(plan)
        #: ids the runner still held state for after the last wave (it may outlive a record; stats shows it)
        self._runner_held: set[str] = set()
        self._closed = False
        self._dead: str | None = None
        #: ``requests_timed_out`` are also counted in ``requests_failed``; ``step_waves_replaced``: queued step waves
        #: whose step the worker skipped for a wave that replaced them (``PipelinedSteps``)
        self.counters = {"requests_added": 0, "requests_completed": 0, "requests_aborted": 0, "requests_failed": 0,
                         "denoise_steps": 0, "requests_timed_out": 0, "step_waves_replaced": 0,
                         "requests_out_of_memory": 0}
        #: why the engine serves but not as it should (the last request to end ran out of memory), or None; a
        #: completed request clears it (``stats()["degraded"]``, ``/health``)
        self._degraded: str | None = None
        #: where the busy loop's time went, summed over waves (see ``wave_timing``)
        self.timing = new_timing()
        #: inside ``_apply`` (a listener that aborts there must not schedule in the middle of it)
        self._applying = False
        self.executor = executor or plan.executor_cls(plan.config, plan.resolved, on_progress=self._on_progress)
        #: the stage processes' links (``encode_workers`` / ``decode_workers``), launched to load while the model does
        self._stages = StageLinks(self)
        self._deadlines = DeadlineWatcher(self)
        self._stages.start_with(self.executor)
        #: the busy loop's step function, chosen once (plain, or pipelined over an executor that queues waves, which
        #: it says once started)
        self._steps = steps_for(self)
        self._delivery = OutputDelivery()
        self._thread = threading.Thread(target=self._run, name="omni-engine", daemon=True)
        self._thread.start()
        self._deadlines.thread.start()

    @classmethod
    def make_engine(cls, config: EnginePlan | OmniDiffusionConfig, **kwargs: Any) -> DiffusionEngine:
        """Build the engine and run its start-up warmup (so the first user request is not the slow one)."""
        engine = cls(config, **kwargs)
        if engine.config.warmup:
            try:
                engine.run_startup_warmup()
            except BaseException:
                engine.close()
                raise
        return engine

    def warmup_params(self) -> SamplingParams:
        """The start-up warm-up's params (:func:`omni_core.engine.warmup.warmup_params`)."""
        return warmup.warmup_params(self.pipeline_cls, self.resolved.model_path)

    def run_startup_warmup(self) -> None:
        """Run one tiny request end to end; a failure says which model, which shape, where, and how to skip."""
        warmup.run_startup_warmup(self)

    # ------------------------------------------------------------------ admission
    def prepare_request(self, request: OmniDiffusionRequest) -> OmniDiffusionRequest:
        """Validate and complete a request (model defaults, a seed) before it touches any engine state."""
        return self._checker.prepare(request)

    def submit(self, requests: list[OmniDiffusionRequest], *, on_progress: ProgressFn | None = None
               ) -> list[RequestHandle]:
        """Validate every request, then queue them all at once (so compatible ones can share a wave) or none.

        Returns one handle per request, in order, before any output exists, so none can be missed.
        ``on_progress(request_id, step, num_steps)`` runs on the engine's thread after every denoising step
        of each of them (the last included, in both modes).
        """
        if isinstance(requests, OmniDiffusionRequest):
            raise TypeError("submit takes a list of requests: engine.submit([request])")
        return self._admit([self._checker.checked(r) for r in requests], on_progress)

    def _admit(self, requests: list[OmniDiffusionRequest], on_progress: ProgressFn | None = None
               ) -> list[RequestHandle]:
        """Queue requests under one lock: all or none, seen together by the next scheduling round."""
        with self._lock:
            if self._dead:
                raise EngineDeadError(self._dead)
            if self._closed:
                raise OmniError("the engine is closed")
            ids = [r.request_id for r in requests]
            for rid in ids:
                if rid in self._records or ids.count(rid) > 1:
                    raise ConfigError(f"request_id {rid!r} is already in use", field="request_id")
            limit = self.config.max_waiting_requests
            waiting = self.scheduler.num_waiting + len(self._stages.encoding)
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
                        self._deadlines.add(request.request_id, now + timeout)
                    if not self._stages.admit(request):  # queued now, or once the encode stage encoded it
                        self.scheduler.add_request(request)
                    self._records[request.request_id] = record
                    handles.append(RequestHandle(request, record.stream, self.abort))
            except BaseException:  # all or none: nothing half-queued that no caller holds a handle for
                for handle in handles:  # still waiting: the scheduler ends them now (the runner never saw them)
                    if self._stages.drop(handle.request_id) is None:
                        self.scheduler.abort_request(handle.request_id)
                    del self._records[handle.request_id]
                    self._deadlines.discard(handle.request_id)
                self._wake.notify()  # the loop's next round flushes them from the scheduler's finished list
                raise
            self.counters["requests_added"] += len(handles)
            self._stages.flush()
            self._wake.notify()
            self._steps.send_now()
        return handles

    # ------------------------------------------------------------------ abort
    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: a waiting one ends now, a running one within one denoising step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            running = [rid for rid in ids if self._end(rid)]
            self._wake.notify()
            if running:
                self._steps.send_now()
        if running:
            self.mode.stop_running(self.executor, running)

    def _end(self, request_id: str) -> bool:
        """Have the scheduler end a request (lock held): a waiting one ends now; True for a running one, which
        ends at the next step boundary once the runner has let it go (request mode: ``mode.stop_running``). One
        waiting for its encode or decode ends now; the stage drops it."""
        aborted = self._stages.drop(request_id)
        if aborted is not None:
            self._finalize(request_id, aborted)
            return False
        status = self.scheduler.abort_request(request_id)
        if status == Status.FINISHED_ABORTED:
            self._finalize(request_id, DiffusionOutput(request_id=request_id, status=Status.FINISHED_ABORTED))
            return False
        return status is not None

    # ------------------------------------------------------------------ busy loop
    def _run(self) -> None:
        """The busy loop: wait for work, take the next wave (lock held), run it (lock released), apply its
        result; how is the step function's (``self._steps``). A dead executor kills the engine; a failed wave
        fails its requests and the engine lives on."""
        steps = self._steps
        while True:
            with self._lock:
                while not self._closed and not self._dead and not steps.has_work():
                    self._wake.wait(timeout=0.5)
                    if not self.executor.is_alive():
                        self._die(self.executor.death_reason or "the engine is dead: a worker died")
                if self._closed or self._dead:
                    return
                wave = steps.next_wave()
            if wave is None:
                continue
            sched, t0 = wave
            try:
                result = steps.run(sched)
            except EngineDeadError as exc:
                with self._lock:
                    self._die(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the wave fails, the engine lives on
                logger.exception("executor failed a wave")
                result = failed_wave(sched, exc)
            steps.done(sched, t0, result)

    def _mark_ending(self, request_ids: list[str]) -> None:
        """The scheduler ended these (lock held): those still recorded were running and end once the runner
        has let them go (``_finalize_aborted``); a later request reusing an id is not one of them."""
        for rid in request_ids:
            record = self._records.get(rid)
            if record is not None and rid not in self._stages.decoding:  # a decoding one ended its denoise: not aborted
                record.ending = True

    def _mark_started(self, sched: DiffusionSchedulerOutput) -> None:
        now = time.monotonic()
        with self._lock:
            for req in sched.new_requests:
                record = self._records.get(req.request_id)
                if record is not None and record.started is None:
                    record.started = now

    def _finalize_aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # aborted while running: ends once the runner has dropped it
            record = self._records.get(rid)
            if record is not None and record.ending:
                self._finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ABORTED))

    def _apply(self, sched: DiffusionSchedulerOutput, result: RunnerOutput, t0: float,
               released: list[str] | tuple = ()) -> None:
        """Apply a wave's result. Requests that ended while running (``sched.finished_ids``, and ``released``:
        those a skipped wave's runner let go of early) end here, once the runner no longer holds them."""
        with self._lock:
            self._applying = True
            try:
                self._apply_locked(sched, result, t0, released)
            finally:
                self._applying = False

    def _apply_locked(self, sched: DiffusionSchedulerOutput, result: RunnerOutput, t0: float,
                      released: list[str] | tuple) -> None:
        ended = self.scheduler.update_from_output(sched, result)
        self._runner_held = set(result.held_ids)
        self._finalize_aborted([*sched.finished_ids, *(r for r in released if r not in self._runner_held)])
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
                    self._stages.hold(rid, out)
                else:
                    self._finalize(rid, out)
            elif not out.finished:
                record.step(out)
        self._stages.flush()
        for rid in ended:  # ended without an output (lost by the runner)
            if rid in self._records and rid not in self._stages:
                self._finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ERROR,
                                                    error="the runner returned no output for this request"))
        # counted before the lock is released, so whoever reads a delivered output sees its wave counted; a
        # wave that only releases ended requests (the pipelined loop sends those as waves) is no step wave
        if sched.scheduled_ids and not result.skipped:
            wall_s = time.perf_counter() - t0
            count_wave(self.timing, wall_s, result.metrics)
            # the scheduler learns each shape's step cost (docs/scheduling.md)
            self.scheduler.observe_wave(sched, result.metrics.get("denoise_s") or wall_s)

    def _on_progress(self, request_id: str, step: int, total: int) -> None:
        """The runner's per-step callback (request mode; the executor's thread)."""
        with self._lock:
            record = self._records.get(request_id)
            if record is not None:
                record.progress(step, total)
            self.counters["denoise_steps"] += self.mode.steps_per_progress

    def _finalize(self, request_id: str, out: DiffusionOutput) -> None:
        """Deliver the final output and forget the request (lock held)."""
        record = self._records.pop(request_id)
        record.request.text_encodings = None  # the encode stage's tensors: a caller's handle keeps the request
        self._deadlines.discard(request_id)
        self._steps.forget(request_id)
        status = close_output(record, out)
        if record.timed_out and status != Status.FINISHED_COMPLETED:
            self.counters["requests_timed_out"] += 1
        self.counters[status.counter] += 1
        if out.metrics.get("out_of_memory"):
            self.counters["requests_out_of_memory"] += 1
            self._degraded = f"a request ran out of memory: {out.error}"
        elif status == Status.FINISHED_COMPLETED:
            self._degraded = None
        if status == Status.FINISHED_COMPLETED:  # post-processing runs on the delivery thread, not the busy loop
            request = record.request
            self._delivery.deliver(record.stream, out, lambda o: self.pipeline_cls.post_process(o, request))
        else:
            record.stream.put(out)

    def _die(self, reason: str) -> None:
        """Mark the engine dead and fail every request it holds (lock held)."""
        if self._dead:
            return
        self._dead = reason
        self._stages.clear()  # finalized below with the reason, as every record
        self._deadlines.wake.notify_all()
        self.scheduler.fail_all(reason)
        self.scheduler.schedule()  # nothing will run again: drop the release list too
        for rid in list(self._records):
            self._finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ERROR, error=reason))
        self._runner_held = set()

    # ------------------------------------------------------------------ state
    @property
    def execution_mode(self) -> DiffusionExecutionMode:
        return self.mode.mode

    @property
    def model_info(self) -> ModelInfo:
        return self.plan.model_info

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def wave_timing(self) -> dict[str, float]:
        """Where the busy loop's time went, summed since start (:func:`omni_core.engine.records.timing_summary`)."""
        with self._lock:
            return timing_summary(self.timing)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tracked = set(self._records) | self.scheduler.tracked_ids() | self._runner_held
            return {"waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                    "tracked_requests": sorted(tracked), "execution_mode": self.execution_mode.value,
                    "dead": self._dead, "degraded": self._degraded, **self.counters, "timing": self.wave_timing(),
                    "requests_preempted": self.scheduler.num_preemptions, "model_bytes": self.executor.model_bytes(),
                    "embedding_cache": embedding_cache_summary(self.timing),
                    **self._stages.stats()}

    def close(self) -> None:
        """Stop the loop, abort what is left, shut the executor down. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ids = list(self._records)
            for rid in ids:
                self.scheduler.abort_request(rid)
            self._wake.notify_all()
            self._deadlines.wake.notify_all()
        if ids and self.executor.is_alive():
            self.executor.abort(ids)
        self._thread.join(timeout=30)
        self._deadlines.thread.join(timeout=5)
        with self._lock:
            for rid in list(self._records):
                self._finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ABORTED,
                                                    error="the engine was closed"))
            self._stages.clear()  # finalized just above (aborted); a late stage result finds none
            self.scheduler.fail_all("the engine was closed")
            self.scheduler.schedule()  # flush finished ids
            self._runner_held = set()
        self.executor.shutdown()
        self._stages.shutdown()
        self._delivery.close()  # what finished before the close still arrives


def make_engine(config: EnginePlan | OmniDiffusionConfig, **kwargs: Any) -> DiffusionEngine:
    return DiffusionEngine.make_engine(config, **kwargs)
