"""``RayProcessGroup``: the ``ray`` executor's ranks as a :class:`~omni_core.executor.process_group.ProcessGroup`.

One Ray actor per rank (``omni_executor_ray.actor.RankActor``, running the ``mp`` worker loop in a thread), placed
by one placement group with a bundle per data-parallel replica. ``send`` is a numbered Ray call (the actor puts
the messages back in order), ``receive`` a long-poll ``get`` call held open per rank (result tensors arrive as
numpy arrays, ``omni_executor_ray.transport``), ``send_abort`` a direct call the leader polls each step.

Watching: every actor holds a ``wait_exit`` call open; a dead actor fails it. A lost node may take Ray's health
checks longer to report, so the watcher also pings every actor each second and declares a rank dead when it has
not answered for ``heartbeat_timeout`` s. ``stop`` sends the loop its shutdown, waits up to 5 s for the loops to end
(not for a dead group's: its survivors may wait in a collective on the dead rank), then kills every actor and
removes the placement group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable

from omni_core.errors import EngineDeadError
from omni_core.executor.process_group import ProcessGroup

from omni_executor_ray.transport import unpack_from_ray

logger = logging.getLogger("omni_core.executor")


class RankSender:
    """``put`` of one rank's task queue: a numbered Ray call (the actor re-orders)."""

    def __init__(self, actor: Any) -> None:
        self.actor, self.seq = actor, 0

    def put(self, msg: tuple) -> None:
        self.actor.put.remote(self.seq, msg)
        self.seq += 1


