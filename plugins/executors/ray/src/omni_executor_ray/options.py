"""The ``ray`` executor's options as :class:`~omni_core.options.Option` records (on its ``ExecutorSpec``, so the core
checks ``ray_<name>=`` keywords and ``--ray-<name>`` flags, and lists them, without importing the executor).
Imports nothing heavy."""

from __future__ import annotations

from typing import Any

from omni_core.options import Option, validate_options


def _address(value: str) -> str | None:
    """What ``ray.init(address=...)`` takes: 'auto', 'local', 'HOST:PORT' or 'ray://HOST:PORT'."""
    return None if value in ("auto", "local") or ":" in value else "not a Ray address"


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0.0"


OPTIONS = (
    Option(name="address", type="str", check=_address, allowed="None, 'auto', 'HOST:PORT' or 'ray://HOST:PORT'",
           help="Ray cluster to join: None is Ray's own search (RAY_ADDRESS, else a `ray start` cluster on this "
                "machine, else a new local one), 'auto' the `ray start` cluster on this machine, 'HOST:PORT' or "
                "'ray://HOST:10001' a remote one"),
    Option(name="cpus_per_rank", type="float", min=0.0, default=1.0, check=_positive,
           help="logical CPUs each rank reserves in the placement group (fractions allowed)"),
    Option(name="gpus_per_rank", type="float", min=0.0,
           help="GPUs each rank reserves (default: 1 on a GPU platform, 0 on CPU)"),
    Option(name="placement", type="choice", choices=("spread", "pack"), default="spread",
           help="'spread': data-parallel replicas on different nodes where possible; 'pack': as few nodes as "
                "possible (a replica's ranks always share one node)"),
    Option(name="heartbeat_timeout", type="float", min=0.5, default=5.0,
           help="seconds a rank may leave a ping unanswered before the engine is declared dead (catches lost "
                "nodes faster than Ray's health checks)"),
    Option(name="start_timeout", type="float", min=1.0, default=60.0,
           help="seconds to wait for the cluster to grant the placement group"),
)


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options with defaults filled in; ``ConfigError`` naming ``ray_<name>`` for a bad one."""
    return validate_options(options, OPTIONS, prefix="ray_", owner="an option of executor 'ray'")
