"""``FleetMember``: one model of a :class:`~omni_core.engine.fleet.ModelFleet` as an ``EngineClient``.

Front ends (the HTTP server, ``Omni``) serve a fleet's model exactly as they serve one engine: every call that
needs the model on the device takes a lease on it for the call's duration (bringing it in first), and what needs
no model (its description, its limits, validating a request) is answered from its plan, so a bad request is
refused before any model moves. Requests are validated before the lease, so none loads a model only to fail.
"""

from __future__ import annotations

from typing import Any

from omni_core.engine.admission import RequestChecker
from omni_core.engine.model_info import ModelInfo, ProgressFn


class FleetMember:
    """The engine client of one served model (see the module docstring)."""

    def __init__(self, fleet: Any, name: str) -> None:
        self.fleet, self.name = fleet, name
        self._slot = fleet.slot(name)
        self._checker = RequestChecker(self._slot.plan)

    @property
    def model_info(self) -> ModelInfo:
        return self._slot.plan.model_info

    @property
    def limits(self) -> Any:
        return self._slot.plan.limits

    @property
    def config(self) -> Any:
        """The model's engine config (the server reads its preloaded LoRA names from it)."""
        return self._slot.plan.config

    def prepare_request(self, request: Any) -> Any:
        return self._checker.prepare(request)

    def submit(self, requests: list, *, on_progress: ProgressFn | None = None) -> list:
        checked = [self._checker.checked(r) for r in requests]  # refused before the model moves
        with self.fleet.lease(self.name) as engine:
            return engine.submit(checked, on_progress=on_progress)

    def abort(self, request_id: str | list[str]) -> None:
        engine = self._slot.engine
        if engine is not None:
            engine.abort(request_id)

    def weight_call(self, method: str, args: tuple = (), kwargs: dict | None = None, *, in_flight: str = "finish",
                    timeout: float | None = None) -> list[Any]:
        with self.fleet.lease(self.name) as engine:
            return engine.weight_call(method, args, kwargs, in_flight=in_flight, timeout=timeout)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        with self.fleet.lease(self.name) as engine:
            return engine.collective_rpc(method, args, kwargs, timeout)

    def release_memory(self, *, in_flight: str = "finish") -> list[Any]:
        """Evict the model to host copies now (the fleet's own eviction, so its state stays true)."""
        before = self._slot.weight_bytes
        return [before if self.fleet.evict(self.name) else 0]

    def resume_memory(self) -> list[Any]:
        """Bring the model onto the device (as its next request would)."""
        with self.fleet.lease(self.name):
            return [self._slot.weight_bytes]

    def stats(self) -> dict[str, Any]:
        engine = self._slot.engine
        if engine is not None:
            try:
                return {**engine.stats(), "residency": self._slot.state}
            except Exception:  # noqa: BLE001 - closed meanwhile: answered as not loaded
                pass
        return {"waiting": 0, "running": 0, "tracked_requests": [], "dead": self.dead_reason,
                "execution_mode": self._slot.plan.mode.mode.value, "requests_added": 0, "requests_completed": 0,
                "requests_aborted": 0, "requests_failed": 0, "denoise_steps": 0, "residency": self._slot.state}

    @property
    def is_dead(self) -> bool:
        """Its engine died (until the next request restarts it, or for good with ``restart="never"``)."""
        engine = self._slot.engine
        return self._slot.state == "dead" or (engine is not None and engine.is_dead)

    @property
    def dead_reason(self) -> str | None:
        engine = self._slot.engine
        if engine is not None and engine.is_dead:
            return engine.dead_reason
        return self._slot.dead_reason if self._slot.state == "dead" else None

    def close(self) -> None:
        """The fleet owns the engines (``ModelFleet.close``)."""


__all__ = ["FleetMember"]
