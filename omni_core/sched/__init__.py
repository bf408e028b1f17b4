"""Schedulers: request states, shared bookkeeping, and the built-in ``request`` and ``step`` policies."""

from omni_core.sched.base import BaseScheduler
from omni_core.sched.interface import (
    DiffusionRequestStatus,
    DiffusionSchedulerOutput,
    RunnerOutput,
    SchedulerRequestState,
)
from omni_core.sched.request_scheduler import RequestScheduler
from omni_core.sched.step_scheduler import StepScheduler

__all__ = ["BaseScheduler", "DiffusionRequestStatus", "DiffusionSchedulerOutput", "RequestScheduler", "RunnerOutput",
           "SchedulerRequestState", "StepScheduler"]
