"""The engine's side of the stages apart (``encode_workers`` / ``decode_workers``, :mod:`omni_core.worker.stages`).

A request waiting for its encode (before it is queued) or its decode (after it finished denoising) waits here,
its record still in the engine's table so abort, deadlines and close find it. Encoded requests are queued as
if they had just arrived (their arrival time is kept, so the scheduler's order is unchanged); decoded outputs
are delivered as the in-line decode's would be. Kept apart from the engine so that the engine stays one loop
and one table, whatever stages there are. The stage processes' readers post their results and deaths to the
engine's loop (``EngineCore.post``), which alone touches these tables.
"""

from __future__ import annotations

from typing import Any

from omni_core.outputs import DiffusionOutput
from omni_core.sched.interface import DiffusionRequestStatus as Status
from omni_core.worker.stage_contract import DECODE, ENCODE


class StageLinks:
    """Requests waiting for a stage process, and the processes' results on their way to the engine. What a request
    waits for lives on its record (``RequestRecord.stage``, ``RequestRecord.decoding``: the one request table);
    here are only the counts and what is to be sent at the next flush."""

    def __init__(self, core: Any) -> None:
        self.core = core
        #: requests waiting for each stage
        self.waiting = {ENCODE: 0, DECODE: 0}
        self._to_encode: list = []
        self._groups: dict[Any, list] = {}
        self.encode = self.decode = None
        try:  # the executor's processes, launched together: each loads while the others and the model do
            self.encode = core.executor.launch_stage(ENCODE, lambda r: core.post(self.encoded, r),
                                                     lambda why: core.post(self.died, why))
            self.decode = core.executor.launch_stage(DECODE, lambda r: core.post(self.decoded, r),
                                                     lambda why: core.post(self.died, why))
        except BaseException:
            self.shutdown()
            raise

    def start_with(self, executor: Any) -> None:
        """Start ``executor`` (the model loads) while the stage processes load, then wait for them; whatever fails,
        what was started is shut down, and a stage's failure raises naming the stage."""
        try:
            executor.start()
        except BaseException:
            self.shutdown()
            raise
        try:
            for process in (self.encode, self.decode):
                if process is not None:
                    process.wait_ready()
        except BaseException:
            self.shutdown()
            executor.shutdown()
            raise

    # ------------------------------------------------------------------ encode
    def admit(self, record: Any) -> bool:
        """Hold a new request for the encode stage; False without one (queue it now). Sent by :meth:`flush`, all of
        one ``submit`` together."""
        if self.encode is None:
            return False
        record.stage = ENCODE
        self.waiting[ENCODE] += 1
        self._to_encode.append(record.request)
        return True

    def encoded(self, result: dict) -> None:
        """The encode stage's results (on the loop): each request queued with its encodings (sealed: opened in the
        model process), or failed."""
        core = self.core
        if result.get("cache") is not None:  # stats()["embedding_cache"] sums it with the model processes'
            core.note_embedding_cache(result["cache"])
        for rid, (kind, value) in result["results"].items():
            record = core.record(rid)
            if record is None or record.stage != ENCODE:
                continue  # aborted (or timed out) while it waited
            self._leave(record)
            if kind == "ok":
                record.request.text_encodings = value
                core.scheduler.add_request(record.request)
            else:
                core.finalize(rid, DiffusionOutput(request_id=rid, status=Status.FINISHED_ERROR, error=value))
        core.steps.send_now()

    # ------------------------------------------------------------------ decode
    def hold(self, record: Any, out: DiffusionOutput) -> None:
        """A request that finished denoising; sent by :meth:`flush` after the wave, one message per group the
        runner's decode call made."""
        record.stage, record.decoding = DECODE, out
        self.waiting[DECODE] += 1
        self._groups.setdefault(out.tensor.meta["group"], []).append(out.tensor)

    def decoded(self, outputs: dict[str, DiffusionOutput]) -> None:
        """The decode stage's outputs (on the loop): its metrics the runner's plus the decode's
        (``peak_memory_mb``: the higher of the two processes)."""
        core = self.core
        for rid, out in outputs.items():
            record = core.record(rid)
            if record is None or record.stage != DECODE:
                continue  # aborted (or timed out) while it waited
            pending = record.decoding
            self._leave(record)
            peak = max(pending.metrics.get("peak_memory_mb", 0.0), out.metrics.get("decode_peak_memory_mb", 0.0))
            # no preview to carry over: step mode delivers a request's previews before it waits for its decode
            out.metrics = {**pending.metrics, **out.metrics, "peak_memory_mb": peak}
            if out.rollout is None:  # a rollout's record is the model process's (part of what the caller gets)
                out.rollout = pending.rollout
            core.finalize(rid, out)

    # ------------------------------------------------------------------ both
    def _leave(self, record: Any) -> None:
        self.waiting[record.stage] -= 1
        record.stage, record.decoding = None, None

    def flush(self) -> None:
        """Send what was held since the last flush."""
        if self._to_encode:
            self.encode.submit(self._to_encode)
            self._to_encode = []
        for payloads in self._groups.values():
            self.decode.submit(payloads)
        self._groups = {}

    def drop(self, record: Any) -> DiffusionOutput | None:
        """End a request waiting for a stage: the stage forgets it; its aborted output (None when it waits for
        none)."""
        rid, stage, pending = record.request.request_id, record.stage, record.decoding
        if stage is None:
            return None
        self._leave(record)
        if stage == ENCODE:
            if record.request in self._to_encode:
                self._to_encode.remove(record.request)
            else:
                self.encode.abort([rid])
            return DiffusionOutput(request_id=rid, status=Status.FINISHED_ABORTED)
        self.decode.abort([rid])
        return DiffusionOutput(request_id=rid, status=Status.FINISHED_ABORTED, step_index=pending.step_index,
                               num_steps=pending.num_steps, metrics=dict(pending.metrics))

    def clear(self) -> None:
        """Forget every waiting request (their records are finalized by the caller: death or close)."""
        self.waiting = {ENCODE: 0, DECODE: 0}
        self._to_encode = []
        self._groups = {}

    def died(self, reason: str) -> None:
        """A stage's process died (on the loop): the engine dies with a reason naming the stage."""
        self.core.die(f"the engine is dead: {reason}")

    def stats(self) -> dict[str, Any]:
        """``stats()["stages"]``: each stage process, what it holds and does (nothing when all run in line)."""
        stages = {}
        for name, process in ((ENCODE, self.encode), (DECODE, self.decode)):
            if process is not None:
                stages[name] = {"pid": process.pid(), "device": process.device, "model_bytes": dict(process.model_bytes),
                                "waiting": self.waiting[name], "unsent": process.unsent, "done": process.done,
                                "dead": process.dead}
        return {"stages": stages} if stages else {}

    def shutdown(self) -> None:
        self.core.executor.stop_stages()


__all__ = ["StageLinks"]
