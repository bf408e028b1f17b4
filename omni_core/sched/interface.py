"""Request states as a scheduler tracks them (the wave types are in ``omni_core.waves``)."""

from __future__ import annotations

import enum

import attrs

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
