"""``pinned``: the ``mp`` executor, each model process bound to the cores in ``pinned_cpus``.

Everything but where the processes run is ``MultiProcExecutor``'s: wave routing, replicas, aborts, collective
calls, death reporting. Its one seam is ``process_group()``: here the same group of worker processes, whose
body first binds itself to the chosen cores and then runs Omni's worker loop.
"""

from __future__ import annotations

import os
from typing import Any

from omni_core.executor.mp import MultiProcExecutor
from omni_core.executor.process_group import LocalProcessGroup

from omni_executor_toy.hooks import parse_cpus


def pinned_worker(cpus: list[int], *worker_args: Any) -> None:
    """A model process's body: bind to ``cpus``, then the worker loop (``worker_main``) as ``mp`` runs it."""
    from omni_core.worker.mp_worker import worker_main

    os.sched_setaffinity(0, cpus)
    worker_main(*worker_args)


class PinnedExecutor(MultiProcExecutor):
    def process_group(self) -> LocalProcessGroup:
        group = super().process_group()  # the mp executor's own group: targets, names, queues
        value = self.config.executor_options.get("cpus")
        cpus = parse_cpus(value) if value else sorted(os.sched_getaffinity(0))

        def args_for(rank: int, task_q: Any, result_q: Any, abort_q: Any) -> tuple:
            return (cpus, *group.args_for(rank, task_q, result_q, abort_q))

        return LocalProcessGroup(group.name, pinned_worker, args_for, group.names, start_hint=group.start_hint)
