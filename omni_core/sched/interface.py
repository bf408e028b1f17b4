"""Request states as a scheduler tracks them (the wave types are in ``omni_core.waves``)."""

from __future__ import annotations

import enum

import attrs

from omni_core.request import OmniDiffusionRequest


class DiffusionRequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    #: a running step-mode request moved back to waiting by a more urgent one; its step state stays on the worker
    #: and it resumes where it stopped (``BaseScheduler.preempt_request``, docs/scheduling.md)
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
    #: lower runs first (``SamplingParams.priority``)
    priority: int = 0
    #: arrival order (ties between equal priorities)
    seq: int = 0
    #: times this request was preempted (bounded by ``max_preemptions``)
    preemptions: int = 0
    #: admitted once: the runner holds its step state, so a resumed request is not encoded again
    started: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id
