"""One process abstraction for every process the engine runs: spawn, ready, watch, stop, send, receive.

A :class:`ProcessGroup` is the processes of one executor (its ranks) or of one stage, started together, watched
together and stopped together. The ``mp`` executor and the stage processes use :class:`LocalProcessGroup`
(processes from Omni's fork server on this host, queues through shared memory); an executor plugin that places
processes elsewhere implements the same few methods (the Ray plugin's ``RayProcessGroup``: actors, Ray calls) and
reuses everything above it (``MultiProcExecutor``: waves, replicas, collective calls, death reporting).

The messages are the worker loop's (:mod:`omni_core.worker.mp_worker`): ``("ready", rank, payload)`` and
``("fatal", rank, traceback)`` while starting, then ``("result" | "error", replica, ...)``, ``("progress", events)``
and ``("called", rank, ok, value)``. The group consumes the start-up pair in ``wait_ready``.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

from omni_core.errors import EngineDeadError
from omni_core.processes.segments import remove_segments_of

logger = logging.getLogger("omni_core.executor")

#: ``args_for(rank, task_q, result_q, abort_q)``: the target's arguments for one rank
ArgsFn = Callable[[int, Any, Any, Any], tuple]


class ProcessGroup:
    """The interface (see the module docstring). ``dead`` is why a process died (set once, by the watcher, when
    it was not stopping), None while every process lives; ``on_death(reason)`` is called once then."""

    size: int
    dead: str | None = None
    on_death: Callable[[str], None] | None = None

    def spawn(self) -> None:
        """Start every process; returns at once (they load while the caller does other work)."""
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> list[Any]:
        """Each rank's ready payload, in rank order; ``EngineDeadError`` naming the rank that failed or died."""
        raise NotImplementedError

    def send(self, rank: int, msg: tuple) -> None:
        """A message to one rank, in order with the earlier ones to it."""
        raise NotImplementedError

    def send_abort(self, rank: int, request_ids: list[str]) -> None:
        """Aborts to one rank, on a channel it reads while a wave runs (the rank's leader polls it each step)."""
        raise NotImplementedError

    def receive(self, timeout: float) -> tuple:
        """The next message from any rank; ``queue.Empty`` after ``timeout`` s without one."""
        raise NotImplementedError

    def wait_death(self, timeout: float) -> str | None:
        """Why a process has died (waiting up to ``timeout`` s for it), or None: a failed collective on the leader
        is reported as the death of the peer that caused it."""
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def stop(self) -> None:
        """Ask every process to stop, then force it; nothing outlives this. Safe to call twice."""
        raise NotImplementedError


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(2)


