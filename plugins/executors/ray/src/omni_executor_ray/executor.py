"""``ray``: one Ray actor per rank, so one engine's ranks may sit on several nodes of a Ray cluster.

The wave routing (data-parallel split, merging, pipelined step waves, aborts by replica) is the ``mp``
executor's, inherited; only the transport differs: waves go to each rank's actor by Ray calls, results and
progress come back from each replica leader by a long-poll call (result tensors as numpy arrays:
``omni_executor_ray.transport``), and the actors run the ``mp`` worker loop
(``omni_core.worker.mp_worker.run_worker``) in a thread. Ranks join ``torch.distributed`` (gloo on CPU, the
platform's backend such as nccl on GPUs) at rank 0's node address.

Placement: one placement group, one bundle per data-parallel replica holding all of its ranks. A bundle never
spans nodes, so a sequence-/CFG-parallel group (which talks every step) stays on one node; the bundles of
different replicas (which never talk) are spread over the nodes (``placement="spread"``) or packed
(``"pack"``).

Faults: every actor holds a ``wait_exit`` call open; a dead actor fails it and a monitor thread marks the
engine dead naming the rank and node. A lost node may take Ray's health checks longer to report, so the monitor
also pings every actor each second and declares a rank dead when it has not answered for
``heartbeat_timeout`` s. Non-detached actors die with the driver (Ray's ownership), and ``shutdown`` kills
every actor and removes the placement group.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from typing import Any

from omni_core.errors import ConfigError, EngineDeadError
from omni_core.executor.mp import MultiProcExecutor

from omni_executor_ray.options import check_options
from omni_executor_ray.transport import unpack_from_ray

logger = logging.getLogger("omni_core.executor")

#: environment variables the actors inherit from the engine's process (actors otherwise get the raylet's, so an
#: ``NCCL_SOCKET_IFNAME`` set where ``omni serve`` runs would not reach other nodes)
FORWARD_ENV_PREFIXES = ("OMNI_", "HF_", "TRANSFORMERS_", "DIFFUSERS_", "NCCL_", "TORCH_NCCL_", "CUDA_")
#: ...except these: Ray sets ``CUDA_VISIBLE_DEVICES`` per actor from the GPUs it grants, and install paths are
#: the node's own
NOT_FORWARDED = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH"})


def forwarded_env(environ: Any = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that the actors get (:data:`FORWARD_ENV_PREFIXES`)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(FORWARD_ENV_PREFIXES) and k not in NOT_FORWARDED}


def uses_nccl(platform: Any) -> bool:
    """Whether the ranks talk through NCCL (or RCCL) on this platform: then each needs a whole GPU of its own."""
    return getattr(platform, "device_type", "cpu") != "cpu" and getattr(platform, "dist_backend", "") == "nccl"


def check_gpu_placement(opts: dict, config: Any, platform: Any) -> None:
    """Under NCCL every rank needs a GPU of its own (NCCL refuses two ranks on one device): refuse a fractional
    or zero ``ray_gpus_per_rank`` before anything starts, with a ``ConfigError`` naming the field and what is
    allowed."""
    gpus = opts.get("gpus_per_rank")
    if not uses_nccl(platform) or gpus is None:
        return
    if gpus < 1 or gpus != int(gpus):
        raise ConfigError(f"ray_gpus_per_rank={gpus:g} would give a rank {'no' if gpus == 0 else 'a share of a'} GPU "
                          f"(several ranks on one device, which NCCL refuses) on platform {platform.name!r}; allowed "
                          f"with its nccl backend: a whole number >= 1 (default 1)", field="ray_gpus_per_rank")


def check_cluster_gpus(config: Any, platform: Any, gpus_per_rank: float, cluster_gpus: float) -> None:
    """Under NCCL, ``oversubscribe=True`` lifts only the engine machine's own device count (a Ray cluster may
    have more nodes): the cluster must still give every rank whole GPUs, or NCCL would see two ranks on one
    device. A ConfigError naming ``oversubscribe`` (or ``parallel_config``) and what fits, before any actor."""
    if not uses_nccl(platform) or not gpus_per_rank:
        return
    world = config.parallel_config.world_size
    if world * gpus_per_rank <= cluster_gpus:
        return
    fits = int(cluster_gpus // gpus_per_rank)
    field = "oversubscribe" if getattr(config, "oversubscribe", False) else "parallel_config"
    raise ConfigError(f"parallel_config needs {world} rank(s) x {gpus_per_rank:g} GPU but the Ray cluster has "
                      f"{cluster_gpus:g} GPU(s); under NCCL ranks cannot share a GPU, so oversubscribe=True cannot "
                      f"apply here: allowed a world size of at most {fits} (or add GPU nodes)", field=field)

_ray_lock = threading.Lock()
_ray_users = 0  # executors using a Ray connection this module opened


def _connect(address: str | None) -> bool:
    """Connect this process to Ray unless it already is; True if this call opened the connection."""
    global _ray_users
    import ray

    with _ray_lock:
        if ray.is_initialized():
            if _ray_users:
                _ray_users += 1
                return True
            return False
        ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False)
        _ray_users = 1
        return True


def _disconnect() -> None:
    global _ray_users
    import ray

    with _ray_lock:
        _ray_users -= 1
        if _ray_users <= 0:
            _ray_users = 0
            ray.shutdown()


class _RankSender:
    """``put`` of one rank's task queue: a numbered Ray call (the actor re-orders)."""

    def __init__(self, actor: Any) -> None:
        self.actor, self.seq = actor, 0

    def put(self, msg: tuple) -> None:
        self.actor.put.remote(self.seq, msg)
        self.seq += 1


