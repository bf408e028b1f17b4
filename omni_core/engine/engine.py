"""DiffusionEngine: the engine's front; its state lives in one :class:`~omni_core.engine.core.EngineCore`.

The engine runs a finished :class:`~omni_core.engine.plan.EnginePlan` (``plan_engine``: every check of the config
happened there). Callers validate in their own thread (``prepare_request``, ``submit``), then hand the checked
requests to the core's loop, which alone owns the scheduler, the one per-request table and the waves; they read
outputs through the returned handles from any thread or asyncio loop. Abort, consumer cancellation and deadlines
travel the other way: the core ends the request, the runner stops it within one denoising step (both modes).
"""

from __future__ import annotations

import logging
from typing import Any

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.engine import warmup
from omni_core.engine.core import EngineCore
from omni_core.engine.handle import RequestHandle
from omni_core.engine.model_info import ModelInfo, ProgressFn
from omni_core.engine.modes import DiffusionExecutionMode
from omni_core.engine.plan import EnginePlan, plan_engine
from omni_core.engine.records import RequestRecord
from omni_core.engine.admission import RequestChecker
from omni_core.engine.weight_sync import WeightGate
from omni_core.errors import QueueFullError
from omni_core.request import OmniDiffusionRequest

logger = logging.getLogger("omni_core.engine")

__all__ = ["DiffusionEngine", "DiffusionExecutionMode", "QueueFullError", "RequestRecord", "make_engine"]

#: how long ``close`` waits for the loop to finish the waves in flight before it shuts the executor down
CLOSE_JOIN_S = 35.0


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
        #: validates each request once, in the caller's thread (``submit`` re-checks only what was replaced since)
        self._checker = RequestChecker(plan)
        #: holds submissions while weights change or the model's memory is released (omni_core.engine.weight_sync)
        self.weights = WeightGate()
        self._core = EngineCore(plan, scheduler=scheduler, executor=executor)
        self.scheduler, self.executor = self._core.scheduler, self._core.executor
        self._closed = False
        self._core.start()

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
        return self.admit([self._checker.checked(r) for r in requests], on_progress)

    def admit(self, requests: list[OmniDiffusionRequest], on_progress: ProgressFn | None = None
              ) -> list[RequestHandle]:
        """Queue requests that were checked already (``submit`` checks; the start-up warm-up builds its own)."""
        self.weights.admit()  # waits while weights change; refused while the model's memory is released
        return self._core.call(self._core.admit, list(requests), on_progress)

    # ------------------------------------------------------------------ abort
    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: a waiting one ends now, a running one within one denoising step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._core.post(self._core.abort, ids)

    # ------------------------------------------------------------------ the model processes
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run the model runner's public method ``method`` on every rank, between waves (new waves wait, the ones in
        flight finish first); one result per rank, in rank order. A failure on any rank raises
        ``CollectiveCallError`` naming the ranks; a rank silent past ``timeout`` (default 300 s) kills the engine
        (:mod:`omni_core.executor.collective`). The one way engine-level operations reach the model process."""
        from omni_core.executor.collective import check_method

        check_method(method)  # in the caller's thread, before anything pauses
        core = self._core
        return core.call(core.begin_collective, method, tuple(args), dict(kwargs or {}), timeout).result()

    def weight_call(self, method: str, args: tuple = (), kwargs: dict | None = None, *, in_flight: str = "finish",
                    timeout: float | None = None) -> list[Any]:
        """A weight operation of the model runner (``omni_core.worker.weights``) on every rank, once the requests
        held have finished (``in_flight="finish"``) or been aborted (``"abort"``); submissions wait meanwhile."""
        core = self._core
        return self.weights.run(lambda: self.collective_rpc(method, args, kwargs, timeout),
                                request_ids=lambda: core.call(core.request_ids), abort=self.abort,
                                in_flight=in_flight, timeout=timeout)

    def release_memory(self, *, in_flight: str = "finish") -> list[Any]:
        """Free the model's memory on every rank (weights kept on the host) once the held requests are done; the
        gate refuses submissions from now until :meth:`resume_memory`. One result per rank (bytes released)."""
        self.weights.released = True  # from now on a submission is refused, never run on released tensors
        try:
            return self.weight_call("release_memory", in_flight=in_flight)
        except BaseException:
            self.weights.released = False
            raise

    def resume_memory(self) -> list[Any]:
        """Put the model back on every rank, then reopen the gate. One result per rank (bytes restored)."""
        restored = self.collective_rpc("resume_memory")
        self.weights.released = False  # only once every rank has its tensors back
        return restored

    # ------------------------------------------------------------------ state
    @property
    def execution_mode(self) -> DiffusionExecutionMode:
        return self.mode.mode

    @property
    def model_info(self) -> ModelInfo:
        return self.plan.model_info

    @property
    def is_dead(self) -> bool:
        return self._core.dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._core.dead

    @property
    def counters(self) -> dict[str, int]:
        """The engine's counters, as the loop last wrote them (``stats()`` reads them with the rest, consistently)."""
        return dict(self._core.counters)

    def wave_timing(self) -> dict[str, float]:
        """Where the loop's time went, summed since start (:func:`omni_core.engine.records.timing_summary`)."""
        return self._core.call(self._core.wave_timing)

    def stats(self) -> dict[str, Any]:
        return self._core.call(self._core.stats)

    def close(self) -> None:
        """Abort what is left, stop the loop, shut the executor down. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        core = self._core
        core.call(core.begin_close)
        if not core.join(CLOSE_JOIN_S):
            logger.warning("the engine's loop did not stop within %s s of close; shutting the executor down", CLOSE_JOIN_S)
        self.executor.shutdown()
        self.executor.close_calls()
        core.stages.shutdown()
        core.join(5)


def make_engine(config: EnginePlan | OmniDiffusionConfig, **kwargs: Any) -> DiffusionEngine:
    return DiffusionEngine.make_engine(config, **kwargs)
