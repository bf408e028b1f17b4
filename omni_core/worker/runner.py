"""ModelRunner: owns the loaded pipeline and the per-request step states of one process.

Request path: ``execute_batch`` runs whole requests through ``pipeline.forward`` and stops an aborted one
between steps. Step path: ``execute_step`` encodes new requests, runs one batched ``denoise_step`` over
every scheduled request, steps each request's own scheduler and decodes the finished ones. An exception in
one request fails only that request.

Ranks fail together: with several ranks in a replica, every failure is agreed before anyone acts on it, so a
rank-local exception (an out-of-memory error on one GPU, say) fails the call on every rank and no rank goes on
with collectives its peers have left (:mod:`omni_core.worker.failures`: ``sync_failure``, ``PeerFailure``).
Where the runner has a :class:`~omni_core.distributed.recovery.GroupRecovery` (a replica that is the whole
world), a failing rank aborts the process groups first, so peers blocked in a collective it never reached fail
at once, and every rank rebuilds them before the agreement (``RankAgreement._recover``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from omni_core.optimize.compile import compile_metrics
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.loader import ResolvedModel, load_pipeline
from omni_core.pipelines.state import StepState
from omni_core.request import OmniDiffusionRequest
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.worker.failures import RankAgreement, batched_then_one_by_one, error_output
from omni_core.worker.lanes import CpuLanes, lanes_allowed
from omni_core.worker.timing import WaveClock, lane_clock
from omni_core.worker.weights import WeightOps


logger = logging.getLogger("omni_core.worker")

def sent_bytes() -> int:
    """Bytes this process has sent over its parallel groups so far (0 without parallelism); the difference
    around a wave goes into each output's ``metrics["communication_bytes"]``."""
    from omni_core.distributed import communication_stats

    return communication_stats()["total"]




