"""DiffusionEngine: admission, the busy loop, per-request records, abort, warmup.

One busy-loop thread drives ``scheduler.schedule() -> mode.execute -> scheduler.update_from_output`` and
pushes outputs into per-request streams. Callers ``submit`` requests and read them through the returned
handles from any thread or asyncio loop. Abort and consumer cancellation travel the other way: the
scheduler finalises the request, the runner stops it within one denoising step (both modes), and the
engine forgets its record. Everything the engine holds for a request is one ``RequestRecord`` in one table.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from typing import Any

import attrs

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.engine.delivery import OutputDelivery
from omni_core.engine.model_info import ModelInfo, ProgressFn
from omni_core.engine.handle import RequestHandle
from omni_core.engine.modes import DiffusionExecutionMode, mode_for
from omni_core.engine.stream import OutputStream
from omni_core.errors import ConfigError, EngineDeadError, OmniError, QueueFullError
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.loader import check_parallel_support, resolve_model
from omni_core.request import OmniDiffusionRequest, check_prompt
from omni_core.sched.interface import DiffusionRequestStatus
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.utils.progress import progress
from omni_core.worker.runner import innermost_frame

logger = logging.getLogger("omni_core.engine")

__all__ = ["DiffusionEngine", "DiffusionExecutionMode", "QueueFullError", "RequestRecord", "make_engine"]


@attrs.define(eq=False)
class RequestRecord:
    """What the engine holds for one admitted request, from admission to its final output."""

    request: OmniDiffusionRequest
    stream: OutputStream
    #: ``time.monotonic()`` at admission, and when its first wave started
    arrival: float
    started: float | None = None
    #: the last denoising step reported for it, and of how many (the params' steps until the runner says)
    steps: int = 0
    on_progress: ProgressFn | None = None
    num_steps: int | None = None
    #: step waves holding it that were sent and not yet applied (the pipelined step loop)
    in_flight: int = 0
    #: it passed its deadline (``SamplingParams.timeout``): its final output is a timeout error
    timed_out: bool = False
    #: the scheduler ended it while it ran (aborted, timed out): it ends once the runner has let it go
    ending: bool = False


class DiffusionEngine:
    """The in-process engine; front ends use it as an :class:`~omni_core.engine.client.EngineClient`."""

    def __init__(self, config: OmniDiffusionConfig, *, scheduler: Any = None, executor: Any = None) -> None:
        from omni_core.plugins.manager import get_plugin_manager

        pm = get_plugin_manager()
        self.config = config
        self.resolved = resolve_model(config.model, pm)
        check_parallel_support(self.resolved, config.parallel_config)
        self.pipeline_cls = self.resolved.pipeline_cls()
        #: the resolved RequestLimits every request is checked against (config.limits over the model's)
        self.limits = self.pipeline_cls.request_limits(config.limits)
        if config.loras:  # preloaded LoRA adapters must fit the model before any worker starts
            from omni_core.lora import check_engine_loras

            check_engine_loras(config, self.pipeline_cls, self.resolved.model_path)
        from omni_core.platforms import check_world_size, platform_for

        check_world_size(config, platform_for(config))  # the configured platform runs here and can place the ranks
        from omni_core.optimize import check_config, resolve_preset

        # performance_mode fills the unset memory/speed options; then each is checked against this platform
        config, self.performance = resolve_preset(config, self.resolved.model_path, platform_for(config))
        self.config = config
        from omni_core.combinations import check_combinations

        check_combinations(config)  # pairs of features that cannot run together (omni_core/combinations.py)
        check_config(config, platform_for(config))
        # a bad cache_config key fails here, before any worker starts ("none" too: a built-in that takes any)
        pm.load_component("cache", config.cache_backend).check_config(config.cache_config)
        #: the execution-mode strategy, chosen once (every mode difference lives in it)
        self.mode = mode_for(config, self.pipeline_cls, self.resolved.spec.name)
        from omni_core.sched.capacity import wave_limits

        capacity = self.mode.capacity(self.pipeline_cls, wave_limits(config)[0])  # unset: batching by default
        self.scheduler = scheduler or pm.load_component("scheduler", config.scheduler_name)(capacity)
        if scheduler is None and hasattr(self.scheduler, "configure"):  # the policy knobs (docs/scheduling.md)
            self.scheduler.configure(config)
        self.executor = executor or pm.load_component("executor", config.executor_name)(
            config, self.resolved, on_progress=self._on_progress)
        self.executor.start()

        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        #: every admitted request that has not ended, by id: the engine's only per-request table
        self._records: dict[str, RequestRecord] = {}
        #: the records with step waves in flight (``RequestRecord.in_flight > 0``; the pipelined step loop)
        self._in_flight_records: dict[str, RequestRecord] = {}
        #: ids the runner still held state for after the last wave (it may outlive a record; stats shows it)
        self._runner_held: set[str] = set()
        self._closed = False
        self._dead: str | None = None
        self.counters = {"requests_added": 0, "requests_completed": 0, "requests_aborted": 0, "requests_failed": 0,
                         "denoise_steps": 0}
        self.counters["requests_timed_out"] = 0  # also counted in requests_failed
        #: queued step waves whose step the worker skipped for a wave that replaced them (``_send_now``)
        self.counters["step_waves_replaced"] = 0
        #: request id -> deadline, for the requests that have one (until it passes: ``_watch_deadlines``)
        self._deadlines: dict[str, float] = {}
        #: where the busy loop's time went, summed over waves (see ``wave_timing``)
        self.timing = {"waves": 0, "denoise_calls": 0, "wave_s": 0.0, "pipeline_s": 0.0, "denoise_s": 0.0,
                       "denoiser_calls": 0, "denoiser_s": 0.0}
        self._delivery = OutputDelivery()
        #: step waves sent and not yet applied, and how many may be (the pipelined step loop; None otherwise)
        self._inflight: collections.deque | None = None
        self._depth = 1
        #: inside ``_apply`` (a listener that aborts there must not schedule in the middle of it)
        self._applying = False
        #: wakes the deadline watcher when a deadline is added or the engine closes or dies
        self._deadline_wake = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._busy_loop, name="omni-engine", daemon=True)
        self._thread.start()
        self._deadline_thread = threading.Thread(target=self._watch_deadlines, name="omni-deadlines", daemon=True)
        self._deadline_thread.start()

    @classmethod
    def make_engine(cls, config: OmniDiffusionConfig, **kwargs: Any) -> DiffusionEngine:
        """Build the engine and run its start-up warmup (so the first user request is not the slow one)."""
        engine = cls(config, **kwargs)
        if config.warmup:
            try:
                engine.run_startup_warmup()
            except BaseException:
                engine.close()
                raise
        return engine

    def warmup_params(self) -> SamplingParams:
        """One step at the smallest valid shape (not the model's default size, which costs a full-size step
        and may not fit a small model), or the pipeline's own ``warmup_params`` (a class attribute dict)."""
        cls = self.pipeline_cls
        m = cls.size_multiple
        values: dict[str, Any] = {"height": m, "width": m, "num_inference_steps": 1, "output_type": "latent", "seed": 0}
        if cls.is_video:
            values["num_frames"] = 1  # (num_frames - 1) % frame_multiple == 0 holds for any multiple
        declared = getattr(cls, "warmup_params", None)
        params = SamplingParams.from_kwargs(**{**values, **(declared or {})})
        for _ in range(3):  # a folder may need a larger multiple than the class declares (e.g. a VAE factor)
            try:
                return cls.check_sampling_params(params, self.resolved.model_path)
            except ConfigError as exc:
                if declared or exc.field not in ("height", "width"):
                    raise
                params = params.replace(height=params.height * 2, width=params.width * 2)
        return cls.check_sampling_params(params, self.resolved.model_path)

    def run_startup_warmup(self) -> None:
        """Run one tiny request end to end; a failure says which model, which shape, where, and how to skip."""
        shape, frame = "(no shape: choosing it failed)", None
        try:
            params = self.warmup_params()
            shape = (f"height={params.height} width={params.width}"
                     + (f" num_frames={params.num_frames}" if params.num_frames is not None else "")
                     + f" steps={params.num_inference_steps}")
            progress(f"model loaded; warming up ({shape}) ...")
            req = OmniDiffusionRequest(prompt="warmup", sampling_params=params,
                                       request_id=f"warmup-{secrets.token_hex(4)}")
            if self.pipeline_cls.image_input is not None:  # a model that needs input images warms up with grey ones
                from omni_core.images import warmup_images

                req.images = warmup_images(self.pipeline_cls.image_input, params.height, params.width)
                self.pipeline_cls.check_images(req, self.limits)
            out = self._admit([req])[0].result()
            error, frame = out.error, out.metrics.get("error_frame")
        except Exception as exc:  # noqa: BLE001 - the shape was refused, or the engine died
            out, error, frame = None, f"{type(exc).__name__}: {exc}", innermost_frame(exc)
        if out is None or out.status == "error":
            raise OmniError(f"start-up warmup of model {self.resolved.spec.name!r} ({self.resolved.model_path}) failed "
                            f"at {shape}: {error}" + (f" [raised at {frame}]" if frame else "")
                            + "; start without it with warmup=False (omni serve / omni generate --no-warmup)")

    # ------------------------------------------------------------------ admission
    def prepare_request(self, request: OmniDiffusionRequest) -> OmniDiffusionRequest:
        """Validate and complete a request (model defaults, a seed) before it touches any engine state."""
        check_prompt(request.prompt, request.negative_prompt)
        params = self.pipeline_cls.check_sampling_params(request.sampling_params, self.resolved.model_path)
        self.limits.check(params, request.prompt, request.negative_prompt, model=self.pipeline_cls.__name__)
        self.pipeline_cls.check_images(request, self.limits)
        if params.lora is not None:  # the adapter exists, is a LoRA for this model, within max_lora_rank
            from omni_core.lora import check_request_lora

            check_request_lora(params, self.config, self.pipeline_cls, self.resolved.model_path)
        if params.seed is None:
            params = params.replace(seed=secrets.randbits(63))
        request.sampling_params = params
        return request

    def submit(self, requests: list[OmniDiffusionRequest], *, on_progress: ProgressFn | None = None
               ) -> list[RequestHandle]:
        """Validate every request, then queue them all at once (so compatible ones can share a wave) or none.

        Returns one handle per request, in order, before any output exists, so none can be missed.
        ``on_progress(request_id, step, num_steps)`` runs on the engine's thread after every denoising step
        of each of them (the last included, in both modes).
        """
        if isinstance(requests, OmniDiffusionRequest):
            raise TypeError("submit takes a list of requests: engine.submit([request])")
        return self._admit([self.prepare_request(r) for r in requests], on_progress)

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
            if limit is not None and self.scheduler.num_waiting + len(requests) > limit:
                raise QueueFullError(f"the engine has {self.scheduler.num_waiting} waiting requests "
                                     f"(max_waiting_requests={limit}); retry later")
            handles = []
            now = time.monotonic()
            try:
                for request in requests:
                    record = RequestRecord(request=request, stream=OutputStream(), arrival=now,
                                           on_progress=on_progress)
                    timeout = getattr(request.sampling_params, "timeout", None)
                    if timeout is not None:
                        self._deadlines[request.request_id] = now + timeout
                        self._deadline_wake.notify()
                    self.scheduler.add_request(request)
                    self._records[request.request_id] = record
                    handles.append(RequestHandle(request, record.stream, self.abort))
            except BaseException:  # all or none: nothing half-queued that no caller holds a handle for
                for handle in handles:  # still waiting: the scheduler ends them now (the runner never saw them)
                    self.scheduler.abort_request(handle.request_id)
                    del self._records[handle.request_id]
                    self._deadlines.pop(handle.request_id, None)
                self._wake.notify()  # the loop's next round flushes them from the scheduler's finished list
                raise
            self.counters["requests_added"] += len(handles)
            self._wake.notify()
            self._send_now()
        return handles

    # ------------------------------------------------------------------ abort
    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: a waiting one ends now, a running one within one denoising step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        running = []
        with self._lock:
            for rid in ids:
                status = self.scheduler.abort_request(rid)
                if status == DiffusionRequestStatus.FINISHED_ABORTED:
                    self._finalize(rid, DiffusionOutput(request_id=rid, status="aborted"))
                elif status is not None:
                    running.append(rid)
            self._wake.notify()
            if running:
                self._send_now()
        if running:
            self.mode.stop_running(self.executor, running)

    # ------------------------------------------------------------------ busy loop
    def _busy_loop(self) -> None:
        depth = self.mode.pipeline_depth(self.executor)
        if depth > 1:
            return self._pipelined_loop(depth)
        while True:
            with self._lock:
                while not self._closed and not self._dead and not self.scheduler.has_work():
                    self._wake.wait(timeout=0.5)
                    if not self.executor.is_alive():
                        self._die(self.executor.death_reason or "the engine is dead: a worker died")
                if self._closed or self._dead:
                    return
                t0 = time.perf_counter()
                sched = self.scheduler.schedule()
                self._mark_ending(sched.finished_ids)
            try:
                if sched.is_empty:
                    if sched.finished_ids:  # ended while running: the runner drops them first
                        held = self.executor.release(sched.finished_ids)
                        with self._lock:
                            self._runner_held = held
                            self._finalize_aborted(sched.finished_ids)
                    continue
                self._mark_started(sched)
                result = self.mode.execute(self.executor, sched)
            except EngineDeadError as exc:
                with self._lock:
                    self._die(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the wave fails, the engine lives on
                logger.exception("executor failed a wave")
                result = RunnerOutput(outputs={rid: DiffusionOutput(request_id=rid, status="error",
                                                                    error=f"{type(exc).__name__}: {exc}")
                                               for rid in sched.scheduled_ids})
            self._apply(sched, result, t0)

    def _pipelined_loop(self, depth: int) -> None:
        """Step mode over an executor that queues waves (``mp``): wave N+1 is sent before wave N's result is read,
        so the worker starts the next step at once instead of waiting for the engine's round trip (result
        transport, bookkeeping, scheduling, dispatch; ~1 ms a step on a 2-core CPU, more than a small model's
        step). A wave is scheduled before the previous one's result, so a request the engine expects to finish in
        a wave in flight (its step count says so) is left out of the next. A change that should not wait for the
        queued wave (an urgent request, an abort) sends a wave that replaces it (``_send_now``). A wrong guess
        costs a step's gap or a skipped id, never a wrong result: the runner ignores ids it no longer holds, and
        outputs are applied in wave order."""
        inflight = self._inflight = collections.deque()  # (wave, time scheduled): sent, result not yet applied
        self._depth = depth
        last_done = time.perf_counter()
        while True:
            with self._lock:
                while not self._closed and not self._dead and not inflight and not self.scheduler.has_work():
                    self._wake.wait(timeout=0.5)
                    if not self.executor.is_alive():
                        self._die(self.executor.death_reason or "the engine is dead: a worker died")
                if self._closed or self._dead:
                    return
                if len(inflight) < depth and self.scheduler.has_work() and self._schedule_and_send():
                    if len(inflight) < depth:
                        continue  # fill the pipeline before waiting
                if self._closed or self._dead or not inflight:
                    continue
                sched, t0 = inflight[0]
            try:
                result = self.executor.recv_step()
            except EngineDeadError as exc:
                with self._lock:
                    self._die(str(exc))
                return
            except Exception as exc:  # noqa: BLE001
                logger.exception("executor failed a wave")
                result = self._failed_wave(sched, exc)
            with self._lock:
                inflight.popleft()
                self._hold_in_flight(sched, -1)
                # a skipped wave's runner also released what the wave replacing it ends (mp_worker._replaced)
                released = inflight[0][0].finished_ids if result.skipped and inflight else ()
                self._apply(sched, result, max(t0, last_done), released)  # each counts from the previous end
            last_done = time.perf_counter()

    def _schedule_and_send(self, replaces_queued: bool = False) -> bool:
        """Schedule the next step wave and queue it on the executor (pipelined loop; lock held, so waves are
        sent in the order they were scheduled, whichever thread sends). A replacement is scheduled as if the
        queued wave it replaces will not run (its steps are not counted as in flight), so a request whose last
        step is in it keeps its slot and takes that step in the replacement. False if there was nothing to send."""
        t0 = time.perf_counter()
        queued = self._inflight[-1][0] if replaces_queued else None
        sched = self.scheduler.schedule(finishing=self._finishing_in_flight(queued))
        self._mark_ending(sched.finished_ids)
        if sched.is_empty and not sched.finished_ids:
            return False
        sched.replaces_queued, sched.may_be_replaced = replaces_queued, True
        self._hold_in_flight(sched, +1)
        try:
            self._mark_started(sched)
            self.executor.send_step(sched)
        except EngineDeadError as exc:
            self._die(str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - the wave fails, the engine lives on
            logger.exception("executor failed to send a wave")
            self._hold_in_flight(sched, -1)
            self._apply(sched, self._failed_wave(sched, exc), t0)
            return False
        self._inflight.append((sched, t0))
        return True

    def _send_now(self) -> None:
        """After an arrival or an abort (lock held): while the pipelined loop waits on a wave's result, send the
        next wave now if it would change something (start, resume or preempt a request, end an aborted one),
        replacing the wave already queued behind the running one. So an urgent request starts, and an aborted
        one stops, at the next step boundary rather than one queued step later."""
        inflight, depth = self._inflight, self._depth
        if inflight is None or not inflight or len(inflight) > depth or self._closed or self._dead:
            return  # not pipelined, or the loop schedules next anyway; at most one replacement queued
        if self._applying:
            return  # an on_progress listener inside _apply: the loop schedules right after it anyway
        would_start = getattr(self.scheduler, "would_start", None)  # a plugin scheduler may not offer it
        replaces = len(inflight) >= depth
        try:
            if would_start is not None and would_start(self._finishing_in_flight(inflight[-1][0] if replaces else None)):
                self._schedule_and_send(replaces_queued=replaces)
        except Exception:  # noqa: BLE001 - the caller's submit or abort stands; the loop schedules as usual
            logger.exception("scheduling a wave early failed")

    @staticmethod
    def _failed_wave(sched: DiffusionSchedulerOutput, exc: Exception) -> RunnerOutput:
        return RunnerOutput(outputs={rid: DiffusionOutput(request_id=rid, status="error",
                                                          error=f"{type(exc).__name__}: {exc}")
                                     for rid in sched.scheduled_ids})

    def _hold_in_flight(self, sched: DiffusionSchedulerOutput, delta: int) -> None:
        with self._lock:
            for rid in sched.scheduled_ids:
                record = self._records.get(rid)
                if record is not None:
                    record.in_flight += delta
                    if record.num_steps is None:
                        record.num_steps = record.request.sampling_params.num_inference_steps
                    if record.in_flight > 0:
                        self._in_flight_records[rid] = record
                    else:
                        self._in_flight_records.pop(rid, None)

    def _finishing_in_flight(self, not_counting: DiffusionSchedulerOutput | None = None) -> set[str]:
        """Running requests whose last step is in a wave already sent, leaving out the steps of ``not_counting``
        (a queued wave about to be replaced; lock held). Looks only at the requests in flight, so it costs the
        same with any number waiting."""
        skipped = set(not_counting.scheduled_ids) if not_counting is not None else ()
        return {rid for rid, r in self._in_flight_records.items()
                if r.num_steps is not None and r.steps + r.in_flight - (rid in skipped) >= r.num_steps}

    def _mark_ending(self, request_ids: list[str]) -> None:
        """The scheduler ended these (lock held): those still recorded were running and end once the runner
        has let them go (``_finalize_aborted``); a later request reusing an id is not one of them."""
        for rid in request_ids:
            record = self._records.get(rid)
            if record is not None:
                record.ending = True

    def _count_wave(self, wall_s: float, metrics: dict) -> None:
        t = self.timing
        t["waves"] += 1
        t["wave_s"] += wall_s
        t["pipeline_s"] += metrics.get("pipeline_s", 0.0)
        t["denoise_s"] += metrics.get("denoise_s", 0.0)
        t["denoise_calls"] += metrics.get("denoise_calls", 0)
        t["denoiser_s"] += metrics.get("denoiser_s", 0.0)
        t["denoiser_calls"] += metrics.get("denoiser_calls", 0)

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
                self._finalize(rid, DiffusionOutput(request_id=rid, status="aborted"))

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
                if ended[rid] == DiffusionRequestStatus.FINISHED_ERROR and out.status != "error":
                    out.status, out.error = "error", out.error or "request failed"
                elif ended[rid] == DiffusionRequestStatus.FINISHED_COMPLETED and self.mode.final_output_is_a_step:
                    self._last_step(record, out)
                self._finalize(rid, out)
            elif not out.finished:
                self._notify_progress(record, out.step_index, out.num_steps)
                if self.config.streaming_output and record.request.stream_previews:
                    record.stream.put(out)
        for rid, status in ended.items():  # ended without an output (lost by the runner)
            if rid in self._records:
                self._finalize(rid, DiffusionOutput(request_id=rid, status="error",
                                                    error="the runner returned no output for this request"))
        # counted before the lock is released, so whoever reads a delivered output sees its wave counted; a
        # wave that only releases ended requests (the pipelined loop sends those as waves) is no step wave
        if sched.scheduled_ids and not result.skipped:
            wall_s = time.perf_counter() - t0
            self._count_wave(wall_s, result.metrics)
            observe = getattr(self.scheduler, "observe_wave", None)
            if observe is not None:  # the scheduler learns each shape's step cost (docs/scheduling.md)
                observe(sched, result.metrics.get("denoise_s") or wall_s)

    def _watch_deadlines(self) -> None:
        """The deadline watcher thread: at each deadline, end the request (``_expire_deadlines``), so a request
        ends within one step of it whatever the busy loop is waiting on (a wave's result, a whole request-mode
        wave). Idle (no CPU) while no request has a deadline."""
        with self._lock:
            while not self._closed and not self._dead:
                if not self._deadlines:
                    self._deadline_wake.wait()
                    continue
                delay = min(self._deadlines.values()) - time.monotonic()
                if delay > 0:
                    self._deadline_wake.wait(delay)
                    continue
                running = self._expire_deadlines()
                if running:  # step mode: the next wave leaves them out (mp: one replacing the queued wave now)
                    self._send_now()
                    self.mode.stop_running(self.executor, running)  # request mode: the runner stops them

    def _expire_deadlines(self) -> list[str]:
        """End the requests past their deadline (lock held): a waiting one now, a running one at the next step
        (the returned ids: request mode must tell the runner, ``mode.stop_running``). Their final output is a
        timeout error (``_finalize``)."""
        now = time.monotonic()
        running = []
        for rid, deadline in list(self._deadlines.items()):
            if deadline > now:
                continue
            del self._deadlines[rid]
            record = self._records.get(rid)
            if record is None or record.timed_out:
                continue
            record.timed_out = True
            status = self.scheduler.abort_request(rid)
            if status == DiffusionRequestStatus.FINISHED_ABORTED:
                self._finalize(rid, DiffusionOutput(request_id=rid, status="aborted"))
            elif status is not None:
                running.append(rid)
        if running:
            self._wake.notify()
        return running

    def _last_step(self, record: RequestRecord, out: DiffusionOutput) -> None:
        """The step that finished a request counts like the others: progress, and (streaming) its preview
        as an intermediate output before the final one, so N steps stream N previews (lock held)."""
        self._notify_progress(record, out.step_index, out.num_steps)
        if self.config.streaming_output and record.request.stream_previews:
            record.stream.put(DiffusionOutput(
                request_id=out.request_id, finished=False, preview=out.preview, step_index=out.step_index,
                num_steps=out.num_steps, metrics={k: out.metrics[k] for k in ("step_time_s", "batch_size")
                                                  if k in out.metrics}))
        out.preview = None

    def _on_progress(self, request_id: str, step: int, total: int) -> None:
        """The runner's per-step callback (request mode; the executor's thread)."""
        with self._lock:
            record = self._records.get(request_id)
            if record is not None:
                self._notify_progress(record, step, total)
            self.counters["denoise_steps"] += self.mode.steps_per_progress

    @staticmethod
    def _notify_progress(record: RequestRecord, step: int, total: int) -> None:
        record.steps, record.num_steps = step, total
        if record.on_progress is not None:
            try:
                record.on_progress(record.request.request_id, step, total)
            except Exception:  # noqa: BLE001 - a broken progress bar must not break the engine
                logger.debug("progress listener failed", exc_info=True)

    def _finalize(self, request_id: str, out: DiffusionOutput) -> None:
        """Deliver the final output and forget the request (lock held)."""
        record = self._records.pop(request_id)
        self._deadlines.pop(request_id, None)
        self._in_flight_records.pop(request_id, None)
        out.finished = True
        if record.timed_out and out.status != "completed":
            timeout = record.request.sampling_params.timeout
            out.status, out.error = "error", (f"timed out: the request did not finish within its timeout of "
                                              f"{timeout:g} s (SamplingParams.timeout, the server's 'timeout' field)")
            out.metrics["timed_out"] = True
            self.counters["requests_timed_out"] += 1
        now = time.monotonic()
        out.metrics["e2e_latency_s"] = now - record.arrival
        out.metrics["steps_run"] = max(out.step_index, record.steps)
        if record.started is not None:
            out.metrics["queue_time_s"] = record.started - record.arrival
        key = {"completed": "requests_completed", "aborted": "requests_aborted"}.get(out.status, "requests_failed")
        self.counters[key] += 1
        if out.status == "completed":  # post-processing runs on the delivery thread, not the busy loop
            request = record.request
            self._delivery.deliver(record.stream, out, lambda o: self.pipeline_cls.post_process(o, request))
        else:
            record.stream.put(out)

    def _die(self, reason: str) -> None:
        """Mark the engine dead and fail every request it holds (lock held)."""
        if self._dead:
            return
        self._dead = reason
        self._deadline_wake.notify_all()
        self.scheduler.fail_all(reason)
        self.scheduler.schedule()  # nothing will run again: drop the release list too
        for rid in list(self._records):
            self._finalize(rid, DiffusionOutput(request_id=rid, status="error", error=reason))
        self._runner_held = set()

    # ------------------------------------------------------------------ state
    @property
    def execution_mode(self) -> DiffusionExecutionMode:
        return self.mode.mode

    @property
    def model_info(self) -> ModelInfo:
        cls, spec = self.pipeline_cls, self.resolved.spec
        return ModelInfo(model=self.config.model, pipeline=spec.name, provider=spec.provider,
                         model_path=self.resolved.model_path, is_video=bool(getattr(cls, "is_video", False)),
                         frame_multiple=getattr(cls, "frame_multiple", 1), size_multiple=cls.size_multiple,
                         streaming=bool(self.config.streaming_output), sampling_fields=tuple(spec.sampling_fields),
                         image_input=cls.image_input)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def wave_timing(self) -> dict[str, float]:
        """Where the busy loop's time went, summed since start: ``wave_s`` (wall time of waves, from
        scheduling to delivering their outputs), ``pipeline_s`` (inside the model's pipeline calls),
        ``denoise_s`` (inside ``denoise_step``), ``denoise_calls``, ``denoiser_s`` and ``denoiser_calls`` (inside
        the declared denoisers' forward, one call per CFG branch and expert; ``omni_core.worker.instrument``), and
        ``engine_s_per_step``: the engine's own time (``wave_s - pipeline_s``: scheduling, transport,
        bookkeeping, events, delivery) per ``denoise_step`` call."""
        with self._lock:
            t = dict(self.timing)
        t["engine_s"] = t["wave_s"] - t["pipeline_s"]
        t["engine_s_per_step"] = t["engine_s"] / t["denoise_calls"] if t["denoise_calls"] else 0.0
        return t

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tracked = set(self._records) | self.scheduler.tracked_ids() | self._runner_held
            return {"waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                    "tracked_requests": sorted(tracked), "execution_mode": self.execution_mode.value,
                    "dead": self._dead, **self.counters, "timing": self.wave_timing(),
                    "requests_preempted": getattr(self.scheduler, "num_preemptions", 0),
                    "model_bytes": self.executor.model_bytes()}

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
            self._deadline_wake.notify_all()
        if ids and self.executor.is_alive():
            self.executor.abort(ids)
        self._thread.join(timeout=30)
        self._deadline_thread.join(timeout=5)
        with self._lock:
            for rid in list(self._records):
                self._finalize(rid, DiffusionOutput(request_id=rid, status="aborted",
                                                    error="the engine was closed"))
            self.scheduler.fail_all("the engine was closed")
            self.scheduler.schedule()  # flush finished ids
            self._runner_held = set()
        self.executor.shutdown()
        self._delivery.close()  # what finished before the close still arrives


def make_engine(config: OmniDiffusionConfig, **kwargs: Any) -> DiffusionEngine:
    return DiffusionEngine.make_engine(config, **kwargs)
