"""Shared bookkeeping of every scheduler: request map, waiting queue, running set, terminal states."""

from __future__ import annotations

import collections
from typing import Collection, Iterable

from omni_core.errors import ConfigError
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched.interface import DiffusionRequestStatus, SchedulerRequestState
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput

S = DiffusionRequestStatus


class BaseScheduler:
    """Request lifecycle; subclasses decide admission (``_admit``) and what a batch key contains.

    Admission avoids head-of-line blocking: an idle scheduler takes the compatibility group of the
    *oldest* waiting request and fills the wave from that group in arrival order, so an incompatible
    request never holds back compatible ones behind it, and (being oldest next time) never starves.
    """

    #: core SamplingParams fields that must match for requests to share a wave; a model's own fields join the
    #: key when their declaration says ``splits_batch`` (see :meth:`batch_key`)
    KEY_FIELDS: tuple[str, ...] = ()

    def __init__(self, max_num_seqs: int = 1, *, starvation_limit: int = 16) -> None:
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={max_num_seqs} is invalid: must be >= 1", field="max_num_seqs")
        self.max_num_running_reqs = max_num_seqs
        self.starvation_limit = starvation_limit
        self._states: dict[str, SchedulerRequestState] = {}
        self._waiting: collections.deque[str] = collections.deque()
        self._running: list[str] = []
        self._finished_since_last: list[str] = []

    # ------------------------------------------------------------------ keys
    def batch_key(self, request: OmniDiffusionRequest) -> tuple:
        """``KEY_FIELDS``, the model fields declared ``splits_batch`` (read from the declarations the pipeline's
        check put on the params: no pipeline import here), whether there is a negative prompt, and what the
        pipeline put in ``request.batch_extra`` (e.g. input image sizes)."""
        sp = request.sampling_params
        has_negative = request.negative_prompt is not None
        model = tuple((f.name, sp.model_fields.get(f.name)) for f in sp.model_field_specs if f.splits_batch)
        return tuple(getattr(sp, f) for f in self.KEY_FIELDS) + model + (has_negative,) + request.batch_extra

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, request: OmniDiffusionRequest) -> str:
        rid = request.request_id
        if rid in self._states:
            raise ValueError(f"request id {rid!r} is already scheduled")
        self._states[rid] = SchedulerRequestState(request=request, batch_key=self.batch_key(request))
        self._waiting.append(rid)
        return rid

    def abort_request(self, request_id: str) -> DiffusionRequestStatus | None:
        """Abort: a waiting request ends now; a running one ends at the next wave boundary."""
        st = self._states.get(request_id)
        if st is None:
            return None
        if st.status in (S.WAITING, S.PREEMPTED):
            self._waiting.remove(request_id)
            self._finish(request_id, S.FINISHED_ABORTED)
            return S.FINISHED_ABORTED
        st.abort_pending = True
        return st.status

    def preempt_request(self, request_id: str) -> None:
        """Move a running request back to the front of the queue (test hook; no engine path uses it)."""
        st = self._states[request_id]
        if st.status != S.RUNNING:
            raise ValueError(f"request {request_id!r} is {st.status.name}, not RUNNING")
        self._running.remove(request_id)
        st.status = S.PREEMPTED
        self._waiting.appendleft(request_id)

    def _finish(self, request_id: str, status: DiffusionRequestStatus, error: str | None = None) -> None:
        st = self._states.pop(request_id)
        st.status, st.error = status, error
        if request_id in self._running:
            self._running.remove(request_id)
        self._finished_since_last.append(request_id)

    def fail_all(self, error: str) -> list[str]:
        """End every request with an error (engine death); returns their ids."""
        ids = list(self._states)
        for rid in ids:
            if rid in self._waiting:
                self._waiting.remove(rid)
            self._finish(rid, S.FINISHED_ERROR, error)
        return ids

    # ------------------------------------------------------------------ scheduling
    def schedule(self, finishing: Collection[str] = ()) -> DiffusionSchedulerOutput:
        """The next wave. ``finishing``: running requests whose last step is in a wave already sent (the
        engine's pipelined step loop); they stay running until their result comes, but are left out of this
        wave and their slots are offered to waiting requests."""
        # requests aborted while running leave at this boundary
        for rid in [r for r in self._running if self._states[r].abort_pending]:
            self._finish(rid, S.FINISHED_ABORTED)
        finishing = [r for r in self._running if r in finishing] if finishing else []
        new = self._admit(len(finishing))
        for rid in new:
            self._waiting.remove(rid)
            self._states[rid].status = S.RUNNING
            self._running.append(rid)
        out = DiffusionSchedulerOutput(
            new_requests=[self._states[r].request for r in new],
            scheduled_ids=[r for r in self._running if r not in finishing] if finishing else list(self._running),
            finished_ids=self._finished_since_last,
            batch_key=self._states[self._running[0]].batch_key if self._running else None,
        )
        self._finished_since_last = []
        return out

    def _admit(self, leaving: int = 0) -> list[str]:
        """Ids of waiting requests to admit into this wave (``leaving``: running ones about to finish)."""
        free = self.max_num_running_reqs - len(self._running) + leaving
        if free <= 0 or not self._waiting:
            return []
        if self._running:
            key = self._states[self._running[0]].batch_key
            oldest = self._states[self._waiting[0]]
            if oldest.batch_key != key and oldest.skipped >= self.starvation_limit:
                return []  # let the running wave drain so the oldest request gets its turn
        else:
            key = self._states[self._waiting[0]].batch_key
        picked = []
        for rid in self._waiting:
            if len(picked) == free:
                break
            if self._states[rid].batch_key == key:
                picked.append(rid)
        if picked:
            for rid in self._waiting:
                if self._states[rid].batch_key != key:
                    self._states[rid].skipped += 1
        return picked

    def update_from_output(self, sched_output: DiffusionSchedulerOutput, output: RunnerOutput
                           ) -> dict[str, DiffusionRequestStatus]:
        """Apply a wave's results; returns the requests that ended and how."""
        ended: dict[str, DiffusionRequestStatus] = {}
        for rid in sched_output.scheduled_ids:
            st = self._states.get(rid)
            if st is None:
                continue
            out: DiffusionOutput | None = output.outputs.get(rid)
            if out is None:
                if rid not in output.held_ids:  # the runner lost it: never leave it hanging
                    self._finish(rid, S.FINISHED_ERROR, "the runner returned no output for this request")
                    ended[rid] = S.FINISHED_ERROR
                continue
            if not out.finished:
                continue
            status = {"completed": S.FINISHED_COMPLETED, "aborted": S.FINISHED_ABORTED}.get(out.status, S.FINISHED_ERROR)
            self._finish(rid, status, out.error)
            ended[rid] = status
        return ended

    # ------------------------------------------------------------------ introspection
    def get_status(self, request_id: str) -> DiffusionRequestStatus | None:
        st = self._states.get(request_id)
        return st.status if st else None

    def has_requests(self) -> bool:
        return bool(self._states)

    def has_work(self) -> bool:
        """Requests to run, or ended ones whose release the executor has not been told about yet."""
        return bool(self._states or self._finished_since_last)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def tracked_ids(self) -> set[str]:
        return set(self._states) | set(self._finished_since_last)

    def request_ids(self) -> Iterable[str]:
        return list(self._states)
