"""The engine's side of the decode stage (``decode_workers``, :mod:`omni_core.worker.stages`).

A request that finished denoising waits here for its decode, its record still in the engine's table so abort,
deadlines and close find it; the decode process's outputs are delivered as the in-line decode's would be. Kept
apart from the engine so that the engine stays one loop and one table, whatever stages there are.
"""

from __future__ import annotations

from typing import Any

from omni_core.outputs import DiffusionOutput
from omni_core.sched.interface import DiffusionRequestStatus as Status


class DecodeLink:
    """Requests waiting for the decode process, and the process's outputs on their way to the engine."""

    def __init__(self, engine: Any) -> None:
        from omni_core.worker.stages import start_decode_stage

        self.engine = engine
        #: request id -> the runner's output (its tensor a DecodePayload), until the decode comes back
        self.waiting: dict[str, DiffusionOutput] = {}
        self._groups: dict[Any, list] = {}
        self.stage = start_decode_stage(engine.config, engine.resolved, self._on_decoded, self._on_dead)

    @classmethod
    def start(cls, engine: Any) -> DecodeLink | None:
        """The link for ``engine``'s config (None without a decode stage); a stage that fails to start shuts
        the model processes down too."""
        try:
            link = cls(engine)
        except BaseException:
            engine.executor.shutdown()
            raise
        return link if link.stage is not None else None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def hold(self, request_id: str, out: DiffusionOutput) -> None:
        """A request that finished denoising (engine lock held); sent by :meth:`flush` after the wave, one message
        per group the runner's decode call made."""
        self.waiting[request_id] = out
        self._groups.setdefault(out.tensor.group, []).append(out.tensor)

    def flush(self) -> None:
        for payloads in self._groups.values():
            self.stage.submit(payloads)
        self._groups = {}

    def drop(self, request_id: str) -> DiffusionOutput | None:
        """Abort a request waiting for its decode (engine lock held): the stage forgets it; its aborted output."""
        pending = self.waiting.pop(request_id, None)
        if pending is None:
            return None
        self.stage.abort([request_id])
        return DiffusionOutput(request_id=request_id, status=Status.FINISHED_ABORTED, step_index=pending.step_index,
                               num_steps=pending.num_steps, metrics=dict(pending.metrics))

    def _on_decoded(self, outputs: dict[str, DiffusionOutput]) -> None:
        """The decode stage's outputs (its reader thread): its metrics the runner's plus the decode's
        (``peak_memory_mb``: the higher of the two processes)."""
        engine = self.engine
        with engine._lock:
            for rid, out in outputs.items():
                pending = self.waiting.pop(rid, None)
                if pending is None or rid not in engine._records:
                    continue  # aborted (or timed out) while it waited
                peak = max(pending.metrics.get("peak_memory_mb", 0.0), out.metrics.get("decode_peak_memory_mb", 0.0))
                out.metrics = {**pending.metrics, **out.metrics, "peak_memory_mb": peak}
                out.preview = pending.preview
                engine._finalize(rid, out)

    def _on_dead(self, reason: str) -> None:
        """The decode process died: the engine dies with a reason naming the stage, failing every request."""
        engine = self.engine
        with engine._lock:
            engine._die(f"the engine is dead: {reason}")
            engine._wake.notify_all()

    def stats(self) -> dict[str, Any]:
        """``stats()["stages"]``: the decode process, what it holds and does."""
        stage = self.stage
        return {"stages": {"decode": {"pid": stage.pid(), "model_bytes": dict(stage.model_bytes),
                                      "waiting": len(self.waiting), "decoded": stage.decoded, "dead": stage.dead}}}

    def shutdown(self) -> None:
        self.stage.shutdown()


__all__ = ["DecodeLink"]
