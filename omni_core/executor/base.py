"""The executor interface: how a scheduled wave reaches the model and its result comes back."""

from __future__ import annotations

from typing import Any, Callable

from omni_core.executor.calls import CallThread, DoneFn
from omni_core.pipelines.loader import ResolvedModel
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput

ProgressFn = Callable[[str, int, int], None]


class DiffusionExecutor:
    """Base class of executors (``uni``, ``mp``, or a plugin's).

    The engine's loop hands waves over with :meth:`run_async` (``execute_batch`` / ``execute_step`` /
    ``recv_step`` / ``release`` then run on the executor's call thread, one at a time, in order) and calls
    ``send_step`` and ``abort`` itself; ``abort`` may come while a wave runs and must make the runner stop the
    request at its next step boundary.
    """

    # the executor's own options are declared on its record (``ExecutorSpec.options``, Option records): given as
    # ``<executor>_<name>=`` to ``Omni(...)`` and ``--<executor>-<name>`` to the CLI, they reach the executor as
    # ``config.executor_options[name]`` (so the core names no executor's options; e.g. ``ray_address``)

    def __init__(self, config: Any, resolved: ResolvedModel, on_progress: ProgressFn | None = None) -> None:
        self.config = config
        self.resolved = resolved
        self.on_progress = on_progress

    def start(self) -> None:
        """Load the model (in every worker); raise if that fails."""
        raise NotImplementedError

    def launch_stage(self, stage: str, on_done: Callable[[Any], None], on_dead: Callable[[str], None]) -> Any:
        """Start stage ``stage``'s process (``encode_workers`` / ``decode_workers``) as one of this executor's
        processes, so it loads while the model does (``wait_ready`` it); :meth:`stop_stages` stops it with the rest.
        The process is the group :meth:`stage_process_group` builds, and what it hands the model processes is
        sealed as :meth:`stage_seal` says. None when the stage runs in line."""
        from omni_core.executor.stage_process import launch_stage

        seal = self.stage_seal(stage)
        process = launch_stage(stage, self.config, self.resolved, on_done, on_dead, seal,
                               lambda on_message: self.stage_process_group(stage, seal, on_message))
        if process is not None:
            self.__dict__.setdefault("_stage_processes", []).append(process)
        return process

    def stage_seal(self, stage: str) -> Any:
        """How what stage ``stage``'s process hands the model processes is sealed, a
        :class:`~omni_core.worker.transport.SealMode`: shared-memory handles here, by value when they are not on
        one host (``same_host``), and the encodings also when a replica has several model ranks: a shared-memory
        handle opens once, and every rank of the replica opens the request's encodings (the engine still only
        passes the bytes on). The Ray executor returns refs into Ray's object store."""
        from omni_core.worker.transport import BY_VALUE, SHARED

        parallel = getattr(self.config, "parallel_config", None)
        ranks = self.config.world_size // max(1, getattr(parallel, "data_parallel_size", 1))
        return BY_VALUE if not self.same_host or (stage == "encode" and ranks > 1) else SHARED

    def stage_process_group(self, stage: str, seal: Any, on_message: Callable[[tuple], None]) -> Any:
        """The (unspawned) one-process :class:`~omni_core.executor.process_group.ProcessGroup` that runs stage
        ``stage`` (:func:`~omni_core.worker.stages.run_stage`), sealing as ``seal`` says, every message after
        start-up handed to ``on_message``: a process on this host here; an executor that places its processes
        elsewhere returns its own (the Ray plugin: an actor in the cluster)."""
        from omni_core.executor.stage_process import local_stage_group

        return local_stage_group(stage, self.config, self.resolved, seal, on_message)

    def stop_stages(self) -> None:
        """Stop the stage processes :meth:`launch_stage` started (safe twice)."""
        for process in self.__dict__.pop("_stage_processes", []):
            process.shutdown()

    def run_async(self, call: Callable[[], Any], done: DoneFn) -> None:
        """Run ``call()`` (one of this executor's blocking methods) off the engine's loop, then ``done(result,
        error)`` on the same thread (:mod:`omni_core.executor.calls`); calls run in the order given."""
        calls = self.__dict__.get("_calls")
        if calls is None:
            calls = self.__dict__["_calls"] = CallThread()
        calls.run(call, done)

    def close_calls(self) -> None:
        """Stop the call thread (after ``shutdown``, so a call waiting on a worker has failed)."""
        calls = self.__dict__.get("_calls")
        if calls is not None:
            calls.close()

    def execute_batch(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        raise NotImplementedError

    def execute_step(self, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        raise NotImplementedError

    #: the model's processes run on the engine's host, so what a stage process makes for them (and they for it) may
    #: travel as shared-memory handles (:class:`~omni_core.worker.transport.Sealed`); False: by value
    #: (:meth:`stage_seal`; the Ray executor overrides it with refs into Ray's object store)
    same_host: bool = True

    #: step waves that may be queued at once (``send_step`` / ``recv_step``); 1: only ``execute_step`` is used
    step_pipeline_depth: int = 1

    def send_step(self, sched: DiffusionSchedulerOutput) -> None:
        """Queue a step wave without waiting for it (when ``step_pipeline_depth > 1``); results come back in order
        from ``recv_step``, one per wave sent. Safe to call from any thread (the engine serialises the calls). A
        wave with ``replaces_queued`` set may make the workers skip the step of the wave queued before it, if
        that one has not started (``RunnerOutput.skipped``; the ``mp`` worker loop does this)."""
        raise NotImplementedError

    def recv_step(self) -> RunnerOutput:
        """The result of the oldest wave sent with ``send_step``."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Run the model runner's public method ``method`` on every rank; one result per rank, in rank order
        (:mod:`omni_core.executor.collective`). Called with no wave in flight (the engine pauses them)."""
        raise NotImplementedError

    def release(self, request_ids: list[str]) -> set[str]:
        """Drop per-request state of ended requests; returns the ids still held."""
        raise NotImplementedError

    def is_alive(self) -> bool:
        return True

    def model_bytes(self) -> dict[str, int]:
        """``{component: bytes of its parameters and buffers}`` of one rank's loaded model (rank 0 of ``mp``, from
        its ready message; ``stats()["model_bytes"]``); empty where the executor cannot tell."""
        runner = getattr(self, "runner", None)
        return dict(getattr(runner, "model_bytes", None) or getattr(self, "_model_bytes", None) or {})

    @property
    def death_reason(self) -> str | None:
        return None

    def shutdown(self) -> None:
        raise NotImplementedError
