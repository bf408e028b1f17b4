"""The wave types: what crosses between the engine, a scheduler and an executor.

A neutral module so that schedulers and executors (and the runner) import it without importing each
other: a scheduler makes a ``DiffusionSchedulerOutput``, an executor runs it and returns a ``RunnerOutput``.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest


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
    #: the engine sent this wave to replace the step wave queued just before it (an urgent request arrived or a
    #: running one ended while that wave waited behind the running one): a worker about to run that wave that
    #: finds this one queued behind it skips the queued wave's step (``RunnerOutput.skipped``). Correct either
    #: way: this wave was scheduled as if the queued one had run, and a skipped step is only run later.
    replaces_queued: bool = False
    #: the pipelined loop sent this wave, so one sent after it may replace it: only then do a replica's ranks
    #: agree whether to skip it (a broadcast per step wave, a device sync with nccl; ``mp_worker``)
    may_be_replaced: bool = False

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
    #: the runner released the wave's ended requests and encoded its new ones but ran no step: the next wave
    #: replaces it (``DiffusionSchedulerOutput.replaces_queued``); its requests made no progress
    skipped: bool = False
