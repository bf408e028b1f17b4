"""The Ray actor that holds one rank (or one stage, :class:`StageActor`): a thin bridge between Ray calls and the
``mp`` worker loop (the stage loop).

Why a bridge and not actor methods that run waves: the worker loop (``omni_core.worker.mp_worker.run_worker``)
reads waves from a queue, polls aborts at step boundaries and streams progress while a wave runs. Running that
same loop in a thread of a threaded actor, with local queues that the actor's methods feed and drain, keeps one
copy of the worker code for both executors. Calls may run out of order in a threaded actor, so waves carry a
sequence number and ``put`` hands them to the loop in order.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from typing import Any


class RankActor:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.tasks: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.aborts: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._next = 0
        self._held: dict[int, Any] = {}
        self._done = threading.Event()

    def where(self) -> dict:
        """This rank's node: Ray node id, IP (the rendezvous host when it is rank 0), host name and pid."""
        import ray

        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(), "pid": os.getpid()}

    def getenv(self, names: list[str]) -> dict[str, str | None]:
        """The values of ``names`` in this actor's environment (what the engine forwarded; tests and debugging)."""
        return {n: os.environ.get(n) for n in names}

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, world_size: int, config: Any, resolved: Any, master_addr: str, master_port: int,
              local_rank: int, local_world_size: int, env: dict | None = None, seal: Any = None) -> None:
        """Run the worker loop in a thread (returns at once; readiness comes as a ``("ready", rank)`` result).
        ``env``: the engine's environment variables that configure Omni (plugin lists, offline switches);
        ``seal``: how the rank seals what it hands a stage (the executor's ``SealMode``: refs into Ray's store)."""
        os.environ.update(env or {})
        from omni_core.worker.mp_worker import run_worker

        from omni_executor_ray.transport import pack_for_ray

        def run() -> None:
            try:
                run_worker(self.rank, world_size, config, resolved, master_port, self.tasks, self.results,
                           self.aborts, master_addr=master_addr, local_rank=local_rank,
                           local_world_size=local_world_size, pack=pack_for_ray, seal=seal)
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"omni-rank-{self.rank}", daemon=True).start()

    def put(self, seq: int, msg: tuple) -> None:
        with self._lock:
            self._held[seq] = msg
            while self._next in self._held:
                self.tasks.put(self._held.pop(self._next))
                self._next += 1

    def abort(self, request_ids: list[str]) -> None:
        self.aborts.put(request_ids)

    def get(self, timeout: float) -> list:
        """Every message the loop has produced, waiting up to ``timeout`` s for the first ([] if none)."""
        try:
            out = [self.results.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    def wait_exit(self) -> int:
        """Returns when the loop has ended; the executor holds this call as the rank's liveness signal (an
        actor that dies fails it with ``RayActorError``)."""
        self._done.wait()
        return self.rank

    def ping(self) -> int:
        return self.rank


class StageActor(RankActor):
    """One stage's process (``encode_workers`` / ``decode_workers``) as a Ray actor: the same bridge, running the
    stage loop (``omni_core.worker.stages.run_stage``) in a thread instead of the worker loop. Its messages are the
    stage's (``("ready", 0, ...)``, ``("done", result)``); aborts ride with the work, as in a local stage process."""

    def start_stage(self, stage: str, config: Any, resolved: Any, env: dict | None = None, seal: Any = None) -> None:
        """Run the stage loop in a thread (returns at once; readiness comes as a ``("ready", 0, ...)`` message)."""
        os.environ.update(env or {})
        from omni_core.worker.stages import run_stage

        def run() -> None:
            try:
                run_stage(stage, config, resolved, self.tasks, self.results, seal)
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"omni-{stage}-stage", daemon=True).start()
