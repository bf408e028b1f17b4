"""The engine's end of a stage process (``encode_workers`` / ``decode_workers``; the process's body is
:func:`omni_core.worker.stages.run_stage`): a one-process :class:`~omni_core.executor.process_group.ProcessGroup`
that the executor builds (:meth:`~omni_core.executor.base.DiffusionExecutor.stage_process_group`: a local process
here, a Ray actor for the Ray executor), work sent in order with its aborts, results handed on from the group."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from omni_core.errors import EngineDeadError
from omni_core.executor.process_group import LocalProcessGroup
from omni_core.worker.stage_contract import DECODE
from omni_core.worker.stages import stage_main

logger = logging.getLogger("omni_core.executor")


class StageProcess:
    """The engine's handle on one stage's process, a one-process
    :class:`~omni_core.executor.process_group.ProcessGroup` (``make_group(on_message)`` builds it unspawned; default
    :func:`local_stage_group`): ``submit`` work (decode payloads of one group, or requests to encode); results
    reach ``on_done(result)`` from the group's reader (decode: ``{request id: DiffusionOutput}``; encode:
    ``_encode``'s dict); the process's death after it was ready reaches ``on_dead(reason)`` once, the reason naming
    the stage (a death before is ``wait_ready``'s failure)."""

    def __init__(self, stage: str, config: Any, resolved: Any, on_done: Callable[[Any], None],
                 on_dead: Callable[[str], None], seal: Any = None,
                 make_group: Callable[[Callable[[tuple], None]], Any] | None = None) -> None:
        self.stage, self.config, self.resolved = stage, config, resolved
        #: how what it hands the model processes is sealed (``omni_core.worker.transport.SealMode``; None: shared
        #: memory)
        self.seal = seal
        self.make_group = make_group or (lambda on_message: local_stage_group(stage, config, resolved, seal,
                                                                              on_message))
        self.on_done, self.on_dead = on_done, on_dead
        self.model_bytes: dict[str, int] = {}
        self.device: str | None = None
        self.dead: str | None = None
        #: requests this stage has finished (decoded, or encoded)
        self.done = 0
        self.group: Any = None
        self._ready_seen = False
        self._state_lock = threading.Lock()

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it to load (the engine loads its model meanwhile)."""
        self.group = self.make_group(self._on_message)
        self.group.on_death = self._died
        self.group.spawn()

    def wait_ready(self) -> None:
        """Wait for the launched process to load; a failure shuts it down and raises naming the stage."""
        try:
            (ready,) = self.group.wait_ready(self.config.worker_start_timeout)
        except EngineDeadError as exc:
            self.shutdown()
            raise EngineDeadError(f"the {self.stage} stage's process failed to start: {exc}") from None
        with self._state_lock:
            self._ready_seen = True
        self.model_bytes, self.device = ready["model_bytes"], ready["device"]

    def _died(self, reason: str) -> None:
        with self._state_lock:
            if self.dead is not None:
                return
            self.dead = f"the {self.stage} stage's process {reason}"
            report = self._ready_seen
        if report:
            self.on_dead(self.dead)

    def _on_message(self, msg: tuple) -> None:
        from omni_core.worker.transport import unpack_outputs

        if msg[0] == "done":
            result = unpack_outputs(msg[1]).outputs if self.stage == DECODE else msg[1]
            self.done += len(result if self.stage == DECODE else result["results"])
            self.on_done(result)

    def submit(self, items: list) -> None:
        """Work for the process: one decode group's payloads, or requests to encode."""
        self.group.send(0, ("work", items))

    def abort(self, request_ids: list[str]) -> None:
        self.group.send(0, ("abort", list(request_ids)))

    @property
    def unsent(self) -> int:
        """Messages for the process that are not yet in its pipe (``stats()["stages"][stage]["unsent"]``)."""
        return self.group.unsent() if self.group is not None and hasattr(self.group, "unsent") else 0

    def pid(self) -> int | None:
        pids = self.group.pids() if self.group is not None else []
        return pids[0] if pids else None

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.stop()


#: what a stage's death during start-up usually means
START_HINT = ("see its traceback above; processes import the caller's main module as spawn does: a script that "
              "creates the engine at module level must guard it with `if __name__ == '__main__':`")


def local_stage_group(stage: str, config: Any, resolved: Any, seal: Any,
                      on_message: Callable[[tuple], None]) -> LocalProcessGroup:
    """Stage ``stage``'s process on this host (Omni's fork server), unspawned: its body
    :func:`~omni_core.worker.stages.stage_main`, its messages handed to ``on_message`` by the group's watcher."""
    from omni_core.processes import child_environment

    parent, env = os.getpid(), child_environment()

    def args_for(rank: int, task_q: Any, result_q: Any, abort_q: Any) -> tuple:
        return (stage, config, resolved, task_q, result_q, parent, env, seal)  # aborts ride with the work

    return LocalProcessGroup(f"{stage} stage", stage_main, args_for, [f"omni-{stage}-stage"],
                             on_message=on_message, background_send=True, start_hint=START_HINT)


def launch_stage(stage: str, config: Any, resolved: Any, on_done: Callable[[Any], None],
                 on_dead: Callable[[str], None], seal: Any = None,
                 make_group: Callable[[Callable[[tuple], None]], Any] | None = None) -> StageProcess | None:
    """Stage ``stage``'s process of ``config``, launched (None when the stage runs in line); ``wait_ready`` it."""
    if not getattr(config, f"{stage}_workers", 0):
        return None
    process = StageProcess(stage, config, resolved, on_done, on_dead, seal, make_group)
    process.launch()
    return process


__all__ = ["StageProcess", "launch_stage", "local_stage_group"]