class _AbortSender:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def put(self, request_ids: list[str]) -> None:
        self.actor.abort.remote(list(request_ids))


class RayExecutor(MultiProcExecutor):
    def start(self) -> None:
        opts = check_options(dict(getattr(self.config, "executor_options", None) or {}))
        from omni_core.platforms import platform_for

        check_gpu_placement(opts, self.config, platform_for(self.config))  # before connecting to anything
        self.options_used = opts
        from omni_core.distributed.parallel_state import RankLayout

        self.world_size = self.config.world_size
        self.replicas = RankLayout.from_config(self.config.parallel_config).replicas()
        self._replica_of_rank = {r: i for i, ranks in enumerate(self.replicas) for r in ranks}
        self._assigned: dict[str, int] = {}
        self._closing = False
        self._dead: str | None = None
        self._buffer: list[tuple] = []
        self._pending: dict[Any, int] = {}  # open ``get`` call -> rank
        self.actors: list[Any] = []
        self.pg = None
        self._owns_connection = _connect(opts["address"])
        try:
            self._start_actors(opts)
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up
    def _start_actors(self, opts: dict) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from omni_core.platforms import platform_for

        from omni_executor_ray.actor import RankActor

        platform = platform_for(self.config)
        gpus = opts["gpus_per_rank"]
        if gpus is None:
            gpus = 0.0 if platform.name == "cpu" else 1.0
        check_cluster_gpus(self.config, platform, gpus, ray.cluster_resources().get("GPU", 0.0))
        cpus = opts["cpus_per_rank"]
        t0 = time.monotonic()
        tag = uuid.uuid4().hex[:8]
        self.name = f"omni-{tag}"
        bundles = [{"CPU": cpus * len(ranks), **({"GPU": gpus * len(ranks)} if gpus else {})} for ranks in self.replicas]
        self.pg = placement_group(bundles, strategy=opts["placement"].upper(), name=self.name)
        ready, _ = ray.wait([self.pg.ready()], timeout=opts["start_timeout"])
        if not ready:
            raise EngineDeadError(
                f"the Ray cluster did not grant the placement group within {opts['start_timeout']:.0f} s: it needs "
                f"{len(bundles)} bundle(s) of {bundles[0]} (one per data-parallel replica, each on one node); the "
                f"cluster has {ray.cluster_resources()}. Lower ray_cpus_per_rank / ray_gpus_per_rank or add nodes")
        # set by the actor before the worker starts: a runtime_env would cost a dedicated worker process
        # (6 s per actor measured on 2 cores)
        env = forwarded_env()
        remote = ray.remote(RankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=self._replica_of_rank[rank])
            self.actors.append(remote.options(
                name=f"{self.name}-rank{rank}", num_cpus=cpus, num_gpus=gpus, max_concurrency=8,
                scheduling_strategy=strategy).remote(rank))
        logger.info("ray: placement group %s granted in %.1f s", self.name, time.monotonic() - t0)
        self.where = ray.get([a.where.remote() for a in self.actors], timeout=opts["start_timeout"])
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
            actor.start.remote(self.world_size, self.config, self.resolved, master_addr, port,
                               0 if gpus else local, per_node[node], env)
        self.task_qs = [_RankSender(a) for a in self.actors]
        self.abort_qs = [_AbortSender(self.actors[ranks[0]]) for ranks in self.replicas]
        self._exit_refs = {a.wait_exit.remote(): rank for rank, a in enumerate(self.actors)}
        self._heartbeat_timeout = opts["heartbeat_timeout"]
        self._monitor = threading.Thread(target=self._watch, name="omni-ray-monitor", daemon=True)
        self._monitor.start()

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.config.worker_start_timeout
        while len(ready) < self.world_size:
            if self._dead:
                raise EngineDeadError(self._dead)
            if time.monotonic() > deadline:
                raise EngineDeadError(f"Ray workers did not load the model within {self.config.worker_start_timeout} s "
                                      f"(ready ranks: {sorted(ready)})")
            try:
                msg = self._get_result(timeout=0.5, ranks=range(self.world_size))
            except queue.Empty:
                continue
            if msg[0] == "ready":
                ready.add(msg[1])
                if len(msg) > 2 and msg[1] == 0:  # rank 0 reports its model's bytes per component (as with mp)
                    self._model_bytes = msg[2]
            elif msg[0] == "fatal":
                raise EngineDeadError(f"worker rank {msg[1]} ({self._node_of(msg[1])}) failed to start:\n{msg[2]}")

    # ------------------------------------------------------------------ results
    def _get_result(self, timeout: float, ranks: Any = None) -> tuple:
        """The next message from the replica leaders (during start-up: from ``ranks``), or ``queue.Empty``.
        One ``get`` call stays open per rank; whichever answers first is read."""
        import ray

        if self._buffer:
            return self._buffer.pop(0)
        ranks = [r[0] for r in self.replicas] if ranks is None else list(ranks)
        open_ranks = set(self._pending.values())
        for rank in ranks:
            if rank not in open_ranks:
                self._pending[self.actors[rank].get.remote(0.5)] = rank
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        for ref in done:
            rank = self._pending.pop(ref)
            try:
                messages = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died
                self._mark_dead(rank, exc)
                raise EngineDeadError(self._dead) from None
            for msg in messages:
                if msg[0] == "result":
                    unpack_from_ray(msg[2])
            self._buffer.extend(messages)
        if not self._buffer:
            raise queue.Empty
        return self._buffer.pop(0)

    # ------------------------------------------------------------------ faults
    def _node_of(self, rank: int) -> str:
        w = self.where[rank] if getattr(self, "where", None) else {}
        return f"node {w.get('node_id', '?')[:12]} ({w.get('ip', '?')}, host {w.get('host', '?')}, pid {w.get('pid', '?')})"

    def _mark_dead(self, rank: int, why: Any = "died") -> None:
        if self._dead is None and not self._closing:
            reason = str(why).strip().splitlines()[0] if str(why).strip() else type(why).__name__
            self._dead = f"the engine is dead: worker rank {rank} on {self._node_of(rank)} died: {reason}"
            logger.error("%s", self._dead)

    def _dead_worker(self, timeout: float) -> Any:
        """A rank whose actor has died or whose loop has ended (waiting up to ``timeout``), or None."""
        import ray

        done, _ = ray.wait(list(self._exit_refs), num_returns=1, timeout=timeout)
        if not done:
            return None
        rank = self._exit_refs[done[0]]
        try:
            ray.get(done[0])
            why = "its worker loop ended"
        except Exception as exc:  # noqa: BLE001
            why = exc
        self._mark_dead(rank, why)
        return rank

    def _watch(self) -> None:
        """Until shutdown: a finished ``wait_exit`` (a dead actor) or an unanswered ping marks the engine dead."""
        import ray

        pings: dict[Any, tuple[int, float]] = {}
        next_ping = 0.0
        while not self._closing and self._dead is None:
            done, _ = ray.wait(list(self._exit_refs), num_returns=1, timeout=0.25)
            if self._closing:
                return
            if done:
                self._dead_worker(timeout=0)
                return
            now = time.monotonic()
            if pings:
                answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0)
                for ref in answered:
                    pings.pop(ref)
            late = [(rank, now - sent) for rank, sent in pings.values() if now - sent > self._heartbeat_timeout]
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

    # ------------------------------------------------------------------ info / shutdown
    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in getattr(self, "where", [])]

    def placement(self) -> list[dict]:
        """Per rank: its replica, Ray node id, IP, host and pid."""
        return [{**w, "replica": self._replica_of_rank[w["rank"]]} for w in getattr(self, "where", [])]

    def shutdown(self) -> None:
        import ray

        if getattr(self, "_shut", False):
            return
        self._shut = True
        self._closing = True
        actors = getattr(self, "actors", [])
        try:
            if ray.is_initialized():
                for sender in getattr(self, "task_qs", []):
                    try:
                        sender.put(("shutdown",))
                    except Exception:  # noqa: BLE001
                        pass
                refs = list(getattr(self, "_exit_refs", {}))
                if refs:
                    ray.wait(refs, num_returns=len(refs), timeout=5)
                for actor in actors:
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
            monitor = getattr(self, "_monitor", None)
            if monitor is not None and monitor is not threading.current_thread():
                monitor.join(5)
            if getattr(self, "_owns_connection", False):
                self._owns_connection = False
                _disconnect()
