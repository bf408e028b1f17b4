"""Schedulers: request states, shared bookkeeping, and the built-in ``request`` and ``step`` policies.

The waves they produce and consume (``DiffusionSchedulerOutput``, ``RunnerOutput``) live in ``omni_core.waves``.
"""

from omni_core.sched.base import BaseScheduler
from omni_core.sched.interface import DiffusionRequestStatus, SchedulerInterface, SchedulerRequestState
from omni_core.sched.request_scheduler import RequestScheduler
from omni_core.sched.step_scheduler import StepScheduler

__all__ = ["BaseScheduler", "DiffusionRequestStatus", "RequestScheduler", "SchedulerInterface", "SchedulerRequestState", "StepScheduler"]
