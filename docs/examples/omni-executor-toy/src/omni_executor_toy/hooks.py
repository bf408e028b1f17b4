"""Registers the ``pinned`` executor and its one option; imports nothing heavy (the class loads when selected)."""

import os

from omni_core import hookimpl
from omni_core.options import Option
from omni_core.plugins.types import ExecutorSpec


def parse_cpus(value: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3]."""
    cpus = []
    for part in value.split(","):
        low, _, high = part.strip().partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def check_cpus(value: str) -> str | None:
    """An error message for a bad ``pinned_cpus``, or None."""
    try:
        cpus = parse_cpus(value)
    except ValueError:
        return "not a list of CPU ids"
    usable = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - usable)
    return f"CPU(s) {missing} are not usable here (usable: {sorted(usable)})" if missing else None


OPTIONS = (
    Option(name="cpus", type="str", check=check_cpus, allowed="CPU ids and ranges, e.g. '0' or '0,2-3'",
           help="the CPU cores every model process may run on (default: all the engine's cores)"),
)


@hookimpl
def omni_register_executors():
    return [ExecutorSpec(name="pinned", impl="omni_executor_toy.executor:PinnedExecutor", options=OPTIONS,
                         local_processes=True,
                         description="the mp executor's worker processes bound to chosen CPU cores")]