class _Control:
    """StepControl of the request path: abort flags (agreed across ranks) and progress callbacks."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def stopped(self, request_ids: list[str]) -> set[str]:
        self.runner.flush_progress(due_only=True)  # earlier steps' events, one message for the whole batch
        return lane_clock(self.runner.clock).excluded(self.runner.agree_stopped, request_ids)

    def on_encoded(self, state: StepState) -> None:
        self.runner.begin_request(state)

    def on_step(self, state: StepState) -> None:
        if self.runner.on_progress is not None:
            event: tuple = (state.request_id, state.step_index, state.num_steps)
            if self.runner.pipeline.previews_in_request_mode and self.runner.config.streaming_output \
                    and state.request.stream_previews and state.request.wants_preview(state.step_index,
                                                                                      state.num_steps):
                event += (self.runner.pipeline.preview(state),)  # streamed by the engine with the progress
            with self.runner.progress_lock:
                self.runner.progress.append(event)


class ModelRunner(WeightOps, RankAgreement):
    def __init__(self, config: Any, resolved: ResolvedModel, *, device: Any, dtype: Any, rank: int = 0,
                 world_size: int = 1, on_progress: Callable[[list[tuple[str, int, int]]], None] | None = None,
                 poll_aborts: Callable[[], list[str]] | None = None, stop_group: tuple[Any, int, int] | None = None,
                 progress_interval_s: float = 0.0, recovery: Any = None, seal: Any = None) -> None:
        self.config = config
        self.resolved = resolved
        self.device = device
        self.dtype = dtype
        self.rank = rank
        self.world_size = world_size
        #: request path: called with the ``(request_id, step, num_steps)`` events of the whole batch since the
        #: last call: after every step, or at most every ``progress_interval_s`` (and at the end of the wave)
        #: where each call is a message to another process
        self.on_progress = on_progress
        self.progress_interval_s = progress_interval_s
        self.progress: list[tuple[str, int, int]] = []
        self.progress_lock = threading.Lock()
        #: held while a flush is delivered, so lanes' events reach listeners in step order
        self._flush_lock = threading.Lock()
        self._last_flush = float("-inf")  # the first events go at once (monotonic time may start near 0)
        #: how a wave of several requests is split across the CPU cores (set up in ``load_model``)
        self.lanes = CpuLanes(1, enabled=False)
        self.poll_aborts = poll_aborts
        #: (process group, source rank, size) in which stop decisions are agreed: this data-parallel replica
        self.stop_group = stop_group or (None, 0, world_size)
        #: aborts and rebuilds the process groups when a rank fails mid-step (``omni_core.distributed.recovery``;
        #: None: failures are agreed on the groups as they are, which a peer blocked in a collective never joins)
        self.recovery = recovery
        #: how what this rank hands another process is sealed (``omni_core.worker.transport.SealMode``; None:
        #: shared memory, on this host; the Ray executor hands its ranks refs into Ray's object store)
        self.seal = seal
        self.pipeline: Any = None
        self.cache_backend: Any = None
        self.model_bytes: dict[str, int] = {}
        self.states: dict[str, StepState] = {}
        self._abort_ids: set[str] = set()
        self._abort_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._in_flight: set[str] = set()
        #: request id -> the highest wave peak (MiB) of the step waves it has run in so far (step path)
        self._request_peak: dict[str, float] = {}
        #: pipeline time of the current wave (``RunnerOutput.metrics``; see ``omni_core.worker.timing``)
        self.clock = WaveClock()

    # ------------------------------------------------------------------ setup
    def load_model(self) -> None:
        from omni_core.worker.stage_contract import DECODE, stages_apart

        #: the stages in processes of their own (encode_workers / decode_workers): this process loads the rest;
        #: with the decode apart, finished requests go back as decode payloads
        self.stages_apart = stages_apart(self.config)
        self.pipeline = load_pipeline(self.resolved, self.config, self.device, self.dtype,
                                      stage="denoise" if self.stages_apart else None)
        if DECODE in self.stages_apart:
            from omni_core.worker.stage_contract import defer_decode

            # both modes: post_decode_batch hands back sealed DecodePayloads (sealed as the executor said: ``seal``)
            defer_decode(self.pipeline, mode=self.seal)
        if self.config.batch_invariant:  # each request alone in every computation (omni_core.worker.batch_invariant)
            from omni_core.worker.batch_invariant import make_batch_invariant

            make_batch_invariant(self.pipeline, self.device)
        self.pipeline.denoise_step = self.clock.wrap_denoise(self.pipeline.denoise_step)
        from omni_core.pipelines.embedding_cache import embedding_cache_snapshot

        self.clock.sources.append(embedding_cache_snapshot(self.pipeline))  # stats()["embedding_cache"]
        from omni_core.worker.instrument import instrument_denoisers  # (imports diffusers: not at module level)

        instrument_denoisers(self.pipeline, self.clock)  # denoiser calls and time: 'instrument'-stage hooks
        from omni_core.platforms.threads import ContentionGauge, threads_per_process

        # the budget drops to one thread while the CPU is contended, unless the user fixed it (cpu_threads)
        gauge = (ContentionGauge() if self.config.cpu_threads is None
                 and getattr(self.device, "type", str(self.device)) == "cpu" else None)
        self.lanes = CpuLanes(threads_per_process(self.config, self.world_size),
                              enabled=lanes_allowed(self.config, self.pipeline, self.device), gauge=gauge)
        from omni_core.plugins.availability import check_component

        name = self.config.cache_backend
        av = check_component("cache", name)  # "none" too: a built-in backend that caches nothing
        if not av.ok:
            from omni_core.errors import ComponentUnavailableError

            raise ComponentUnavailableError(f"cache backend {name!r} cannot run here: {av.reason}") from av.error
        self.cache_backend = av.cls(self.config.cache_config)
        self.cache_backend.enable(self.pipeline)
        from omni_core.lora.manager import LoraManager  # LoRA adapters per request: diffusers-based pipelines

        self.lora = LoraManager(self.pipeline, self.config) if LoraManager.serves(self.pipeline) else None
        if self.lora is not None:
            self.lora.preload()
        from omni_core.optimize.components import model_bytes

        #: {component: bytes} of this rank's model after quantization (``stats()["model_bytes"]``)
        self.model_bytes = model_bytes(self.pipeline)
        if self.stages_apart:  # the split stages' config-only stand-ins hold nothing
            from omni_core.worker.stage_contract import model_bytes_of_stage

            self.model_bytes = model_bytes_of_stage(self.pipeline)

    def new_state(self, request: OmniDiffusionRequest) -> StepState:
        import torch

        from omni_core.worker.transport import Sealed

        if isinstance(request.text_encodings, Sealed):  # the encode stage's, opened here only (never in the engine)
            request.text_encodings = request.text_encodings.open()

        gen = torch.Generator(device=self.device).manual_seed(request.seed)
        if request.sampling_params.lora is not None and getattr(self, "lora", None) is not None:
            self.lora.acquire(request)  # pinned until _forget
        return StepState(request=request, generator=gen)

    # ------------------------------------------------------------------ aborts
    def abort(self, request_ids: list[str]) -> None:
        """Mark requests to stop at the next step boundary (thread-safe; may arrive just before their wave)."""
        with self._abort_lock:
            self._abort_ids.update(request_ids)

    def _forget(self, request_id: str) -> None:
        if getattr(self, "lora", None) is not None:
            self.lora.release(request_id)
        self.states.pop(request_id, None)
        self._request_peak.pop(request_id, None)
        self._in_flight.discard(request_id)
        with self._abort_lock:
            self._abort_ids.discard(request_id)

    def describe(self) -> dict[str, Any]:
        """This rank as the engine sees it through a collective call (``engine.collective_rpc("describe")``): its
        rank, process, device, the requests it holds and its model's bytes per component."""
        import os

        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "device": str(self.device),
                "held_ids": sorted(self.held_ids()), "model_bytes": dict(self.model_bytes)}

    def held_ids(self) -> set[str]:
        return set(self.states) | set(self._in_flight)

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._forget(rid)

    # ------------------------------------------------------------------ request path
    def _finish_output(self, state: StepState, out: DiffusionOutput, extra: dict) -> DiffusionOutput:
        out.request_id = state.request_id
        if out.rollout is None and state.sampling_params.rollout is not None:
            from omni_core.pipelines.rollout import rollout_output

            out.rollout = rollout_output(state)
        out.metrics.update(extra, **compile_metrics(self.pipeline))  # compile=True: it ran (multi-rank runs too)
        out.metrics.setdefault("num_steps", state.step_index)
        out.metrics["seed"] = state.request.seed
        # the peak of this wave (reset at its start) and of the earlier waves the request ran in
        out.metrics["peak_memory_mb"] = max(self._request_peak.pop(state.request_id, 0.0), self._peak_memory_mb())
        if self.cache_backend is not None:
            out.metrics.update(self.cache_backend.request_metrics(state))
        return out

    def _peak_memory_mb(self) -> float:
        from omni_core.platforms import platform_for

        try:
            return round(platform_for(self.config).peak_memory_bytes(self.device) / 2**20, 1)
        except Exception:  # noqa: BLE001 - a platform that cannot tell reports 0, never fails a request
            return 0.0

    def _reset_peak_memory(self) -> None:
        """A new wave: the platform's peak starts again (``peak_memory_mb`` is per request, not per process)."""
        from omni_core.platforms import platform_for

        try:
            platform_for(self.config).reset_peak_memory(self.device)
        except Exception:  # noqa: BLE001 - as _peak_memory_mb: never fails a wave
            pass

    def begin_request(self, state: StepState) -> None:
        if self.cache_backend is not None:
            self.cache_backend.begin_request(state)

    def execute_batch(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        import torch

        self.clock.take()  # nothing left over from a wave that raised
        self._reset_peak_memory()
        self.release(sched.finished_ids)
        reqs = sched.new_requests
        batch_ids = {r.request_id for r in reqs}
        with self._abort_lock:
            self._abort_ids &= batch_ids  # stale aborts of requests that already ended
        self._in_flight.update(batch_ids)
        t0, sent0 = time.perf_counter(), sent_bytes()
        outputs: dict[str, DiffusionOutput] = {}
        try:
            with torch.inference_mode():
                states = [self.new_state(r) for r in reqs]
                fresh: dict[str, StepState] = {}  # the state of each request's own retry

                def alone(state: StepState) -> DiffusionOutput:
                    fresh[state.request_id] = st = self.new_state(state.request)  # the same noise as batched
                    return self._forward([st])[0]

                def failed(state: StepState, exc: Exception) -> DiffusionOutput:
                    if len(states) == 1:
                        raise exc  # a lone request fails as the whole wave does (below)
                    return error_output(state.request_id, exc, fresh.get(state.request_id))

                outs = self.clock.timed(lambda: batched_then_one_by_one(
                    states, lambda batch: self.lanes.map(self._forward, batch, self.clock), alone, failed,
                    what="forward"))
                for r, out in zip(reqs, outs):
                    outputs[r.request_id] = out
        except Exception as exc:  # noqa: BLE001
            logger.debug("request failed", exc_info=True)
            for r in reqs:
                outputs[r.request_id] = error_output(r.request_id, exc)
        elapsed, sent = time.perf_counter() - t0, sent_bytes() - sent0
        for r in reqs:
            outputs[r.request_id].metrics.update({"execution_time_s": elapsed, "batch_size": len(reqs),
                                                  "communication_bytes": sent})
            self._forget(r.request_id)
        return RunnerOutput(outputs=outputs, held_ids=self.held_ids(), metrics=self.clock.take())

    def _forward(self, states: list[StepState]) -> list[DiffusionOutput]:
        try:
            outs = self._agreed(lambda batch: self.pipeline.forward(batch, _Control(self)), states)
        finally:
            self.flush_progress()  # the last step's events, before the outputs
        return [self._finish_output(s, o, {}) for s, o in zip(states, outs)]

    def flush_progress(self, due_only: bool = False) -> None:
        """Send the queued progress events; with ``due_only``, only once ``progress_interval_s`` has passed
        since the last send (the end of a wave always sends)."""
        with self._flush_lock:
            now = time.monotonic()
            if due_only and now - self._last_flush < self.progress_interval_s:
                return
            with self.progress_lock:
                events, self.progress = self.progress, []
            if events:
                self._last_flush = now
                lane_clock(self.clock).excluded(self.on_progress, events)

    # ------------------------------------------------------------------ step path
    def skip_step(self, sched: DiffusionSchedulerOutput, replacement: DiffusionSchedulerOutput) -> RunnerOutput:
        """A wave whose step is skipped because ``replacement``, queued behind it, replaces it
        (``DiffusionSchedulerOutput.replaces_queued``): its ended requests are released and its new ones
        encoded, since the replacement was scheduled as if this one had run; nobody takes a step. What the
        replacement ends is released now too, so the engine can end those requests a step sooner."""
        import torch

        self.clock.take()
        self.release(sched.finished_ids)
        outputs: dict[str, DiffusionOutput] = {}
        with torch.inference_mode():
            self.clock.timed(self._encode_new, sched.new_requests, outputs)
            self._agree_failures([r.request_id for r in sched.new_requests], outputs)
        self.release(replacement.finished_ids)
        return RunnerOutput(outputs=outputs, held_ids=self.held_ids(), metrics=self.clock.take(), skipped=True)

    def execute_step(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        import torch

        self.clock.take()  # nothing left over from a wave that raised
        self._reset_peak_memory()
        self.release(sched.finished_ids)
        outputs: dict[str, DiffusionOutput] = {}
        timed = self.clock.timed
        t0, sent0 = time.perf_counter(), sent_bytes()
        with torch.inference_mode():
            timed(self._encode_new, sched.new_requests, outputs)
            self._agree_failures([r.request_id for r in sched.new_requests], outputs)  # same batch on every rank
            active = [self.states[r] for r in sched.scheduled_ids if r in self.states and not self.states[r].done]
            preds = timed(self._denoise, active, outputs)
            for state, pred in preds:
                try:
                    timed(self.pipeline.step_scheduler, state, pred)
                except Exception as exc:  # noqa: BLE001
                    outputs[state.request_id] = error_output(state.request_id, exc, state)
                    self._forget(state.request_id)
            elapsed, sent = time.perf_counter() - t0, sent_bytes() - sent0
            wave = {"step_time_s": elapsed, "communication_bytes": sent, "batch_size": len(active)}
            finished = [self.states[r] for r in sched.scheduled_ids
                        if r in self.states and r not in outputs and self.states[r].done]
            decoded = timed(self._decode_finished, finished)
            for rid in sched.scheduled_ids:
                state = self.states.get(rid)
                if state is None or rid in outputs:
                    continue
                previews = (self.config.streaming_output and state.request.stream_previews
                            and state.request.wants_preview(state.step_index, state.num_steps))
                if state.done:
                    try:
                        result = decoded[rid]
                        if isinstance(result, Exception):  # its own decode raised
                            raise result
                        out = self._finish_output(state, result, {})
                        if previews:  # the last step's preview; the engine streams it first
                            out.preview = self.pipeline.preview(state)
                    except Exception as exc:  # noqa: BLE001
                        out = error_output(rid, exc, state)
                    self._forget(rid)
                else:
                    out = DiffusionOutput(request_id=rid, finished=False,
                                          preview=self.pipeline.preview(state) if previews else None,
                                          step_index=state.step_index, num_steps=state.num_steps)
                out.metrics.update(wave)
                outputs[rid] = out
            self._agree_failures(list(sched.scheduled_ids), outputs)
            if self.states:  # the requests that go on keep this wave's peak for their final output
                peak = self._peak_memory_mb()
                for rid in sched.scheduled_ids:
                    if rid in self.states:
                        self._request_peak[rid] = max(self._request_peak.get(rid, 0.0), peak)
        return RunnerOutput(outputs=outputs, held_ids=self.held_ids(), metrics=self.clock.take())

    def _encode_new(self, requests: list[OmniDiffusionRequest], outputs: dict[str, DiffusionOutput]) -> None:
        """``prepare_encode`` of the wave's new requests, split across the CPU lanes as the request path's
        ``forward`` is (a request's text encoding and scheduler set-up is a cost batching does not shrink: run
        one after another on the wave's thread it was ~5% of a step-mode wave of 8 ``shapes`` requests); each
        lane encodes its share inside one ``encoded_prompts`` window (their prompts may share a text-encoder
        call). A request that fails fails alone."""
        states = [self.new_state(r) for r in requests]
        if not states:
            return
        results = self.lanes.map(self._encode_states, states, self.clock)
        for state, result in zip(states, results):
            try:
                if isinstance(result, Exception):
                    raise result
                self.begin_request(result)
                self.states[result.request_id] = result
            except Exception as exc:  # noqa: BLE001
                outputs[state.request_id] = error_output(state.request_id, exc, state)

    def _encode_states(self, states: list[StepState]) -> list[Any]:
        """``prepare_encode`` of ``states`` in one ``encoded_prompts`` window: each state's result, or the
        exception its encoding raised."""
        try:
            window = self.pipeline.encoded_prompts(states)
            window.__enter__()
        except Exception:  # noqa: BLE001 - the shared encoding failed: each request encodes its own below
            logger.warning("batched prompt encoding failed; encoding request by request", exc_info=True)
            window = None
        results: list[Any] = []
        try:
            for state in states:
                try:
                    results.append(self.pipeline.prepare_encode(state) or state)
                except Exception as exc:  # noqa: BLE001
                    results.append(exc)
        finally:
            if window is not None:
                window.__exit__(None, None, None)
        return results

    def _decode_finished(self, states: list[StepState]) -> dict[str, Any]:
        """``post_decode`` of the requests that finished in this wave, batched; a failing batch is retried
        request by request, and a request whose decode raises gets the exception as its result."""
        results = batched_then_one_by_one(states, self.pipeline.post_decode_batch, self.pipeline.post_decode,
                                          lambda state, exc: exc, what="post_decode")
        return {s.request_id: r for s, r in zip(states, results)}

    def _denoise(self, active: list[StepState], outputs: dict[str, DiffusionOutput]) -> list[tuple[StepState, Any]]:
        if not active:
            return []

        def failed(state: StepState, exc: Exception) -> None:
            outputs[state.request_id] = error_output(state.request_id, exc, state)
            self._forget(state.request_id)

        # each attempt is agreed by the ranks: all retry one by one, or none does (an error on one rank only)
        preds = batched_then_one_by_one(
            active, lambda batch: self._agreed(lambda b: self.lanes.map(self.pipeline.denoise_step, b, self.clock),
                                               batch),
            lambda state: self._agreed(lambda st: self.pipeline.denoise_step([st])[0], state), failed,
            what="denoise_step")
        return [(state, pred) for state, pred in zip(active, preds) if state.request_id not in outputs]
