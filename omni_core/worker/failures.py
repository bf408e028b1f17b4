"""How a failure stays with what caused it: a request whose part of a batch raises fails alone
(:func:`batched_then_one_by_one`, :func:`error_output`), and the ranks of a replica fail a call together
(:class:`RankAgreement`, :class:`PeerFailure`) so none goes on with collectives its peers have left."""

from __future__ import annotations

import logging
from typing import Any, Callable

from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.state import StepState
from omni_core.utils.tracebacks import innermost_frame

logger = logging.getLogger("omni_core.worker")


def error_output(request_id: str, exc: BaseException | str, state: StepState | None = None) -> DiffusionOutput:
    """A failed request's output; ``metrics["error_frame"]`` says where it was raised (the traceback stays
    in the worker, so without it a warm-up failure could not point at the failing line)."""
    msg = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    out = DiffusionOutput(request_id=request_id, finished=True, status="error", error=msg,
                          step_index=state.step_index if state else 0, num_steps=state.num_steps if state else 0)
    frame = None if isinstance(exc, str) else innermost_frame(exc)
    if frame:
        out.metrics["error_frame"] = frame
    if not isinstance(exc, str) and is_out_of_memory(exc):
        out.metrics["out_of_memory"] = True  # the engine counts it; health says degraded until a request completes
    return out


