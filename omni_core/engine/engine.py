"""DiffusionEngine: admission, the busy loop, output streams, abort, warmup.

One busy-loop thread drives ``scheduler.schedule() -> executor.execute_* -> scheduler.update_from_output``
and pushes outputs into per-request streams. Callers add requests and read streams from any thread or
asyncio loop. Abort and consumer cancellation travel the other way: the scheduler finalises the request,
the runner stops it within one denoising step (both modes), and every table forgets it.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from typing import Any, AsyncIterator, Callable

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.engine.stream import OutputStream
from omni_core.errors import ConfigError, EngineDeadError, OmniError
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.loader import check_parallel_support, resolve_model
from omni_core.request import OmniDiffusionRequest, check_prompt
from omni_core.sched.interface import DiffusionRequestStatus
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.worker.runner import innermost_frame

logger = logging.getLogger("omni_core.engine")


class DiffusionExecutionMode(str, enum.Enum):
    REQUEST_BATCH = "request_batch"
    STEP_BATCH = "step_batch"


class QueueFullError(OmniError):
    """The engine's waiting queue is at ``max_waiting_requests``."""


class DiffusionEngine:
    def __init__(self, config: OmniDiffusionConfig, *, scheduler: Any = None, executor: Any = None) -> None:
        from omni_core.plugins.manager import get_plugin_manager

        pm = get_plugin_manager()
        self.config = config
        self.resolved = resolve_model(config.model, pm)
        check_parallel_support(self.resolved, config.parallel_config)
        self.pipeline_cls = self.resolved.pipeline_cls()
        #: the resolved RequestLimits every request is checked against (config.limits over the model's)
        self.limits = self.pipeline_cls.request_limits(config.limits)
        from omni_core.platforms import check_world_size, platform_for

        check_world_size(config, platform_for(config))  # the configured platform runs here and can place the ranks
        if config.cache_backend != "none":  # a bad cache_config key fails here, before any worker starts
            pm.load_component("cache", config.cache_backend).check_config(config.cache_config)
        self.execution_mode = (DiffusionExecutionMode.STEP_BATCH if config.uses_step_execution
                               else DiffusionExecutionMode.REQUEST_BATCH)
        if self.execution_mode is DiffusionExecutionMode.STEP_BATCH and not self.pipeline_cls.supports_step_execution:
            raise ConfigError(f"pipeline {self.resolved.spec.name!r} does not support step execution "
                              f"(step_execution / streaming_output)", field="step_execution")
        capacity = config.max_num_seqs
        if self.execution_mode is DiffusionExecutionMode.REQUEST_BATCH and not self.pipeline_cls.supports_request_batch:
            capacity = 1
        self.scheduler = scheduler or pm.load_component("scheduler", config.scheduler_name)(capacity)
        self.executor = executor or pm.load_component("executor", config.executor_name)(
            config, self.resolved, on_progress=self._on_progress)
        self.executor.start()

        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, OutputStream] = {}
        self._requests: dict[str, OmniDiffusionRequest] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._listeners: dict[str, Callable[[str, int, int], None]] = {}
        self._held_ids: set[str] = set()
        self._closed = False
        self._dead: str | None = None
        self.counters = {"requests_added": 0, "requests_completed": 0, "requests_aborted": 0, "requests_failed": 0,
                         "denoise_steps": 0}
        self._thread = threading.Thread(target=self._busy_loop, name="omni-engine", daemon=True)
        self._thread.start()

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
            req = OmniDiffusionRequest(prompt="warmup", sampling_params=params,
                                       request_id=f"warmup-{secrets.token_hex(4)}")
            stream = self._admit(req, bind_loop=False)
            while True:
                out = stream.get()
                if out.finished:
                    break
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
        if params.seed is None:
            params = params.replace(seed=secrets.randbits(63))
        request.sampling_params = params
        return request

    def add_request(self, request: OmniDiffusionRequest) -> str:
        """Validate, then queue ``request``; read its outputs with ``get_output_stream``."""
        self._admit(self.prepare_request(request))
        return request.request_id

    def submit(self, request: OmniDiffusionRequest, *, bind_loop: bool = False) -> OutputStream:
        """Validate and queue ``request``; returns its stream at once, so no output can be missed.

        The stream is read with ``stream.get()`` (blocking), or with ``await stream.aget()`` when
        ``bind_loop`` is true and this is called from inside the consumer's asyncio loop.
        """
        return self._admit(self.prepare_request(request), bind_loop=bind_loop)

    def submit_many(self, requests: list[OmniDiffusionRequest]) -> list[OutputStream]:
        """Validate every request, then queue them all at once (so they can share a wave); blocking streams."""
        return self._admit_all([self.prepare_request(r) for r in requests], bind_loop=False)

    def _admit(self, request: OmniDiffusionRequest, bind_loop: bool = True) -> OutputStream:
        return self._admit_all([request], bind_loop)[0]

    def _admit_all(self, requests: list[OmniDiffusionRequest], bind_loop: bool) -> list[OutputStream]:
        """Queue requests under one lock: all or none, seen together by the next scheduling round."""
        with self._lock:
            if self._dead:
                raise EngineDeadError(self._dead)
            if self._closed:
                raise OmniError("the engine is closed")
            ids = [r.request_id for r in requests]
            for rid in ids:
                if rid in self._requests or ids.count(rid) > 1:
                    raise ConfigError(f"request_id {rid!r} is already in use", field="request_id")
            limit = self.config.max_waiting_requests
            if limit is not None and self.scheduler.num_waiting + len(requests) > limit:
                raise QueueFullError(f"the engine has {self.scheduler.num_waiting} waiting requests "
                                     f"(max_waiting_requests={limit}); retry later")
            streams = []
            now = time.monotonic()
            for request in requests:
                rid = request.request_id
                stream = OutputStream(bind_loop=bind_loop)
                self.scheduler.add_request(request)
                self._streams[rid] = stream
                self._requests[rid] = request
                self._meta[rid] = {"arrival": now}
                self.counters["requests_added"] += 1
                streams.append(stream)
            self._wake.notify()
        return streams

    def add_request_and_stream(self, request: OmniDiffusionRequest) -> AsyncIterator[DiffusionOutput]:
        """Validate and queue ``request`` and return its output iterator in one step (race-free)."""
        stream = self.submit(request, bind_loop=True)
        return self._iterate(request.request_id, stream)

    def get_output_stream(self, request_id: str) -> AsyncIterator[DiffusionOutput]:
        """The outputs of a request added with ``add_request``, until its final one.

        The stream is taken when this is called (not on first iteration); call it right after
        ``add_request``, or use ``add_request_and_stream``, which cannot miss a fast request's output.
        """
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: OutputStream) -> AsyncIterator[DiffusionOutput]:
        """Yield until the final output; a consumer that stops early aborts the request."""
        finished = False
        try:
            while True:
                out = await stream.aget()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def step_streaming(self, request: OmniDiffusionRequest) -> AsyncIterator[DiffusionOutput]:
        """Add ``request`` and yield its outputs (intermediate ones when streaming, the final one last)."""
        async for out in self.add_request_and_stream(request):
            yield out

    def add_progress_listener(self, request_id: str, fn: Callable[[str, int, int], None]) -> None:
        with self._lock:
            if request_id in self._requests:
                self._listeners[request_id] = fn

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
        if running and self.execution_mode is DiffusionExecutionMode.REQUEST_BATCH:
            self.executor.abort(running)  # stop mid-forward; in step mode the next wave leaves it out

    # ------------------------------------------------------------------ busy loop
    def _busy_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._dead and not self.scheduler.has_work():
                    self._wake.wait(timeout=0.5)
                    if not self.executor.is_alive():
                        self._die(self.executor.death_reason or "the engine is dead: a worker died")
                if self._closed or self._dead:
                    return
                sched = self.scheduler.schedule()
            try:
                if sched.is_empty:
                    if sched.finished_ids:  # ended while running: the runner drops them first
                        held = self.executor.release(sched.finished_ids)
                        with self._lock:
                            self._held_ids = held
                            self._finalize_aborted(sched.finished_ids)
                    continue
                self._mark_started(sched)
                if self.execution_mode is DiffusionExecutionMode.STEP_BATCH:
                    result = self.executor.execute_step(sched)
                else:
                    result = self.executor.execute_batch(sched)
            except EngineDeadError as exc:
                with self._lock:
                    self._die(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the wave fails, the engine lives on
                logger.exception("executor failed a wave")
                result = RunnerOutput(outputs={rid: DiffusionOutput(request_id=rid, status="error",
                                                                    error=f"{type(exc).__name__}: {exc}")
                                               for rid in sched.scheduled_ids})
            self._apply(sched, result)

    def _mark_started(self, sched: DiffusionSchedulerOutput) -> None:
        now = time.monotonic()
        for req in sched.new_requests:
            meta = self._meta.get(req.request_id)
            if meta is not None:
                meta.setdefault("started", now)

    def _finalize_aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # aborted while running: ends once the runner has dropped it
            if rid in self._requests:
                self._finalize(rid, DiffusionOutput(request_id=rid, status="aborted"))

    def _apply(self, sched: DiffusionSchedulerOutput, result: RunnerOutput) -> None:
        with self._lock:
            ended = self.scheduler.update_from_output(sched, result)
            self._held_ids = set(result.held_ids)
            self._finalize_aborted(sched.finished_ids)
            if self.execution_mode is DiffusionExecutionMode.STEP_BATCH:
                self.counters["denoise_steps"] += len(sched.scheduled_ids)
            for rid, out in result.outputs.items():
                if rid not in self._requests:
                    continue  # already ended here (aborted while the wave ran)
                if rid in ended:
                    if ended[rid] == DiffusionRequestStatus.FINISHED_ERROR and out.status != "error":
                        out.status, out.error = "error", out.error or "request failed"
                    elif (ended[rid] == DiffusionRequestStatus.FINISHED_COMPLETED
                          and self.execution_mode is DiffusionExecutionMode.STEP_BATCH):
                        self._last_step(rid, out)
                    self._finalize(rid, out)
                elif not out.finished:
                    self._notify_progress(rid, out.step_index, out.num_steps)
                    if self.config.streaming_output:
                        self._streams[rid].put(out)
            for rid, status in ended.items():  # ended without an output (lost by the runner)
                if rid in self._requests:
                    self._finalize(rid, DiffusionOutput(request_id=rid, status="error",
                                                        error="the runner returned no output for this request"))

    def _last_step(self, request_id: str, out: DiffusionOutput) -> None:
        """The step that finished a request counts like the others: progress, and (streaming) its preview
        as an intermediate output before the final one, so N steps stream N previews (lock held)."""
        self._notify_progress(request_id, out.step_index, out.num_steps)
        if self.config.streaming_output:
            self._streams[request_id].put(DiffusionOutput(
                request_id=request_id, finished=False, preview=out.preview, step_index=out.step_index,
                num_steps=out.num_steps, metrics={k: out.metrics[k] for k in ("step_time_s", "batch_size")
                                                  if k in out.metrics}))
        out.preview = None

    def _on_progress(self, request_id: str, step: int, total: int) -> None:
        with self._lock:
            self._notify_progress(request_id, step, total)
            if self.execution_mode is DiffusionExecutionMode.REQUEST_BATCH:
                self.counters["denoise_steps"] += 1

    def _notify_progress(self, request_id: str, step: int, total: int) -> None:
        meta = self._meta.get(request_id)
        if meta is not None:
            meta["steps"] = step
        fn = self._listeners.get(request_id)
        if fn is not None:
            try:
                fn(request_id, step, total)
            except Exception:  # noqa: BLE001 - a broken progress bar must not break the engine
                logger.debug("progress listener failed", exc_info=True)

    def _finalize(self, request_id: str, out: DiffusionOutput) -> None:
        """Deliver the final output and forget the request everywhere in the engine (lock held)."""
        request = self._requests.pop(request_id)
        stream = self._streams.pop(request_id)
        meta = self._meta.pop(request_id, {})
        self._listeners.pop(request_id, None)
        out.finished = True
        now = time.monotonic()
        out.metrics["e2e_latency_s"] = now - meta.get("arrival", now)
        out.metrics["steps_run"] = max(out.step_index, meta.get("steps", 0))
        if "started" in meta:
            out.metrics["queue_time_s"] = meta["started"] - meta["arrival"]
        key = {"completed": "requests_completed", "aborted": "requests_aborted"}.get(out.status, "requests_failed")
        self.counters[key] += 1
        if out.status == "completed":
            try:
                out = self.pipeline_cls.post_process(out, request)
            except Exception as exc:  # noqa: BLE001
                out.status, out.error = "error", f"post-processing failed: {type(exc).__name__}: {exc}"
        stream.put(out)

    def _die(self, reason: str) -> None:
        """Mark the engine dead and fail every request it holds (lock held)."""
        if self._dead:
            return
        self._dead = reason
        self.scheduler.fail_all(reason)
        self.scheduler.schedule()  # nothing will run again: drop the release list too
        for rid in list(self._requests):
            self._finalize(rid, DiffusionOutput(request_id=rid, status="error", error=reason))
        self._held_ids = set()

    # ------------------------------------------------------------------ state
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tracked = (set(self._requests) | set(self._streams) | set(self._meta) | self.scheduler.tracked_ids()
                       | self._held_ids)
            return {"waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                    "tracked_requests": sorted(tracked), "execution_mode": self.execution_mode.value,
                    "dead": self._dead, **self.counters}

    def close(self) -> None:
        """Stop the loop, abort what is left, shut the executor down. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ids = list(self._requests)
            for rid in ids:
                self.scheduler.abort_request(rid)
            self._wake.notify_all()
        if ids and self.executor.is_alive():
            self.executor.abort(ids)
        self._thread.join(timeout=30)
        with self._lock:
            for rid in list(self._requests):
                self._finalize(rid, DiffusionOutput(request_id=rid, status="aborted",
                                                    error="the engine was closed"))
            self.scheduler.fail_all("the engine was closed")
            self.scheduler.schedule()  # flush finished ids
            self._held_ids = set()
        self.executor.shutdown()


def make_engine(config: OmniDiffusionConfig, **kwargs: Any) -> DiffusionEngine:
    return DiffusionEngine.make_engine(config, **kwargs)
