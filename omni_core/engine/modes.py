"""The two execution modes as strategy objects, chosen once when the engine is built.

Everything that differs between ``REQUEST_BATCH`` (whole requests per wave) and ``STEP_BATCH`` (one
denoising step per wave) is here, so the engine's loop has no mode branches.
"""

from __future__ import annotations

import enum
from typing import Any

from omni_core.errors import ConfigError
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput


class DiffusionExecutionMode(str, enum.Enum):
    REQUEST_BATCH = "request_batch"
    STEP_BATCH = "step_batch"


class ExecutionStrategy:
    """What the engine asks of a mode: the wave capacity, how a wave runs, how running requests stop."""

    mode: DiffusionExecutionMode
    #: ``denoise_steps`` counted per runner progress callback
    steps_per_progress: int
    #: a request's completing output also carries its last step (progress and, streaming, its preview)
    final_output_is_a_step: bool

    def check(self, pipeline_cls: Any, pipeline_name: str) -> None:
        """Raise ``ConfigError`` if the pipeline cannot run in this mode."""

    def capacity(self, pipeline_cls: Any, max_num_seqs: int) -> int:
        raise NotImplementedError

    def execute(self, executor: Any, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        raise NotImplementedError

    def stop_running(self, executor: Any, request_ids: list[str]) -> None:
        """Make running requests that were just aborted stop within one denoising step."""
        raise NotImplementedError

    def wave_steps(self, sched: DiffusionSchedulerOutput) -> int:
        """``denoise_steps`` a finished wave counts."""
        raise NotImplementedError

    def pipeline_depth(self, executor: Any) -> int:
        """How many waves may be in flight at once (1: each wave's result is applied before the next is sent)."""
        return 1


class RequestBatchMode(ExecutionStrategy):
    """Whole compatible requests run to completion together (``pipeline.forward``)."""

    mode = DiffusionExecutionMode.REQUEST_BATCH
    steps_per_progress = 1  # a wave runs many steps; each is reported by a progress callback
    final_output_is_a_step = False

    def capacity(self, pipeline_cls: Any, max_num_seqs: int) -> int:
        """A pipeline without request batching runs one request at a time."""
        return max_num_seqs if pipeline_cls.supports_request_batch else 1

    def execute(self, executor: Any, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return executor.execute_batch(sched)

    def stop_running(self, executor: Any, request_ids: list[str]) -> None:
        """Running requests are mid-forward: tell the runner, which stops them at the next step."""
        executor.abort(request_ids)

    def wave_steps(self, sched: DiffusionSchedulerOutput) -> int:
        return 0


class StepBatchMode(ExecutionStrategy):
    """One denoising step of every running request per wave; requests join and leave between steps."""

    mode = DiffusionExecutionMode.STEP_BATCH
    steps_per_progress = 0  # counted per wave instead (wave_steps)
    final_output_is_a_step = True

    def check(self, pipeline_cls: Any, pipeline_name: str) -> None:
        if not pipeline_cls.supports_step_execution:
            raise ConfigError(f"pipeline {pipeline_name!r} does not support step execution "
                              f"(step_execution / streaming_output)", field="step_execution")

    def capacity(self, pipeline_cls: Any, max_num_seqs: int) -> int:
        return max_num_seqs

    def execute(self, executor: Any, sched: DiffusionSchedulerOutput) -> RunnerOutput:
        return executor.execute_step(sched)

    def stop_running(self, executor: Any, request_ids: list[str]) -> None:
        """Nothing to do: the next wave leaves aborted requests out."""

    def wave_steps(self, sched: DiffusionSchedulerOutput) -> int:
        return len(sched.scheduled_ids)

    def pipeline_depth(self, executor: Any) -> int:
        """Step waves are small and many: an executor that queues them (``step_pipeline_depth``, ``mp``) gets the
        next one before the current one's result, hiding the round trip (``omni_core.engine.steps.PipelinedSteps``)."""
        return max(1, int(getattr(executor, "step_pipeline_depth", 1)))


def mode_for(config: Any, pipeline_cls: Any, pipeline_name: str) -> ExecutionStrategy:
    """The strategy of ``config`` (step execution or streaming output -> step mode), checked against the pipeline.
    Streaming output alone stays in request mode for a pipeline that streams previews from its own loop
    (``previews_in_request_mode``: the diffusers backend) and has no step mode."""
    step = config.uses_step_execution
    streaming_only = getattr(config, "streaming_output", False) and not getattr(config, "step_execution", False)
    if step and streaming_only and not pipeline_cls.supports_step_execution \
            and getattr(pipeline_cls, "previews_in_request_mode", False):
        step = False
    mode = StepBatchMode() if step else RequestBatchMode()
    mode.check(pipeline_cls, pipeline_name)
    return mode
