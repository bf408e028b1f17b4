"""``ray``: one Ray actor per rank, so one engine's ranks may sit on several nodes of a Ray cluster.

The wave routing (data-parallel split, merging, pipelined step waves, aborts by replica, collective calls) is
the ``mp`` executor's, inherited; only the processes differ: the ranks are a ``RayProcessGroup``
(``omni_executor_ray.group``: actors, Ray calls, a watcher), returned from ``process_group()``, the one
method the ``mp`` executor leaves for this, and the actors run the ``mp`` worker loop
(``omni_core.worker.mp_worker.run_worker``) in a thread. Ranks join ``torch.distributed`` (gloo on CPU, the
platform's backend such as nccl on GPUs) at rank 0's node address.

Placement: one placement group, one bundle per data-parallel replica holding all of its ranks. A bundle never
spans nodes, so a sequence-/CFG-parallel group (which talks every step) stays on one node; the bundles of
different replicas (which never talk) are spread over the nodes (``placement="spread"``) or packed
(``"pack"``).

Faults (``RayProcessGroup``): a dead actor or an unanswered ping marks the engine dead naming the rank and node.
Non-detached actors die with the driver (Ray's ownership), and ``shutdown`` kills every actor and removes the
placement group.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from omni_core.errors import ConfigError
from omni_core.executor.mp import MultiProcExecutor

from omni_executor_ray.group import RayProcessGroup, RayStageGroup
from omni_executor_ray.options import check_options
from omni_executor_ray.transport import ray_seal

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


class RayExecutor(MultiProcExecutor):
    """The ``mp`` executor's wave routing over a :class:`~omni_executor_ray.group.RayProcessGroup`; the stage
    processes are Ray actors too (:class:`~omni_executor_ray.group.RayStageGroup`)."""

    #: ranks may sit on other nodes: what they and the stage actors hand each other travels as refs into Ray's
    #: object store (:meth:`stage_seal`), never through the engine's process
    same_host = False

    def connect(self) -> None:
        """Check the options and connect to Ray, once (the stage actors start before the ranks)."""
        if getattr(self, "options_used", None) is not None:
            return
        from omni_core.platforms import platform_for

        opts = check_options(dict(getattr(self.config, "executor_options", None) or {}))
        check_gpu_placement(opts, self.config, platform_for(self.config))  # before connecting to anything
        self.owns_connection = _connect(opts["address"])
        self.options_used = opts

    def start(self) -> None:
        self.connect()
        super().start()  # builds the group (process_group), spawns it, waits for every rank

    def stage_seal(self, stage: str) -> Any:
        """Refs into Ray's object store (``omni_executor_ray.transport.RayObjects``), for both stages and any number
        of ranks: the maker ``ray.put``s, the engine passes the ref on inside its Ray calls, the user ``ray.get``s."""
        return ray_seal()

    def stage_process_group(self, stage: str, seal: Any, on_message: Any) -> RayStageGroup:
        """Stage ``stage``'s process as a Ray actor in the cluster (:class:`~omni_executor_ray.group.RayStageGroup`)."""
        self.connect()
        return RayStageGroup(self.config, self.resolved, self.options_used, stage, seal, on_message,
                             env=forwarded_env())

    def stage_placement(self) -> dict[str, dict]:
        """Per stage actor (``encode`` / ``decode``): its Ray node id, IP, host and pid."""
        return {process.stage: process.group.placement()[0]
                for process in self.__dict__.get("_stage_processes", [])
                if process.group is not None and process.group.where}

    def stop_stages(self) -> None:
        super().stop_stages()
        if getattr(self, "group", None) is None:  # the ranks never started: nothing else will disconnect
            self.disconnect()

    def disconnect(self) -> None:
        if getattr(self, "owns_connection", False):
            self.owns_connection = False
            _disconnect()

    def process_group(self) -> RayProcessGroup:
        import ray

        from omni_core.distributed.parallel_state import RankLayout
        from omni_core.platforms import platform_for

        config, platform = self.config, platform_for(self.config)
        replicas = RankLayout.from_config(config.parallel_config).replicas()
        replica_of_rank = {r: i for i, ranks in enumerate(replicas) for r in ranks}
        return RayProcessGroup(config, self.resolved, self.options_used, replica_of_rank, len(replicas),
                               env=forwarded_env(), check_gpus=lambda gpus: check_cluster_gpus(
                                   config, platform, gpus, ray.cluster_resources().get("GPU", 0.0)),
                               seal=ray_seal())

    @property
    def actors(self) -> list[Any]:
        group = getattr(self, "group", None)
        return group.actors if group is not None else []

    def placement(self) -> list[dict]:
        """Per rank: its replica, Ray node id, IP, host and pid."""
        group = getattr(self, "group", None)
        return group.placement() if group is not None else []

    def shutdown(self) -> None:
        try:
            self.stop_stages()  # while connected: the engine stops the stages after the executor
            super().shutdown()
        finally:
            self.disconnect()
