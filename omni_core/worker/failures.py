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
    return out


class PeerFailure(RuntimeError):
    """Raised on every rank of a replica whose peer failed the same call: the ranks fail it together and stay
    in step (the failing rank raises its own exception; its peers raise this one, naming it)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} of this replica failed the same call (its error is in that rank's log); "
                         f"every rank fails it together")
        self.rank = rank


class RankAgreement:
    """The rank-agreement part of :class:`~omni_core.worker.runner.ModelRunner` (see its module docstring): it
    uses the runner's ``rank``, ``device``, ``stop_group``, ``recovery``, ``poll_aborts``, abort ids and
    ``_forget``."""

    def agree_stopped(self, request_ids: list[str]) -> set[str]:
        """Which of ``request_ids`` to stop; the replica's leader decides and its ranks learn the same answer.
        A step boundary is also a failure sync point: a peer that failed since the last one raises here."""
        peer = self.sync_failure(False)
        if peer is not None:
            raise PeerFailure(peer)
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

    def sync_failure(self, failed: bool) -> int | None:
        """The highest rank of the replica that failed since the last sync point (this one if ``failed``), or
        None: an all-reduce of a one-element flag where the replica has several ranks. Every rank meets the
        same sync points -- each step boundary of the request path, the end of each forward or denoise attempt
        -- and a rank that fails goes straight to its next one, so its peers learn of the failure there instead
        of waiting in a collective it has left (for a timeout that tears every rank down)."""
        group, _, size = self.stop_group
        if size <= 1:
            return self.rank if failed else None
        import torch
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(group) == "gloo" else self.device
        t = torch.tensor([self.rank + 1 if failed else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        value = int(t.item())
        return value - 1 if value else None

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
                    self.sync_failure(True)
            raise
        try:
            peer = self.sync_failure(False)
        except Exception as exc:
            if self.recovery is None or self.stop_group[2] <= 1:
                raise
            self._recover(exc)  # a peer failed after this rank's last collective and aborted the groups
            raise
        if peer is not None:
            raise PeerFailure(peer)
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
        peer = self.sync_failure(own)
        if not own:
            raise PeerFailure(peer if peer is not None else -1) from None

    def _agree_failures(self, request_ids: list[str], outputs: dict[str, DiffusionOutput]) -> None:
        """Step path: a request that failed on any rank of the replica (in ``outputs`` as an error) fails on all
        of them, so no rank keeps a state its peers dropped. One all-reduce of a flag per request."""
        group, _, size = self.stop_group
        if size <= 1 or not request_ids:
            return
        import torch
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(group) == "gloo" else self.device
        mine = [self.rank + 1 if rid in outputs and outputs[rid].status == "error" else 0 for rid in request_ids]
        t = torch.tensor(mine, dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        for rid, value, own in zip(request_ids, t.tolist(), mine):
            if value and not own:
                outputs[rid] = error_output(rid, PeerFailure(value - 1), self.states.get(rid))
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
