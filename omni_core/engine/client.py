"""The engine client interface: the only engine API the HTTP server, ``Omni`` and ``AsyncOmni`` use.

``EngineClient`` is what a front end may rely on: submit requests (all validated before any is queued)
and read them through :class:`~omni_core.engine.handle.RequestHandle`, abort, read ``stats()`` (counters
included), learn whether the engine died and why, close it, and describe the served model
(:class:`ModelInfo`, ``limits``) without touching the pipeline class, the resolved spec or the config.
``DiffusionEngine`` implements it in process; ``start_engine`` builds one. Another engine (remote, a test
double) implements the same few members.

    engine = start_engine(OmniDiffusionConfig(model="shapes"))
    (handle,) = engine.submit([OmniDiffusionRequest(prompt="a red circle")])
    out = handle.result()
    engine.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from omni_core.engine.model_info import ModelInfo, ProgressFn

if TYPE_CHECKING:
    from omni_core.config import OmniDiffusionConfig, RequestLimits
    from omni_core.engine.handle import RequestHandle
    from omni_core.engine.plan import EnginePlan
    from omni_core.request import OmniDiffusionRequest


@runtime_checkable
class EngineClient(Protocol):
    """The narrow engine API of front ends (see the module docstring)."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def limits(self) -> RequestLimits:
        """The resolved per-request limits every request is checked against."""
        ...

    def prepare_request(self, request: OmniDiffusionRequest) -> OmniDiffusionRequest:
        """Validate and complete a request (model defaults, a seed) without queuing it; raises ConfigError."""
        ...

    def submit(self, requests: list[OmniDiffusionRequest], *, on_progress: ProgressFn | None = None
               ) -> list[RequestHandle]:
        """Validate every request, then queue all of them or none (ConfigError, QueueFullError,
        EngineDeadError, OmniError when closed); one handle per request, in order."""
        ...

    def abort(self, request_id: str | list[str]) -> None:
        """A waiting request ends at once, a running one within one denoising step; unknown ids are ignored."""
        ...

    def weight_call(self, method: str, args: tuple = (), kwargs: dict | None = None, *, in_flight: str = "finish",
                    timeout: float | None = None) -> list[Any]:
        """A weight operation on every rank once the held requests finished or were aborted (``in_flight``)."""
        ...

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """The model runner's public ``method`` on every rank, between waves; one result per rank."""
        ...

    def release_memory(self, *, in_flight: str = "finish") -> list[Any]:
        """Free the model's memory on every rank; submissions are refused until ``resume_memory``."""
        ...

    def resume_memory(self) -> list[Any]:
        """Put the model back on every rank and accept submissions again."""
        ...

    def stats(self) -> dict[str, Any]:
        """``waiting``, ``running``, ``tracked_requests``, ``execution_mode``, ``dead`` and the counters
        (``requests_added``/``_completed``/``_aborted``/``_failed``, ``denoise_steps``)."""
        ...

    @property
    def is_dead(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine died (``the engine is dead: ...``), None while it lives."""
        ...

    def close(self) -> None:
        """Abort what is left and shut down; safe to call twice."""
        ...


def start_engine(config: OmniDiffusionConfig | EnginePlan, **kwargs: Any) -> EngineClient:
    """Build the in-process engine for ``config`` (or a plan made of it, ``plan_engine``) and run its start-up
    warm-up (``config.warmup``)."""
    from omni_core.engine.engine import DiffusionEngine

    return DiffusionEngine.make_engine(config, **kwargs)


def start_fleet(config: Any, **kwargs: Any) -> Any:
    """Several models behind one front end (``omni_core.config.fleet.FleetConfig``): a ``ModelFleet`` whose
    ``members()`` are one ``EngineClient`` per model, each brought onto the device by its requests within the
    residency budget; ``states()`` says where each model is; ``close()`` closes them all. Pinned models load now,
    and so, once, does a model whose size its files do not tell (to measure it)."""
    from omni_core.engine.fleet import ModelFleet

    fleet = ModelFleet(config, **kwargs)
    try:
        fleet.measure_unknown()
        fleet.load_pinned()
    except BaseException:
        fleet.close()
        raise
    return fleet
