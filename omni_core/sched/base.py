"""Shared bookkeeping of every scheduler: request map, waiting queue, running set, terminal states, and the
built-in policy: priorities, preemption between steps, cost-capped waves (docs/scheduling.md)."""

from __future__ import annotations

import bisect
from typing import Collection, Iterable

from omni_core.errors import ConfigError
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched.capacity import fit_pixels
from omni_core.sched.cost import StepCostModel, request_tokens
from omni_core.sched.interface import DiffusionRequestStatus, SchedulerInterface, SchedulerRequestState
from omni_core.waves import DiffusionSchedulerOutput, RunnerOutput

S = DiffusionRequestStatus


class BaseScheduler(SchedulerInterface):
    """Request lifecycle; subclasses decide admission (``_admit``) and what a batch key contains.

    Admission avoids head-of-line blocking: an idle scheduler takes the compatibility group of the
    *first* waiting request (by priority, then arrival) and fills the wave from that group in that order, so
    an incompatible request never holds back compatible ones behind it, and (being first next time) never
    starves. With equal priorities "first" is "oldest".

    Priorities (``SamplingParams.priority``, lower first): a more urgent waiting request of another shape stops
    less urgent ones from joining the running wave, so it drains; where the scheduler ``can_preempt`` (step mode),
    less urgent running requests are preempted between steps to make room (the whole wave for another shape),
    each at most ``max_preemptions`` times. A preempted request keeps its step state on the worker and resumes
    where it stopped. ``step_time_budget_s`` caps a wave at what fits one step of that many seconds, by the
    per-step cost learned from the waves run so far (:class:`~omni_core.sched.cost.StepCostModel`).
    """

    #: core SamplingParams fields that must match for requests to share a wave; a model's own fields join the
    #: key when their declaration says ``splits_batch`` (see :meth:`batch_key`)
    KEY_FIELDS: tuple[str, ...] = ()
    #: running requests can be set aside between waves (step mode); a request-mode wave runs to completion
    can_preempt: bool = False
    #: denoising steps one wave runs per request (step mode: 1; request mode: the whole request)
    steps_per_wave_is_one: bool = True

    def __init__(self, max_num_seqs: int = 1, *, starvation_limit: int = 16, max_preemptions: int = 4,
                 step_time_budget_s: float | None = None) -> None:
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs={max_num_seqs} is invalid: must be >= 1", field="max_num_seqs")
        self.max_num_running_reqs = max_num_seqs
        self.starvation_limit = starvation_limit
        self.max_preemptions = max_preemptions
        self.step_time_budget_s = step_time_budget_s
        #: pixel-frames one wave may carry (None: no cap; set by ``configure`` when max_num_seqs is unset)
        self.max_wave_pixels: int | None = None
        #: learned seconds per request-step by shape class
        self.cost = StepCostModel()
        self._key_tokens: dict[tuple, int] = {}
        self._seq = 0
        #: preemptions so far (``engine.stats()["requests_preempted"]``)
        self.num_preemptions = 0
        self._finishing: set[str] = set()
        self._states: dict[str, SchedulerRequestState] = {}
        #: waiting ids kept in priority, then arrival order (``_rank``), so no wave sorts the queue
        self._waiting: list[str] = []
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
        key = self.batch_key(request)
        self._seq += 1
        self._states[rid] = SchedulerRequestState(request=request, batch_key=key, seq=self._seq,
                                                  priority=getattr(request.sampling_params, "priority", 0) or 0)
        self._key_tokens.setdefault(key, request_tokens(request))
        bisect.insort(self._waiting, rid, key=self._rank)
        return rid

    def configure(self, config: object) -> None:
        """Take the policy knobs of an engine config (``max_preemptions``, ``step_time_budget_s``); the engine
        calls this after building the scheduler, so a plugin's constructor needs only the capacity."""
        from omni_core.sched.capacity import wave_limits

        self.max_preemptions = getattr(config, "max_preemptions", self.max_preemptions)
        self.step_time_budget_s = getattr(config, "step_time_budget_s", self.step_time_budget_s)
        self.max_wave_pixels = wave_limits(config)[1]

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
        """Move a running request back to waiting (``PREEMPTED``); it keeps its place by priority and arrival,
        and the runner keeps its step state, so it resumes where it stopped."""
        st = self._states[request_id]
        if st.status != S.RUNNING:
            raise ValueError(f"request {request_id!r} is {st.status.name}, not RUNNING")
        self._running.remove(request_id)
        st.status = S.PREEMPTED
        st.preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self._waiting, request_id, key=self._rank)

    def _finish(self, request_id: str, status: DiffusionRequestStatus, error: str | None = None) -> None:
        st = self._states.pop(request_id)
        st.status, st.error = status, error
        if request_id in self._running:
            self._running.remove(request_id)
        if request_id in self._waiting:  # preempted with a wave still in flight that turned out to be its last
            self._waiting.remove(request_id)
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
        finishing = [r for r in self._running if r in finishing] if finishing else []
        self._finishing = set(finishing)
        # requests aborted while running leave at this boundary, but one whose last step is already in flight
        # ends with that step's output (as in-process: a request that completes in its last wave completes)
        for rid in [r for r in self._running if self._states[r].abort_pending and r not in self._finishing]:
            self._finish(rid, S.FINISHED_ABORTED)
        if self.can_preempt and self.max_preemptions > 0 and self._waiting and self._running:
            for rid in self._victims():
                self.preempt_request(rid)
        new = self._admit(len(finishing))
        if new:  # a turn passed over for the waiting requests of other shapes (the starvation limit)
            key = self._states[new[0]].batch_key
            for rid in self._waiting:
                if self._states[rid].batch_key != key:
                    self._states[rid].skipped += 1
        for rid in new:
            self._waiting.remove(rid)
            self._states[rid].status = S.RUNNING
            self._running.append(rid)
        resumed = {r for r in new if self._states[r].started}  # the runner holds their state: not encoded again
        for rid in new:
            self._states[rid].started = True
        scheduled = self._active()
        if scheduled:  # one shape per wave (a request the engine wrongly expected to finish may come back)
            key = self._states[scheduled[0]].batch_key
            scheduled = [r for r in scheduled if self._states[r].batch_key == key]
        out = DiffusionSchedulerOutput(
            new_requests=[self._states[r].request for r in new if r not in resumed],
            scheduled_ids=scheduled,
            finished_ids=self._finished_since_last,
            batch_key=self._states[scheduled[0]].batch_key if scheduled else None,
        )
        self._finished_since_last = []
        return out

    def would_start(self, finishing: Collection[str] = ()) -> bool:
        """Whether a wave scheduled now would start or resume a waiting request, preempt a running one or end
        an aborted one, changing nothing. The engine's pipelined step loop asks when a request arrives or is
        aborted while a wave is queued behind the running one, to send a wave that replaces the queued one so
        the change takes effect at the next step boundary (``DiffusionSchedulerOutput.replaces_queued``).
        It asks ``_victims`` and ``_admit``, which must change nothing; a subclass that replaces ``schedule`` with
        another policy should answer for that policy here (or return False: its requests then start one queued
        step later)."""
        saved, self._finishing = self._finishing, {r for r in self._running if r in finishing}
        try:
            if any(self._states[r].abort_pending for r in self._active()):
                return True
            if not self._waiting:
                return False
            if self.can_preempt and self.max_preemptions > 0 and self._running and self._victims():
                return True
            return bool(self._admit(len(self._finishing)))
        finally:
            self._finishing = saved

    # ------------------------------------------------------------------ policy
    def _rank(self, rid: str) -> tuple[int, int]:
        st = self._states[rid]
        return st.priority, st.seq

    def _order(self) -> list[str]:
        """Waiting ids by priority, then arrival (a preempted request keeps its arrival). A copy of the queue,
        which is kept in that order (``_rank``: a request's priority and arrival never change while it waits)."""
        return list(self._waiting)

    def _active(self) -> list[str]:
        """Running ids that the next wave continues (not those whose last step is already in flight)."""
        return [r for r in self._running if r not in self._finishing]

    def wave_capacity(self, key: tuple) -> int:
        """How many requests of shape ``key`` one wave may hold: ``max_num_seqs``, or fewer where the learned
        per-step cost says more would not fit ``step_time_budget_s`` or (batching by default) their pixels
        would exceed the wave's pixel budget (:mod:`omni_core.sched.capacity`)."""
        tokens = self._key_tokens.get(key, 1)
        return fit_pixels(self.cost.max_batch(key, tokens, self.step_time_budget_s, self.max_num_running_reqs),
                          tokens, self.max_wave_pixels)

    def _victims(self) -> list[str]:
        """Running requests to preempt so more urgent waiting ones start in this wave: for the first waiting
        request of another shape, the whole wave (only if every one of them is less urgent and may still be
        preempted); for requests of the wave's shape, the least urgent running ones, one per slot needed."""
        active = self._active()
        if not active:
            return []
        states = self._states
        order = self._order()
        head = states[order[0]]
        key = states[active[0]].batch_key

        def preemptible(rid: str) -> bool:
            st = states[rid]
            return st.preemptions < self.max_preemptions and not st.abort_pending

        if head.batch_key != key:
            if all(states[r].priority > head.priority and preemptible(r) for r in active):
                return active
            return []
        pool = sorted((r for r in active if preemptible(r)), key=lambda r: (states[r].priority, states[r].seq))
        room = self.wave_capacity(key) - len(active)
        victims: list[str] = []
        for rid in order:
            w = states[rid]
            if w.batch_key != key:
                continue
            if room > 0:  # admitted without preempting anyone
                room -= 1
                continue
            need = 1 - room
            if len(pool) >= need and all(states[v].priority > w.priority for v in pool[-need:]):
                victims += pool[-need:]
                del pool[-need:]
                room = 0
            else:
                break
        return victims

    def _admit(self, leaving: int = 0) -> list[str]:
        """Ids of waiting requests to admit into this wave (``leaving``: running ones about to finish). Changes
        nothing (``would_start`` asks it too); ``schedule`` admits them."""
        if not self._waiting:
            return []
        states = self._states
        order = self._order()
        head = states[order[0]]
        active = self._active()
        bar = None  # only requests at least this urgent may join
        if active:
            key = states[active[0]].batch_key
            if head.batch_key != key:
                if head.skipped >= self.starvation_limit:
                    return []  # let the running wave drain so the first request gets its turn
                if head.priority < max(states[r].priority for r in active):
                    bar = head.priority  # a more urgent request of another shape waits for this wave to drain
        else:
            key = head.batch_key
        free = self.wave_capacity(key) - len(self._running) + leaving
        if free <= 0:
            return []
        picked = []
        for rid in order:
            if len(picked) == free:
                break
            st = states[rid]
            if st.batch_key == key and (bar is None or st.priority <= bar):
                picked.append(rid)
        return picked

    def observe_wave(self, sched: DiffusionSchedulerOutput, seconds: float) -> None:
        """Learn the per-step cost of the wave's shape from one measured wave (the engine calls this with the
        wave's denoising time, or its wall time)."""
        if not sched.scheduled_ids or sched.batch_key is None:
            return
        steps = 1
        if not self.steps_per_wave_is_one:
            st = self._states.get(sched.scheduled_ids[0])
            req = st.request if st else next((r for r in sched.new_requests), None)
            steps = max(1, (req.sampling_params.num_inference_steps or 1) if req else 1)
        key = sched.batch_key
        self.cost.observe(key, self._key_tokens.get(key, 1), len(sched.scheduled_ids), seconds / steps)

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
            status = S.of_output(out.status)
            out.metrics["preemptions"] = st.preemptions
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
