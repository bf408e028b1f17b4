"""Abort and rebuild a replica's process groups when one rank fails in the middle of a step (issue #36).

A rank that raises *before* a collective its peers are already blocked in (an out-of-memory error in attention
before the Ulysses all-to-all, in one cfg branch before the all-gather) leaves them waiting there; agreeing on
the failure with one more collective cannot work, since they never reach it. So the failing rank

1. marks the failure in the store (``omni/failed/<generation>``), then
2. aborts every process group of this process and drops every reference to them: gloo closes a group's
   connections only when its ``ProcessGroupGloo`` is freed (``abort()``/``shutdown()`` do not, measured on
   torch 2.13), and a peer blocked in a collective then fails at once with "Connection closed by peer";
   NCCL's ``abort()`` (``ncclCommAbort``) ends the failing rank's communicators, and a watcher thread on each
   peer (:class:`GroupRecovery` with a non-gloo backend) sees the mark and aborts its own, which ends the
   collective it is blocked in;
3. re-creates the default group on the same TCPStore under a fresh prefix (``omni/gen<N>``) and the parallel
   subgroups with the same code as start-up (:func:`~omni_core.distributed.parallel_state.rebuild_parallel_state`),
   re-using the ``GroupCoordinator`` objects model code holds.

Every peer does the same once its collective fails (the mark tells it it is a victim, not the culprit); then
the ranks agree on the failure over the new group as before (``ModelRunner.sync_failure``), fail the wave's
requests together and serve the next one. Only a replica that is the whole world (no data parallelism) can
rebuild the default group by itself; with several replicas the runner keeps the plain agreement.
"""

from __future__ import annotations

import datetime
import gc
import logging
import threading
import time
import traceback
from typing import Any, Callable

logger = logging.getLogger("omni_core.distributed")

#: store key (under the start-up store) a failing rank sets before it aborts generation ``N``'s groups
FAILED_KEY = "omni/failed/{}"
#: store prefix of generation ``N``'s default group (generation 0 is start-up's own)
GENERATION_PREFIX = "omni/gen{}"