class RayProcessGroup(ProcessGroup):
    """The ranks (``RankActor``); :class:`RayStageGroup` is a stage's actor on the same machinery. ``seal``: how the
    actors seal what they hand another process (the executor's ``SealMode``)."""

    def __init__(self, config: Any, resolved: Any, opts: dict, replica_of_rank: dict[int, int], n_replicas: int,
                 *, env: dict[str, str], check_gpus: Callable[[float], None], seal: Any = None) -> None:
        self.config, self.resolved, self.opts, self.seal = config, resolved, opts, seal
        self.replica_of_rank, self.n_replicas = replica_of_rank, n_replicas
        self.size = config.world_size
        self.env, self.check_gpus = env, check_gpus
        self.dead: str | None = None
        self.on_death = None
        self.actors: list[Any] = []
        self.where: list[dict] = []
        self.pg: Any = None
        self._stopping = False
        self._stopped = False
        self._buffer: list[tuple] = []
        self._pending: dict[Any, int] = {}  # open ``get`` call -> rank
        self._exit_refs: dict[Any, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ spawn, ready
    def spawn(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = self.opts
        gpus = self.member_gpus()
        self.check_gpus(gpus)
        cpus = opts["cpus_per_rank"]
        t0 = time.monotonic()
        self.name = f"omni-{uuid.uuid4().hex[:8]}"
        sizes = [sum(1 for r in self.replica_of_rank.values() if r == i) for i in range(self.n_replicas)]
        bundles = [{"CPU": cpus * n, **({"GPU": gpus * n} if gpus else {})} for n in sizes]
        self.pg = placement_group(bundles, strategy=opts["placement"].upper(), name=self.name)
        ready, _ = ray.wait([self.pg.ready()], timeout=opts["start_timeout"])
        if not ready:
            raise EngineDeadError(
                f"the Ray cluster did not grant the placement group within {opts['start_timeout']:.0f} s: it needs "
                f"{len(bundles)} bundle(s) of {bundles[0]} (one per data-parallel replica, each on one node); the "
                f"cluster has {ray.cluster_resources()}. Lower ray_cpus_per_rank / ray_gpus_per_rank or add nodes")
        remote = ray.remote(self.actor_class())
        for rank in range(self.size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=self.replica_of_rank[rank])
            self.actors.append(remote.options(
                name=f"{self.name}-{self.member(rank).replace(' ', '')}", num_cpus=cpus, num_gpus=gpus,
                max_concurrency=8, scheduling_strategy=strategy).remote(rank))
        logger.info("ray: placement group %s granted in %.1f s", self.name, time.monotonic() - t0)
        self.start_members(gpus, t0)
        self._senders = [RankSender(a) for a in self.actors]
        self._exit_refs = {a.wait_exit.remote(): rank for rank, a in enumerate(self.actors)}
        if self.where:  # every actor is up: pings are answered from now on
            self.watch()

    def watch(self) -> None:
        """Start the watcher (:meth:`_watch`) once the actors are up."""
        self._watcher = threading.Thread(target=self._watch, name="omni-ray-monitor", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ what kind of members
    def actor_class(self) -> type:
        from omni_executor_ray.actor import RankActor

        return RankActor

    def member(self, rank: int) -> str:
        """What member ``rank`` is called in names and messages."""
        return f"rank {rank}"

    def member_gpus(self) -> float:
        """GPUs each actor reserves: ``ray_gpus_per_rank``, by default 1 on a GPU platform and 0 on the CPU."""
        gpus = self.opts["gpus_per_rank"]
        if gpus is None:
            from omni_core.platforms import platform_for

            gpus = 0.0 if platform_for(self.config).name == "cpu" else 1.0
        return gpus

    def start_members(self, gpus: float, t0: float) -> None:
        """Start each rank's worker loop (they join ``torch.distributed`` at rank 0's node address, so this waits
        for every actor to say where it is)."""
        import ray

        self.where = ray.get([a.where.remote() for a in self.actors], timeout=self.opts["start_timeout"])
        logger.info("ray: %d actors up in %.1f s", len(self.actors), time.monotonic() - t0)
        master_addr = self.where[0]["ip"]
        port = ray.get(self.actors[0].free_port.remote())
        per_node: dict[str, int] = {}
        for w in self.where:
            per_node[w["node_id"]] = per_node.get(w["node_id"], 0) + 1
        seen: dict[str, int] = {}
        for rank, actor in enumerate(self.actors):
            node = self.where[rank]["node_id"]
            local = seen.get(node, 0)
            seen[node] = local + 1
            # set by the actor before the worker starts: a runtime_env would cost a dedicated worker process
            # (6 s per actor measured on 2 cores)
            actor.start.remote(self.size, self.config, self.resolved, master_addr, port,
                               0 if gpus else local, per_node[node], self.env, self.seal)

    def wait_ready(self, timeout: float) -> list[Any]:
        payloads: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(payloads) < self.size:
            if self.dead:
                raise EngineDeadError(f"the engine is dead: worker {self.dead}")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"Ray workers did not load the model within {timeout} s "
                                      f"(ready ranks: {sorted(payloads)})")
            try:
                msg = self.receive(timeout=0.5)
            except queue.Empty:
                continue
            if msg[0] == "ready":
                payloads[msg[1]] = msg[2] if len(msg) > 2 else None
            elif msg[0] == "fatal":
                raise EngineDeadError(f"{self.member(msg[1])} ({self.node_of(msg[1])}) failed to start:\n{msg[2]}")
        return [payloads[r] for r in range(self.size)]

    # ------------------------------------------------------------------ send, receive
    def send(self, rank: int, msg: tuple) -> None:
        self._senders[rank].put(msg)

    def send_abort(self, rank: int, request_ids: list[str]) -> None:
        self.actors[rank].abort.remote(list(request_ids))

    def receive(self, timeout: float) -> tuple:
        """The next message from any rank, or ``queue.Empty``. One ``get`` call stays open per rank; whichever
        answers first is read."""
        import ray

        if self._buffer:
            return self._buffer.pop(0)
        open_ranks = set(self._pending.values())
        for rank in range(self.size):
            if rank not in open_ranks:
                self._pending[self.actors[rank].get.remote(0.5)] = rank
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        for ref in done:
            rank = self._pending.pop(ref)
            try:
                messages = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died
                self._mark_dead(rank, exc)
                raise EngineDeadError(f"the engine is dead: worker {self.dead}") from None
            for msg in messages:
                if msg[0] == "result":
                    unpack_from_ray(msg[2])
            self._buffer.extend(messages)
        if not self._buffer:
            raise queue.Empty
        return self._buffer.pop(0)

    # ------------------------------------------------------------------ watch
    def node_of(self, rank: int) -> str:
        w = self.where[rank] if self.where else {}
        return f"node {w.get('node_id', '?')[:12]} ({w.get('ip', '?')}, host {w.get('host', '?')}, pid {w.get('pid', '?')})"

    def _mark_dead(self, rank: int, why: Any = "died") -> None:
        with self._lock:
            if self.dead is not None or self._stopping:
                return
            reason = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
            self.dead = f"{self.member(rank)} on {self.node_of(rank)} died: {reason}"
        logger.error("ray: %s", self.dead)
        if self.on_death is not None:
            self.on_death(self.dead)

    def wait_death(self, timeout: float) -> str | None:
        import ray

        done, _ = ray.wait(list(self._exit_refs), num_returns=1, timeout=timeout)
        if not done:
            return None
        rank = self._exit_refs[done[0]]
        try:
            ray.get(done[0])
            why: Any = "its worker loop ended"
        except Exception as exc:  # noqa: BLE001
            why = exc
        self._mark_dead(rank, why)
        return self.dead

    def _watch(self) -> None:
        """Until stop: a finished ``wait_exit`` (a dead actor) or an unanswered ping marks the group dead."""
        import ray

        pings: dict[Any, tuple[int, float]] = {}
        next_ping = 0.0
        while not self._stopping and self.dead is None:
            done, _ = ray.wait(list(self._exit_refs), num_returns=1, timeout=0.25)
            if self._stopping:
                return
            if done:
                self.wait_death(timeout=0)
                return
            now = time.monotonic()
            if pings:
                answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0)
                for ref in answered:
                    pings.pop(ref)
            late = [(rank, now - sent) for rank, sent in pings.values() if now - sent > self.opts["heartbeat_timeout"]]
            if late:
                rank, age = late[0]
                self._mark_dead(rank, f"no answer to a ping for {age:.1f} s (node lost?)")
                return
            if now >= next_ping:
                waiting = {rank for rank, _ in pings.values()}
                for rank, actor in enumerate(self.actors):
                    if rank not in waiting:
                        pings[actor.ping.remote()] = (rank, now)
                next_ping = now + 1.0

    def pids(self) -> list[int]:
        return [w["pid"] for w in self.where]

    def placement(self) -> list[dict]:
        """Per rank: its replica, Ray node id, IP, host and pid."""
        return [{**w, "replica": self.replica_of_rank[w["rank"]]} for w in self.where]

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        import ray

        if self._stopped:
            return
        self._stopped = self._stopping = True
        try:
            if ray.is_initialized():
                for sender in getattr(self, "_senders", []):
                    try:
                        sender.put(("shutdown",))
                    except Exception:  # noqa: BLE001
                        pass
                refs = list(self._exit_refs)
                # a dead group's survivors may sit in a collective with the dead rank until killed: no grace
                if refs and self.dead is None:
                    ray.wait(refs, num_returns=len(refs), timeout=5)
                for actor in self.actors:
                    try:
                        ray.kill(actor, no_restart=True)
                    except Exception:  # noqa: BLE001
                        pass
                if self.pg is not None:
                    from ray.util.placement_group import remove_placement_group

                    try:
                        remove_placement_group(self.pg)
                    except Exception:  # noqa: BLE001
                        pass
        finally:
            watcher = getattr(self, "_watcher", None)
            if watcher is not None and watcher is not threading.current_thread():
                watcher.join(5)


class RayStageGroup(RayProcessGroup):
    """One stage's process (``encode_workers`` / ``decode_workers``) as a Ray actor (``StageActor``, running the
    stage loop), placed like a replica: a placement group of one bundle of ``ray_cpus_per_rank`` CPUs (and, unless
    the stage's device is "cpu", ``ray_gpus_per_rank`` GPUs), so it may sit on any node. Watched, pinged and
    stopped as the ranks are; after start-up a reader thread hands each message to ``on_message``."""

    def __init__(self, config: Any, resolved: Any, opts: dict, stage: str, seal: Any,
                 on_message: Callable[[tuple], None], *, env: dict[str, str]) -> None:
        super().__init__(config, resolved, opts, {0: 0}, 1, env=env, check_gpus=lambda gpus: None, seal=seal)
        self.size, self.stage, self.on_message = 1, stage, on_message

    def actor_class(self) -> type:
        from omni_executor_ray.actor import StageActor

        return StageActor

    def member(self, rank: int) -> str:
        return f"{self.stage} stage"

    def member_gpus(self) -> float:
        from omni_core.worker.stage_contract import stage_device

        return 0.0 if stage_device(self.config, self.stage) == "cpu" else super().member_gpus()

    def start_members(self, gpus: float, t0: float) -> None:
        """Start the stage loop without waiting for the actor (``spawn`` returns at once, as a local process's:
        the stage loads while the model does); where it is comes in ``wait_ready``."""
        self._where_refs = [self.actors[0].where.remote()]
        self.actors[0].start_stage.remote(self.stage, self.config, self.resolved, self.env, self.seal)

    def wait_ready(self, timeout: float) -> list[Any]:
        import ray

        try:
            self.where = ray.get(self._where_refs, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the actor died while starting, or the cluster is short
            raise EngineDeadError(f"its Ray actor did not start within {timeout} s: {exc}") from None
        self.watch()
        payloads = super().wait_ready(timeout)
        self._reader = threading.Thread(target=self._read, name=f"omni-{self.stage}-reader", daemon=True)
        self._reader.start()
        return payloads

    def _read(self) -> None:
        while not self._stopping and self.dead is None:
            try:
                msg = self.receive(timeout=0.5)
            except queue.Empty:
                continue
            except EngineDeadError:  # the watcher reports the death
                return
            try:
                self.on_message(msg)
            except Exception:  # noqa: BLE001 - a delivery bug must not stop the reader
                logger.exception("delivering a message of the %s stage failed", self.stage)

    def unsent(self) -> int:
        """Ray calls are sent as they are made: nothing waits on this side."""
        return 0


__all__ = ["RankSender", "RayProcessGroup", "RayStageGroup"]