def is_out_of_memory(exc: BaseException) -> bool:
    """An out-of-memory error: torch's on any accelerator (``torch.OutOfMemoryError``, which
    ``torch.cuda.OutOfMemoryError`` is), the host's ``MemoryError``, or a peer rank's (:class:`PeerFailure`)."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or bool(getattr(exc, "out_of_memory", False)))


class PeerFailure(RuntimeError):
    """Raised on every rank of a replica whose peer failed the same call: the ranks fail it together and stay
    in step (the failing rank raises its own exception; its peers raise this one, naming it and, for an
    out-of-memory error, the cause: what a client is told comes from the leader, which may be such a peer)."""

    def __init__(self, rank: int, out_of_memory: bool = False) -> None:
        cause = "ran out of memory in" if out_of_memory else "failed"
        super().__init__(f"rank {rank} of this replica {cause} the same call (its error is in that rank's log); "
                         f"every rank fails it together")
        self.rank = rank
        self.out_of_memory = out_of_memory


def failure_code(rank: int, failed: bool | BaseException, out_of_memory: bool = False) -> int:
    """One integer per rank for an all-reduce MAX: 0 (no failure), else ``(rank + 1) * 2 + out_of_memory``, so
    the highest failing rank wins and its cause travels with it (:func:`peer_failure` reads it back). ``failed``
    may be the exception itself (its cause is read from it)."""
    if failed is False or failed is None:
        return 0
    out_of_memory = out_of_memory or (isinstance(failed, BaseException) and is_out_of_memory(failed))
    return (rank + 1) * 2 + int(out_of_memory)


def peer_failure(code: int) -> PeerFailure | None:
    """The failure an all-reduced :func:`failure_code` names, or None."""
    return PeerFailure(code // 2 - 1, bool(code % 2)) if code else None


class RankAgreement:
    """The rank-agreement part of :class:`~omni_core.worker.runner.ModelRunner` (see its module docstring): it
    uses the runner's ``rank``, ``device``, ``stop_group``, ``recovery``, ``poll_aborts``, abort ids and
    ``_forget``."""

    def agree_stopped(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` to stop; the replica's leader decides and its ranks learn the same answer.
        A step boundary is also a failure sync point: a peer that failed since the last one raises here."""
        peer = self.sync_failure(False)
        if peer is not None:
            raise peer
        if self.poll_aborts is not None:
            with self._poll_lock:  # lanes ask at once; one of them drains the queue
                polled = self.poll_aborts()
            with self._abort_lock:
                self._abort_ids.update(r for r in polled if r in self._in_flight)
        with self._abort_lock:
            flags = [rid in self._abort_ids for rid in request_ids]
        return {rid for rid, f in zip(request_ids, self.agree(flags)) if f}

    def agree(self, flags: list[bool]) -> list[bool]:
        """The replica leader's ``flags``, on every rank of the replica (a broadcast where it has several)."""
        group, src, size = self.stop_group
        if size <= 1 or not flags:
            return flags
        import torch
        import torch.distributed as dist

        # gloo broadcasts host tensors; a device backend (nccl, hccl) only the device's own
        device = "cpu" if dist.get_backend(group) == "gloo" else self.device
        t = torch.tensor(flags, dtype=torch.uint8, device=device)
        dist.broadcast(t, src=src, group=group)
        return [bool(x) for x in t.tolist()]

    def sync_failure(self, failed: bool | BaseException) -> PeerFailure | None:
        """The failure of the highest rank of the replica that failed since the last sync point (this one if
        ``failed``: True or its exception, whose cause is shared), or None: an all-reduce of one
        :func:`failure_code` where the replica has several ranks. Every rank meets the
        same sync points -- each step boundary of the request path, the end of each forward or denoise attempt
        -- and a rank that fails goes straight to its next one, so its peers learn of the failure there instead
        of waiting in a collective it has left (for a timeout that tears every rank down)."""
        group, _, size = self.stop_group
        if size <= 1:
            return peer_failure(failure_code(self.rank, failed))
        import torch
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(group) == "gloo" else self.device
        t = torch.tensor([failure_code(self.rank, failed)], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return peer_failure(int(t.item()))

    def _agreed(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """``fn(arg)``, failing on every rank of the replica if it fails on any (:meth:`sync_failure`)."""
        try:
            out = fn(arg)
        except PeerFailure:
            raise  # agreed already, at a sync point inside ``fn``
        except Exception as exc:
            if self.stop_group[2] > 1:
                if self.recovery is not None:
                    self._recover(exc)  # raises PeerFailure where a peer's failure aborted this rank's collective
                else:
                    logger.error("rank %d failed; its peers fail the call with it", self.rank, exc_info=True)
                    self.sync_failure(exc)
            raise
        try:
            peer = self.sync_failure(False)
        except Exception as exc:
            if self.recovery is None or self.stop_group[2] <= 1:
                raise
            self._recover(exc)  # a peer failed after this rank's last collective and aborted the groups
            raise
        if peer is not None:
            raise peer
        return out

    def _recover(self, exc: Exception) -> None:
        """After ``exc`` on this rank: abort and rebuild the process groups on every rank of the replica
        (:class:`~omni_core.distributed.recovery.GroupRecovery`), then agree on the failure over the new groups.
        ``exc`` is this rank's own failure unless a peer marked one first (then ``exc`` is the collective the
        peer's abort ended here, and this raises :class:`PeerFailure` naming it); returns when it is this
        rank's own, for the caller to re-raise."""
        own = not self.recovery.peer_failed()
        if own:
            logger.error("rank %d failed; it aborts the process groups and its peers fail the call with it",
                         self.rank, exc_info=True)
        else:
            logger.warning("rank %d: a peer failed this call and aborted the process groups (here: %s: %s)",
                           self.rank, type(exc).__name__, exc)
        self.recovery.recover(exc, own=own)
        peer = self.sync_failure(exc if own else False)
        if not own:
            raise (peer if peer is not None else PeerFailure(-1)) from None

    def _agree_failures(self, request_ids: list[str], outputs: dict[str, DiffusionOutput]) -> None:
        """Step path: a request that failed on any rank of the replica (in ``outputs`` as an error) fails on all
        of them, so no rank keeps a state its peers dropped. One all-reduce of a flag per request."""
        group, _, size = self.stop_group
        if size <= 1 or not request_ids:
            return
        import torch
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(group) == "gloo" else self.device
        failed = [outputs[rid] if rid in outputs and outputs[rid].status == "error" else None for rid in request_ids]
        mine = [failure_code(self.rank, out is not None, out is not None and bool(out.metrics.get("out_of_memory")))
                for out in failed]
        t = torch.tensor(mine, dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        for rid, value, own in zip(request_ids, t.tolist(), mine):
            if value and not own:
                outputs[rid] = error_output(rid, peer_failure(value), self.states.get(rid))
                self._forget(rid)


def batched_then_one_by_one(items: list, batched: Callable[[list], list], alone: Callable[[Any], Any],
                            failed: Callable[[Any, Exception], Any], *, what: str) -> list:
    """``batched(items)``; if that raises, ``alone(item)`` for each item, so an exception fails only the
    item that causes it (``failed(item, exc)`` gives its result). A single item is not run twice: it fails
    at once. One result per item, in order."""
    try:
        return list(batched(items))
    except Exception as exc:  # noqa: BLE001 - find the culprit(s), keep the others
        if len(items) == 1:
            return [failed(items[0], exc)]
        logger.warning("batched %s failed; retrying the %d requests one by one", what, len(items), exc_info=True)
    results = []
    for item in items:
        try:
            results.append(alone(item))
        except Exception as exc:  # noqa: BLE001
            results.append(failed(item, exc))
    return results
