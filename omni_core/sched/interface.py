"""Request states and the data that crosses the scheduler / engine / executor boundary."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest


class DiffusionRequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    #: only reachable through ``BaseScheduler.preempt_request`` (tests and custom policies)
    PREEMPTED = 2
    FINISHED_COMPLETED = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def finished(self) -> bool:
        return self >= DiffusionRequestStatus.FINISHED_COMPLETED


@attrs.define(eq=False)
class SchedulerRequestState:
    request: OmniDiffusionRequest
    batch_key: tuple
    status: DiffusionRequestStatus = DiffusionRequestStatus.WAITING
    error: str | None = None
    #: scheduling rounds this request waited while others were admitted (for starvation control)
    skipped: int = 0
    #: set by ``abort_request`` on a running request; finalised at the next boundary
    abort_pending: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id


@attrs.define
class DiffusionSchedulerOutput:
    """One wave: what the executor runs next. The only scheduling result the engine consumes."""

    #: requests admitted in this wave (step mode: need ``prepare_encode``)
    new_requests: list[OmniDiffusionRequest] = attrs.field(factory=list)
    #: every request id in the wave, in order (includes new ones)
    scheduled_ids: list[str] = attrs.field(factory=list)
    #: ids that ended since the last wave (aborted or failed); workers drop their state
    finished_ids: list[str] = attrs.field(factory=list)
    #: the wave's compatibility key
    batch_key: tuple | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_ids


@attrs.define
class RunnerOutput:
    """What the executor returns for a wave (from rank 0)."""

    #: final or intermediate outputs by request id
    outputs: dict[str, DiffusionOutput] = attrs.field(factory=dict)
    #: request ids the runner (all ranks) still holds state for, after this wave
    held_ids: set[str] = attrs.field(factory=set)
    metrics: dict[str, Any] = attrs.field(factory=dict)
