"""The collective call: one method of the model runner run on every rank, results gathered in rank order.

The one way engine-level operations (weight updates, sleep and wake, a memory report) reach the model process:
``DiffusionEngine.collective_rpc`` pauses the waves (none is in flight while it runs), the executor sends
``("call", name, args, kwargs)`` to every rank, each rank runs it on its ``ModelRunner`` and answers, and a failure
on any rank fails the call naming every failed rank (:class:`~omni_core.errors.CollectiveCallError`). The
method is named, not pickled: only the runner's public methods are reachable, and a name it lacks is refused
before anything is sent.
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import CollectiveCallError, ConfigError

#: how long a collective call may take by default before the engine gives the model processes up for dead
DEFAULT_TIMEOUT_S = 300.0


def check_method(method: str) -> None:
    """Refuse a name that is not a public method of the model runner, naming the ones that are."""
    from omni_core.worker.runner import ModelRunner

    if not isinstance(method, str) or method.startswith("_") or not callable(getattr(ModelRunner, method, None)):
        public = sorted(n for n in dir(ModelRunner) if not n.startswith("_") and callable(getattr(ModelRunner, n)))
        raise ConfigError(f"collective_rpc: {method!r} is not a public method of the model runner; it has: "
                          f"{', '.join(public)}", field="method")


def gathered(method: str, answers: dict[int, tuple[bool, Any]], world_size: int) -> list[Any]:
    """Every rank's result in rank order, or :class:`CollectiveCallError` naming each rank that failed."""
    failed = {rank: value for rank, (ok, value) in answers.items() if not ok}
    if failed:
        first = min(failed)
        raise CollectiveCallError(f"collective call {method!r} failed on rank(s) {sorted(failed)} of {world_size}; "
                                  f"rank {first}:\n{failed[first]}", ranks=sorted(failed), errors=failed)
    return [answers[rank][1] for rank in range(world_size)]


__all__ = ["DEFAULT_TIMEOUT_S", "check_method", "gathered"]