class GroupRecovery:
    """One process's means to abort and rebuild its process groups; create it right after
    ``init_parallel_state`` (it captures the default group's store, backend, rank and size).

    ``on_rebuilt`` callbacks run after each rebuild (a caller's own groups)."""

    def __init__(self, timeout: datetime.timedelta | float, *, watch: bool | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
        self.backend = dist.get_backend()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        #: the start-up TCPStore (kept: rank 0's server lives as long as this); marks and new generations'
        #: groups go under keys of their own on it
        self.store = _tcp_store(c10d._get_default_store())
        self.generation = 0
        self.rebuilds = 0
        #: the generation this rank marked a failure in (its watcher leaves that one to the main thread)
        self._marked = -1
        self.on_rebuilt: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        # gloo: the failing rank closing its connections fails every blocked peer; a device backend needs each
        # peer to abort its own communicators (a kernel waiting for a peer that left never returns by itself)
        if self.backend != "gloo" if watch is None else watch:
            self._watcher = threading.Thread(target=self._watch, name="omni-group-watch", daemon=True)
            self._watcher.start()

    # ------------------------------------------------------------------ failure mark
    def _key(self, generation: int | None = None) -> str:
        return FAILED_KEY.format(self.generation if generation is None else generation)

    def peer_failed(self) -> bool:
        """Whether a rank marked a failure in the current generation (so a collective error here is a
        victim's: that rank aborted the groups)."""
        try:
            return self.store.check([self._key()])
        except Exception:  # noqa: BLE001 - no store: nobody could have marked anything
            logger.warning("could not read the failure mark from the store", exc_info=True)
            return False

    def mark_failed(self) -> None:
        self._marked = self.generation
        self.store.set(self._key(), str(self.rank))

    # ------------------------------------------------------------------ abort and rebuild
    def abort(self, exc: BaseException | None = None) -> None:
        """Abort every process group of this process and drop this process's references to them (the
        parallel state's coordinators keep their place; their groups are None until :meth:`rebuild`).
        ``exc``'s finished frames are cleared: a frame's local holding a group would keep it alive (and a
        gloo group's connections open, so peers would wait for the timeout)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        from omni_core.distributed.parallel_state import drop_parallel_groups

        if exc is not None:
            traceback.clear_frames(exc.__traceback__)
        old = list(c10d._world.pg_names) if dist.is_initialized() else []
        drop_parallel_groups()
        with self._lock:
            if dist.is_initialized():
                try:
                    c10d._abort_process_group()  # every group, the default one last; clears torch's registry
                except Exception:  # noqa: BLE001 - a backend without abort: destroy is the next best
                    logger.warning("aborting the process groups failed; destroying them", exc_info=True)
                    try:
                        dist.destroy_process_group()
                    except Exception:  # noqa: BLE001
                        logger.warning("destroying the process groups failed", exc_info=True)
        _scrub_function_defaults(old)
        gc.collect()  # a group caught in a reference cycle is freed now, not at some later collection
        import sys

        # each group now has 3 references left here: ``old``, the loop's ``pg`` and getrefcount's argument
        kept = [sys.getrefcount(pg) - 3 for pg in old]
        if any(kept):
            logger.warning("rank %d: %d reference(s) to the aborted process groups remain; a gloo peer blocked in "
                           "a collective waits for the timeout", self.rank, sum(kept))
        del old

    def rebuild(self) -> None:
        """Create the default group of generation ``N+1`` on the start-up store and every parallel subgroup,
        as start-up did; every rank of the world must call this (it is a rendezvous)."""
        import torch.distributed as dist

        from omni_core.distributed.parallel_state import rebuild_parallel_state

        t0 = time.monotonic()
        with self._lock:
            self.generation += 1
            store = dist.PrefixStore(GENERATION_PREFIX.format(self.generation), self.store)
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=self.timeout)
        rebuild_parallel_state()
        for fn in self.on_rebuilt:
            fn()
        self.rebuilds += 1
        logger.warning("rank %d rebuilt its process groups (generation %d) in %.2f s", self.rank, self.generation,
                       time.monotonic() - t0)

    def recover(self, exc: BaseException | None, *, own: bool) -> None:
        """Abort and rebuild after ``exc``; ``own``: this rank's own failure (it marks it for its peers first)."""
        if own:
            try:
                self.mark_failed()
            except Exception:  # noqa: BLE001 - peers then learn of it from the closed connections alone
                logger.warning("could not mark the failure in the store", exc_info=True)
        self.abort(exc)
        self.rebuild()

    # ------------------------------------------------------------------ device backends
    def _watch(self) -> None:
        """Abort this process's communicators as soon as a peer marks a failure in the current generation:
        the collective this rank is blocked in then ends (ncclCommAbort), and the main thread's error takes it
        to :meth:`recover`. Uses a store connection of its own, so a blocking call of the main thread's never
        waits behind it. Not run under gloo, and not yet run on real devices (docs/gpu.md)."""
        import torch.distributed as dist

        try:
            store = _own_client(self.store, self.timeout)
        except Exception:  # noqa: BLE001
            logger.warning("failure watcher: no store connection of its own; peers fail only by timeout",
                           exc_info=True)
            return
        seen = -1
        while not self._stop.wait(0.05):
            generation = self.generation
            if generation in (seen, self._marked):
                continue
            try:
                if not store.check([self._key(generation)]):
                    continue
            except Exception:  # noqa: BLE001 - the store is gone: the process is shutting down
                return
            seen = generation
            with self._lock:
                if generation != self.generation or not dist.is_initialized():
                    continue
                from torch.distributed import distributed_c10d as c10d

                logger.warning("rank %d: a peer marked a failure; aborting this rank's process groups", self.rank)
                for pg in list(c10d._world.pg_names):
                    try:
                        pg.abort()  # ends this rank's side only; the main thread cleans up in abort()
                    except Exception:  # noqa: BLE001
                        logger.warning("failure watcher: aborting a group failed", exc_info=True)

    def close(self) -> None:
        self._stop.set()


def _scrub_function_defaults(groups: list) -> None:
    """Replace the aborted ``groups`` in every Python function's default arguments with None (the default
    group, rebuilt). A library imported after ``init_process_group`` that declares ``group=dist.group.WORLD``
    holds the group in its defaults for good (torchao 0.18 does, in ten functions, imported with diffusers), and
    on gloo that keeps the group's connections open."""
    import types

    if not groups:
        return
    ids = {id(pg) for pg in groups}
    for obj in gc.get_objects():
        if not isinstance(obj, types.FunctionType):
            continue
        defaults = obj.__defaults__
        if defaults and any(id(d) in ids for d in defaults):
            obj.__defaults__ = tuple(None if id(d) in ids else d for d in defaults)
        kw = obj.__kwdefaults__
        if kw and any(id(v) in ids for v in kw.values()):
            obj.__kwdefaults__ = {k: None if id(v) in ids else v for k, v in kw.items()}


def _tcp_store(store: Any) -> Any:
    """The TCPStore under ``store`` (PrefixStores unwrapped), or ``store`` itself if there is none."""
    import torch.distributed as dist

    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    return base if isinstance(base, dist.TCPStore) else store


def _own_client(store: Any, timeout: datetime.timedelta) -> Any:
    """A new client connection to the TCPStore ``store`` (``store`` itself if it is no TCPStore)."""
    import torch.distributed as dist

    if not isinstance(store, dist.TCPStore):
        return store
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout)
