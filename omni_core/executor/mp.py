"""``mp``: one worker process per rank, started from Omni's fork server (:mod:`omni_core.worker.processes`), over
``torch.distributed``.

Waves go to every rank once through per-rank queues; results come from rank 0. Tensors travel through
shared memory (``torch.multiprocessing`` queues move tensor storage to shared memory instead of pickling
the bytes). A monitor thread notices a dead worker at once; waits then fail with ``EngineDeadError``.
Shutdown escalates from a polite message to terminate and kill, so no child outlives the executor, and a
worker dies with the engine's process if that is killed (``omni_core.worker.parent_watch``).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import socket
import threading
import time
import weakref
from typing import Any

from omni_core.errors import EngineDeadError
from omni_core.executor.base import DiffusionExecutor
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.worker.transport import unpack_outputs
from omni_core.worker.timing import merge_wave_timings

logger = logging.getLogger("omni_core.executor")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2)


class MultiProcExecutor(DiffusionExecutor):
    def start(self) -> None:
        from omni_core.worker.mp_worker import worker_main
        from omni_core.worker.processes import child_environment, process_context

        from omni_core.distributed.parallel_state import RankLayout

        self.world_size = self.config.world_size
        #: ranks of each data-parallel replica; a replica runs its own share of the requests
        self.replicas = RankLayout.from_config(self.config.parallel_config).replicas()
        self._replica_of_rank = {r: i for i, ranks in enumerate(self.replicas) for r in ranks}
        self._assigned: dict[str, int] = {}
        ctx = process_context()
        self._closing = False
        self._dead: str | None = None
        # SimpleQueues: a put pickles and writes at once, where a Queue hands the message to a feeder thread
        # first (a thread wake-up per message: 230 vs 360-570 us per wave round trip measured on 2 cores).
        # Messages stay small (tensors travel in shared memory) and every wave's result is read before the
        # next is sent, so a writer never waits long on a full pipe.
        self.task_qs = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self.result_q = ctx.SimpleQueue()
        # aborts may come in bulk (close() aborts every tracked request) while no worker reads them: a
        # Queue's feeder thread never blocks the caller; they are not on the per-step path
        self.abort_qs = [ctx.Queue() for _ in self.replicas]
        port = free_port()
        self.procs = [ctx.Process(target=worker_main, name=f"omni-worker-{rank}", daemon=True,
                                  args=(rank, self.world_size, self.config, self.resolved, port, self.task_qs[rank],
                                        self.result_q, self.abort_qs[self._replica_of_rank[rank]], os.getpid(),
                                        child_environment()))
                      for rank in range(self.world_size)]
        # Workers die with their parent *thread* (PR_SET_PDEATHSIG), so the monitor, which lives until every
        # worker has exited, starts them -- not the caller's thread, which may end first (a thread pool's).
        started: queue.SimpleQueue = queue.SimpleQueue()
        self._monitor = threading.Thread(target=self._start_and_watch, args=(started,), name="omni-worker-monitor",
                                         daemon=True)
        self._monitor.start()
        error = started.get()
        self._finalizer = weakref.finalize(self, _kill_all, list(self.procs))
        try:
            if error is not None:
                raise error
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.config.worker_start_timeout
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                raise EngineDeadError(f"workers did not load the model within {self.config.worker_start_timeout} s "
                                      f"(ready ranks: {sorted(ready)})")
            try:
                msg = self._get_result(timeout=0.2)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise EngineDeadError(
                        f"worker {dead[0].name} exited with code {dead[0].exitcode} during start-up (see its "
                        f"traceback above). Workers import the caller's main module as spawn does: a script that "
                        f"creates the engine at module level must guard it with `if __name__ == '__main__':`")
                continue
            if msg[0] == "ready":
                ready.add(msg[1])
                if len(msg) > 2 and msg[1] == 0:  # rank 0 reports its model's bytes per component
                    self._model_bytes = msg[2]
            elif msg[0] == "fatal":
                raise EngineDeadError(f"worker rank {msg[1]} failed to start:\n{msg[2]}")

    def _start_and_watch(self, started: queue.SimpleQueue) -> None:
        """Start the workers, then watch them until all have exited; the first death (not during shutdown)
        marks the engine dead."""
        try:
            for p in self.procs:
                p.start()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            started.put(exc)
            return
        started.put(None)
        alive = {p.sentinel: p for p in self.procs}
        while alive:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.5):
                p = alive.pop(sentinel)
                if not self._closing:
                    self._mark_dead(p)

    def _mark_dead(self, p: Any) -> None:
        p.join(0.1)
        if self._dead is None:
            self._dead = f"the engine is dead: worker {p.name} (pid {p.pid}) exited with code {p.exitcode}"
            logger.error("%s", self._dead)

    def _dead_worker(self, timeout: float) -> Any:
        """A worker that has exited (waiting up to ``timeout`` for one), or None."""
        done = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=timeout)
        return next((p for p in self.procs if p.sentinel in done), None)

    # ------------------------------------------------------------------ calls
    def _send(self, replica: int, msg: tuple) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)
        for rank in self.replicas[replica]:
            self.task_qs[rank].put(msg)

    def _split(self, sched: DiffusionSchedulerOutput) -> dict[int, DiffusionSchedulerOutput]:
        """One sub-wave per data-parallel replica; a request stays on the replica it was given."""
        if len(self.replicas) == 1:
            return {0: sched}
        load = [0] * len(self.replicas)
        for rid in sched.scheduled_ids:
            if rid in self._assigned:
                load[self._assigned[rid]] += 1
        for req in sched.new_requests:
            replica = min(range(len(load)), key=lambda i: (load[i], i))
            self._assigned[req.request_id] = replica
            load[replica] += 1
        parts = {}
        for i in range(len(self.replicas)):
            ids = [r for r in sched.scheduled_ids if self._assigned.get(r) == i]
            finished = [r for r in sched.finished_ids if self._assigned.get(r, i) == i]
            if ids or finished:
                parts[i] = DiffusionSchedulerOutput(
                    new_requests=[q for q in sched.new_requests if self._assigned[q.request_id] == i],
                    scheduled_ids=ids, finished_ids=finished, batch_key=sched.batch_key)
        for rid in sched.finished_ids:
            self._assigned.pop(rid, None)
        return parts

    def _run(self, kind: str, parts: dict[int, Any]) -> RunnerOutput:
        for replica, payload in parts.items():
            self._send(replica, (kind, payload))
        return self._collect(len(parts))

    def _collect(self, n_parts: int) -> RunnerOutput:
        """The next ``n_parts`` results (one wave's parts) merged."""
        merged = RunnerOutput(skipped=n_parts > 0)
        timings = []
        for _ in range(n_parts):
            out = self._wait_result()
            merged.outputs.update(out.outputs)
            merged.held_ids |= out.held_ids
            merged.skipped &= out.skipped
            timings.append(out.metrics)
        merged.metrics = merge_wave_timings(timings)
        for rid, o in merged.outputs.items():
            if o.finished:
                self._assigned.pop(rid, None)
        return merged

    def _get_result(self, timeout: float, ranks: Any = None) -> tuple:
        """The next message from the workers, or ``queue.Empty`` after ``timeout`` s (the executor's call thread
        is the only reader; every rank writes to the one queue, so ``ranks`` needs no filter here)."""
        if not self.result_q._reader.poll(timeout):
            raise queue.Empty
        return self.result_q.get()

    def _wait_result(self) -> RunnerOutput:
        while True:
            if self._dead:
                raise EngineDeadError(self._dead)
            try:
                msg = self._get_result(timeout=0.2)
            except queue.Empty:
                continue
            kind = msg[0]
            if kind == "progress":
                if self.on_progress is not None:
                    for event in msg[1]:  # one message per denoising step: the batch's events
                        self.on_progress(*event)
            elif kind == "result":
                result = unpack_outputs(msg[2])
                if any(o.status == "error" for o in result.outputs.values()):
                    # a failed collective (a peer died) looks like a request error on the leader
                    dead = self._dead_worker(timeout=1.0)
                    if dead is not None:
                        self._mark_dead(dead)
                        raise EngineDeadError(self._dead)
                return result
            elif kind == "error":
                # a peer's death surfaces first as a failed collective on the leader: report the death
                dead = self._dead_worker(timeout=1.0)
                if dead is not None:
                    self._mark_dead(dead)
                    raise EngineDeadError(self._dead)
                raise RuntimeError(f"worker replica {msg[1]} failed to run the wave:\n{msg[2]}")
            elif kind == "fatal":
                self._dead = f"the engine is dead: worker rank {msg[1]} failed:\n{msg[2]}"

    def execute_batch(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return self._run("batch", self._split(sched))

    def execute_step(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return self._run("step", self._split(sched))

    @property
    def step_pipeline_depth(self) -> int:
        """Two step waves in flight with one replica (a worker runs its queue in order; the next wave waits
        in the pipe while the current one runs); data-parallel replicas answer in any order: one."""
        return 2 if len(self.replicas) == 1 else 1

    def send_step(self, sched: DiffusionSchedulerOutput) -> None:
        self._send(0, ("step", sched))

    def recv_step(self) -> RunnerOutput:
        return self._collect(1)

    def abort(self, request_ids: list[str]) -> None:
        if self._dead:
            return
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:  # the loop's thread, while the call thread may be updating ``_assigned``
            replica = self._assigned.get(rid)
            for i in ([replica] if replica is not None else range(len(self.replicas))):
                by_replica.setdefault(i, []).append(rid)
        for i, ids in by_replica.items():
            self.abort_qs[i].put(ids)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """Every rank runs ``method`` and answers (``("called", rank, ok, value)``); a rank that does not answer
        within ``timeout`` leaves the model processes in an unknown state: the engine dies naming it."""
        from omni_core.executor.collective import DEFAULT_TIMEOUT_S, check_method, gathered

        check_method(method)
        if self._dead:
            raise EngineDeadError(self._dead)
        for q in self.task_qs:
            q.put(("call", (method, tuple(args), dict(kwargs or {}))))
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)
        while len(answers) < self.world_size:
            if self._dead:
                raise EngineDeadError(self._dead)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(answers))
                self._dead = (f"the engine is dead: rank(s) {missing} did not answer the collective call {method!r} "
                              f"within {timeout if timeout is not None else DEFAULT_TIMEOUT_S:g} s")
                raise EngineDeadError(self._dead)
            try:
                msg = self._get_result(timeout=0.2, ranks=range(self.world_size))
            except queue.Empty:
                continue
            if msg[0] == "called":
                answers[msg[1]] = (msg[2], msg[3])
            elif msg[0] == "fatal":
                self._dead = f"the engine is dead: worker rank {msg[1]} failed:\n{msg[2]}"
        return gathered(method, answers, self.world_size)

    def release(self, request_ids: list[str]) -> set[str]:
        parts = {i: list(request_ids) for i in range(len(self.replicas))}
        for rid in request_ids:
            self._assigned.pop(rid, None)
        return self._run("release", parts).held_ids

    def is_alive(self) -> bool:
        return self._dead is None

    @property
    def death_reason(self) -> str | None:
        return self._dead

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        self._closing = True
        procs = getattr(self, "procs", [])
        for q in getattr(self, "task_qs", []):
            try:
                q.put(("shutdown",))
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + 5
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill_all(procs)
        for q in [*getattr(self, "task_qs", []), getattr(self, "result_q", None)]:
            if q is not None:
                q.close()
        for q in getattr(self, "abort_qs", []):
            q.cancel_join_thread()
            q.close()
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(5)
