"""``mp``: one worker process per rank, started from Omni's fork server (:mod:`omni_core.processes`), over
``torch.distributed``.

Waves go to every rank once through per-rank queues; results come from rank 0. Tensors travel through
shared memory (``torch.multiprocessing`` queues move tensor storage to shared memory instead of pickling
the bytes). The processes are a :class:`~omni_core.executor.process_group.ProcessGroup`: its watcher notices a
dead worker at once (waits then fail with ``EngineDeadError``), its ``stop`` escalates from a polite message to
terminate and kill, so no child outlives the executor, and a worker dies with the engine's process if that is
killed (``omni_core.processes.parent_watch``). An executor that places the same worker loop elsewhere subclasses
this one and returns its own group from :meth:`MultiProcExecutor.process_group` (the Ray plugin).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from typing import Any

from omni_core.errors import EngineDeadError
from omni_core.executor.base import DiffusionExecutor
from omni_core.executor.process_group import LocalProcessGroup, ProcessGroup
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput
from omni_core.worker.transport import unpack_outputs
from omni_core.worker.timing import merge_wave_timings

logger = logging.getLogger("omni_core.executor")


#: what a worker's death during start-up usually means
START_HINT = ("see its traceback above. Workers import the caller's main module as spawn does: a script that creates "
              "the engine at module level must guard it with `if __name__ == '__main__':`")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiProcExecutor(DiffusionExecutor):
    #: why the executor gave up on its processes itself (a collective call nobody answered), or None
    _dead: str | None = None

    def start(self) -> None:
        from omni_core.distributed.parallel_state import RankLayout

        self.world_size = self.config.world_size
        #: ranks of each data-parallel replica; a replica runs its own share of the requests
        self.replicas = RankLayout.from_config(self.config.parallel_config).replicas()
        self._replica_of_rank = {r: i for i, ranks in enumerate(self.replicas) for r in ranks}
        self._assigned: dict[str, int] = {}
        self._dead: str | None = None
        self.group = self.process_group()
        try:
            self.group.spawn()
            ready = self.group.wait_ready(self.config.worker_start_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._model_bytes = ready[0] or {}  # rank 0 reports its model's bytes per component

    def process_group(self) -> ProcessGroup:
        """The executor's processes, one per rank, running the worker loop (:mod:`omni_core.worker.mp_worker`);
        an executor that places them elsewhere returns its own :class:`ProcessGroup` (the Ray plugin does)."""
        from omni_core.worker.mp_worker import worker_main
        from omni_core.processes import child_environment

        port, world, parent, env = free_port(), self.world_size, os.getpid(), child_environment()
        config, resolved = self.config, self.resolved

        def args_for(rank: int, task_q: Any, result_q: Any, abort_q: Any) -> tuple:
            return (rank, world, config, resolved, port, task_q, result_q, abort_q, parent, env)

        # the group's queues are SimpleQueues: a put pickles and writes at once, where a Queue hands the message to
        # a feeder thread first (a thread wake-up per message: 230 vs 360-570 us per wave round trip measured on 2
        # cores); messages stay small (tensors travel in shared memory)
        return LocalProcessGroup("worker", worker_main, args_for, [f"omni-worker-{r}" for r in range(world)],
                                 start_hint=START_HINT)

    # ------------------------------------------------------------------ calls
    def _send(self, replica: int, msg: tuple) -> None:
        if not self.is_alive():
            raise EngineDeadError(self.death_reason)
        for rank in self.replicas[replica]:
            self.group.send(rank, msg)

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

    def _peer_death(self) -> str | None:
        """A peer's death surfaces first as a failed collective on the leader: the death, if there is one."""
        reason = self.group.wait_death(timeout=1.0)
        if reason is not None and self._dead is None:
            self._dead = f"the engine is dead: worker {reason}"
            logger.error("%s", self._dead)
        return self._dead

    def _wait_result(self) -> RunnerOutput:
        while True:
            if not self.is_alive():
                raise EngineDeadError(self.death_reason)
            try:
                msg = self.group.receive(timeout=0.2)
            except queue.Empty:
                continue
            kind = msg[0]
            if kind == "progress":
                if self.on_progress is not None:
                    for event in msg[1]:  # one message per denoising step: the batch's events
                        self.on_progress(*event)
            elif kind == "result":
                result = unpack_outputs(msg[2])
                if any(o.status == "error" for o in result.outputs.values()) and self._peer_death():
                    raise EngineDeadError(self._dead)  # a failed collective looked like a request error
                return result
            elif kind == "error":
                if self._peer_death():
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
        if not self.is_alive():
            return
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:  # the loop's thread, while the call thread may be updating ``_assigned``
            replica = self._assigned.get(rid)
            for i in ([replica] if replica is not None else range(len(self.replicas))):
                by_replica.setdefault(i, []).append(rid)
        for i, ids in by_replica.items():
            self.group.send_abort(self.replicas[i][0], ids)  # the replica's leader polls aborts each step

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """Every rank runs ``method`` and answers (``("called", rank, ok, value)``); a rank that does not answer
        within ``timeout`` leaves the model processes in an unknown state: the engine dies naming it."""
        from omni_core.executor.collective import DEFAULT_TIMEOUT_S, check_method, gathered

        check_method(method)
        if not self.is_alive():
            raise EngineDeadError(self.death_reason)
        for rank in range(self.world_size):
            self.group.send(rank, ("call", (method, tuple(args), dict(kwargs or {}))))
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)
        while len(answers) < self.world_size:
            if not self.is_alive():
                raise EngineDeadError(self.death_reason)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(answers))
                self._dead = (f"the engine is dead: rank(s) {missing} did not answer the collective call {method!r} "
                              f"within {timeout if timeout is not None else DEFAULT_TIMEOUT_S:g} s")
                raise EngineDeadError(self._dead)
            try:
                msg = self.group.receive(timeout=0.2)
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
        group = getattr(self, "group", None)
        return self._dead is None and (group is None or group.dead is None)

    @property
    def death_reason(self) -> str | None:
        if self._dead is not None:
            return self._dead
        group = getattr(self, "group", None)
        return f"the engine is dead: worker {group.dead}" if group is not None and group.dead else None

    def worker_pids(self) -> list[int]:
        group = getattr(self, "group", None)
        return group.pids() if group is not None else []

    def shutdown(self) -> None:
        group = getattr(self, "group", None)
        if group is not None:
            group.stop()
