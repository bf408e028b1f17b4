"""What the engine asks of a scheduler (:class:`SchedulerInterface`) and the request states it tracks (the wave
types are in ``omni_core.waves``)."""

from __future__ import annotations

import abc
import enum
from typing import TYPE_CHECKING, Collection

import attrs

from omni_core.request import OmniDiffusionRequest

if TYPE_CHECKING:  # the wave types' home is omni_core.waves, not this module
    from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput


class DiffusionRequestStatus(enum.StrEnum):
    """A request's status from admission to its final output. The finished values are the spellings of
    ``DiffusionOutput.status`` (``"completed"``, ``"aborted"``, ``"error"``), so the runner's output status, the
    scheduler's and the engine's counters are one status, not a string mapped to an enum and back."""

    WAITING = "waiting"
    RUNNING = "running"
    #: a running step-mode request moved back to waiting by a more urgent one; its step state stays on the worker
    #: and it resumes where it stopped (``BaseScheduler.preempt_request``, docs/scheduling.md)
    PREEMPTED = "preempted"
    FINISHED_COMPLETED = "completed"
    FINISHED_ABORTED = "aborted"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @classmethod
    def of_output(cls, status: str) -> DiffusionRequestStatus:
        """The final status of an output whose ``status`` is ``status`` (anything but completed or aborted is an
        error)."""
        return _FINISHED.get(status, cls.FINISHED_ERROR)

    @property
    def counter(self) -> str:
        """The engine counter a request ending with this status adds to (``engine.stats()``)."""
        return _COUNTERS.get(self, "requests_failed")


_FINISHED = {s.value: s for s in (DiffusionRequestStatus.FINISHED_COMPLETED, DiffusionRequestStatus.FINISHED_ABORTED,
                                  DiffusionRequestStatus.FINISHED_ERROR)}
_COUNTERS = {DiffusionRequestStatus.FINISHED_COMPLETED: "requests_completed",
             DiffusionRequestStatus.FINISHED_ABORTED: "requests_aborted"}


class SchedulerInterface(abc.ABC):
    """Every call the engine makes on a scheduler (a scheduler plugin's class subclasses this, usually through
    :class:`~omni_core.sched.base.BaseScheduler`). The engine builds it with the wave capacity (``cls(capacity)``)
    and calls it under its lock only. The optional members have defaults that opt out."""

    #: running requests set aside so far (``engine.stats()["requests_preempted"]``)
    num_preemptions: int = 0

    @abc.abstractmethod
    def add_request(self, request: OmniDiffusionRequest) -> str: ...

    @abc.abstractmethod
    def abort_request(self, request_id: str) -> DiffusionRequestStatus | None:
        """``FINISHED_ABORTED`` for a request that ended now (it was waiting), its status for a running one (it
        ends at the next wave boundary), None for an unknown id."""

    @abc.abstractmethod
    def schedule(self, finishing: Collection[str] = ()) -> DiffusionSchedulerOutput:
        """The next wave (``finishing``: running ids whose last step is in a wave already sent)."""

    @abc.abstractmethod
    def update_from_output(self, sched_output: DiffusionSchedulerOutput, output: RunnerOutput
                           ) -> dict[str, DiffusionRequestStatus]:
        """Apply a wave's result; the requests that ended and how."""

    @abc.abstractmethod
    def fail_all(self, error: str) -> list[str]:
        """End every request with an error (the engine died or closed)."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """Requests to run, or ended ones whose release the executor has not been told about yet."""

    @abc.abstractmethod
    def tracked_ids(self) -> set[str]: ...

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_running(self) -> int: ...

    def configure(self, config: object) -> None:
        """Take the policy knobs of the engine config, after construction (default: none)."""

    def observe_wave(self, sched: DiffusionSchedulerOutput, seconds: float) -> None:
        """Learn from one measured wave (default: nothing)."""

    def would_start(self, finishing: Collection[str] = ()) -> bool:
        """Whether a wave scheduled now would change what runs, changing nothing (the pipelined step loop sends
        such a wave early). False: changes wait one queued step."""
        return False


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