class LocalProcessGroup(ProcessGroup):
    """Processes on this host, started from Omni's fork server (:mod:`omni_core.processes`).

    ``target(*args_for(rank, task_q, result_q, abort_q))`` runs in rank ``rank``'s process, named ``names[rank]``.
    Each rank reads its own task queue, every rank writes to the one result queue; ``abort_q`` is per rank (a
    ``Queue``: bulk aborts never block the sender). With ``on_message`` the watcher thread also reads the result
    queue and hands each message (after start-up) to it; without, ``receive`` reads it in the caller's thread
    (one fewer thread hop per wave). The watcher starts the processes and lives until all have exited, because a
    child dies with the *thread* that started it (``PR_SET_PDEATHSIG``), not the caller's, which may end first.
    ``background_send``: ``send`` never blocks (a thread of the group writes), for messages that may be large.
    ``start_hint``: what a death during start-up usually means, appended to the error.
    """

    def __init__(self, name: str, target: Callable[..., Any], args_for: ArgsFn, names: list[str], *,
                 on_message: Callable[[tuple], None] | None = None, background_send: bool = False,
                 start_hint: str = "see its traceback above") -> None:
        self.name, self.target, self.args_for, self.names = name, target, args_for, list(names)
        self.size = len(names)
        self.on_message = on_message
        self.background_send = background_send
        self.start_hint = start_hint
        self.dead: str | None = None
        self.on_death = None
        self._stopping = False
        self._lock = threading.Lock()
        self._ready_q: queue.SimpleQueue = queue.SimpleQueue()
        self.procs: list[Any] = []

    # ------------------------------------------------------------------ spawn, ready, watch
    def spawn(self) -> None:
        from omni_core.processes import process_context

        ctx = process_context()
        self.task_qs = [ctx.SimpleQueue() for _ in range(self.size)]
        self.result_q = ctx.SimpleQueue()
        self.abort_qs = [ctx.Queue() for _ in range(self.size)]
        self.procs = [ctx.Process(target=self.target, name=self.names[rank], daemon=True,
                                  args=self.args_for(rank, self.task_qs[rank], self.result_q, self.abort_qs[rank]))
                      for rank in range(self.size)]
        self._senders = None
        if self.background_send:
            from omni_core.worker.mp_worker import BackgroundSender

            self._senders = [BackgroundSender(q) for q in self.task_qs]
        started: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._start_and_watch, args=(started,),
                                         name=f"omni-{self.name}-monitor", daemon=True)
        self._watcher.start()
        error = started.get()
        self._finalizer = weakref.finalize(self, _kill_all, list(self.procs))
        if error is not None:
            self.stop()
            raise error

    def _start_and_watch(self, started: queue.SimpleQueue) -> None:
        try:
            if self._stopping:
                raise EngineDeadError(f"the {self.name} was stopped before it started")
            for p in self.procs:
                p.start()
        except BaseException as exc:  # noqa: BLE001 - handed to spawn()
            started.put(exc)
            return
        started.put(None)
        alive = {p.sentinel: p for p in self.procs}
        reader = self.result_q._reader if self.on_message is not None else None
        while alive:
            waitables = list(alive) + ([reader] if reader is not None else [])
            for ready in multiprocessing.connection.wait(waitables, timeout=0.5):
                if ready is reader:
                    if not self._read_one():
                        reader = None
                    continue
                p = alive.pop(ready)
                if reader is not None:  # what it said before it went comes first
                    try:
                        while reader.poll() and self._read_one():
                            pass
                    except OSError:  # closed by a stop that gave up waiting
                        reader = None
                self._died(p)

    def _read_one(self) -> bool:
        try:
            msg = self.result_q.get()
        except Exception:  # noqa: BLE001 - the other end is gone
            return False
        if msg[0] in ("ready", "fatal"):
            self._ready_q.put(msg)
        else:
            try:
                self.on_message(msg)
            except Exception:  # noqa: BLE001 - a delivery bug must not stop the watcher
                logger.exception("delivering a message of the %s failed", self.name)
        return True

    def _died(self, p: Any) -> None:
        p.join(0.1)
        remove_segments_of(p.pid)  # what a kill between create and unlink left (omni_core.processes.segments)
        reason = f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
        self._ready_q.put(("fatal", self.procs.index(p), reason, "died"))  # read only while starting
        with self._lock:
            if self._stopping or self.dead is not None:
                return
            self.dead = reason
        logger.error("%s: %s", self.name, reason)
        if self.on_death is not None:
            self.on_death(reason)

    def wait_ready(self, timeout: float) -> list[Any]:
        payloads: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(payloads) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineDeadError(f"the {self.name} did not load within {timeout} s "
                                      f"(ready ranks: {sorted(payloads)})")
            try:
                msg = self._next_start_message(min(left, 0.2))
            except queue.Empty:
                continue
            if msg[0] == "ready":
                payloads[msg[1]] = msg[2] if len(msg) > 2 else None
            elif msg[0] == "fatal" and len(msg) > 3:  # the watcher saw it die
                raise EngineDeadError(f"{msg[2]} during start-up ({self.start_hint})")
            else:
                raise EngineDeadError(f"{self.names[msg[1]]} failed to start:\n{msg[2]}")
        if self.dead is not None:  # it died right after saying it was ready
            raise EngineDeadError(f"{self.dead} during start-up ({self.start_hint})")
        return [payloads[r] for r in range(self.size)]

    def _next_start_message(self, timeout: float) -> tuple:
        if self.on_message is not None:
            return self._ready_q.get(timeout=timeout)
        try:
            return self.receive(timeout)
        except queue.Empty:
            try:
                return self._ready_q.get_nowait()  # a process that died before it said anything
            except queue.Empty:
                raise queue.Empty from None

    # ------------------------------------------------------------------ send, receive
    def send(self, rank: int, msg: tuple) -> None:
        (self._senders[rank] if self._senders is not None else self.task_qs[rank]).put(msg)

    def send_abort(self, rank: int, request_ids: list[str]) -> None:
        self.abort_qs[rank].put(list(request_ids))

    def receive(self, timeout: float) -> tuple:
        if not self.result_q._reader.poll(timeout):
            raise queue.Empty
        return self.result_q.get()

    def wait_death(self, timeout: float) -> str | None:
        done = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=timeout)
        dead = next((p for p in self.procs if p.sentinel in done), None)
        if dead is None:
            return None
        dead.join(0.1)
        with self._lock:
            if self.dead is None:
                self.dead = f"{dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"
        return self.dead

    def unsent(self) -> int:
        """Messages given to ``send`` and not yet in a process's pipe (``background_send``)."""
        return sum(s.unsent for s in self._senders) if getattr(self, "_senders", None) else 0

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ stop
    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
        procs = self.procs
        started = [p for p in procs if p.pid is not None]
        if started:
            for rank in range(self.size):
                try:
                    self.send(rank, ("shutdown",))
                except Exception:  # noqa: BLE001
                    pass
            for sender in getattr(self, "_senders", None) or ():
                sender.close(timeout=2)
            # a dead group's survivors are often blocked in a collective with the dead rank: they cannot read the
            # shutdown, so they get a moment, not the grace (their segments are removed below either way)
            deadline = time.monotonic() + (min(grace_s, 0.5) if self.dead else grace_s)
            for p in started:
                p.join(max(0.0, deadline - time.monotonic()))
            _kill_all(started)
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(5)  # every process has exited: it returns, and nothing reads a queue closed below
        for p in started:  # a process forced above may have been cut between a segment's creation and unlink
            remove_segments_of(p.pid)
        for q in [*getattr(self, "task_qs", []), getattr(self, "result_q", None)]:
            if q is not None:
                q.close()
        for q in getattr(self, "abort_qs", []):
            q.cancel_join_thread()
            q.close()
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()


__all__ = ["LocalProcessGroup", "ProcessGroup"]
