"""Scheduler policy: lifecycle, compatibility keys, no head-of-line blocking, bounded waiting."""

import pytest

from omni_core.config import SamplingParams
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched import DiffusionRequestStatus as S
from omni_core.sched import RequestScheduler, StepScheduler
from omni_core.waves import RunnerOutput


def req(rid, size=16, steps=4, **kw):
    return OmniDiffusionRequest(prompt=rid, request_id=rid,
                                sampling_params=SamplingParams(height=size, width=size, num_inference_steps=steps,
                                                               seed=0, **kw))


def finish_all(sched, wave):
    out = RunnerOutput(outputs={rid: DiffusionOutput(request_id=rid) for rid in wave.scheduled_ids})
    return sched.update_from_output(wave, out)


def test_lifecycle_and_terminal_states():
    s = RequestScheduler(max_num_seqs=2)
    s.add_request(req("a"))
    with pytest.raises(ValueError, match="already scheduled"):
        s.add_request(req("a"))
    assert s.get_status("a") == S.WAITING
    wave = s.schedule()
    assert wave.scheduled_ids == ["a"] and s.get_status("a") == S.RUNNING
    ended = s.update_from_output(wave, RunnerOutput(outputs={"a": DiffusionOutput("a", status="error", error="x")}))
    assert ended == {"a": S.FINISHED_ERROR}
    assert not s.has_requests()
    assert s.schedule().finished_ids == ["a"]  # reported once so workers can drop state
    assert s.tracked_ids() == set()


def test_abort_waiting_is_immediate_running_at_boundary():
    s = StepScheduler(max_num_seqs=1)
    s.add_request(req("a"))
    s.add_request(req("b"))
    s.schedule()
    assert s.abort_request("b") == S.FINISHED_ABORTED  # was waiting
    assert s.abort_request("a") == S.RUNNING  # running: pending until the next boundary
    wave = s.schedule()
    assert wave.is_empty and set(wave.finished_ids) == {"a", "b"}
    assert not s.has_requests() and s.abort_request("a") is None


def test_preempted_only_through_explicit_call():
    s = StepScheduler(max_num_seqs=1)
    s.add_request(req("a"))
    s.schedule()
    s.preempt_request("a")
    assert s.get_status("a") == S.PREEMPTED
    assert s.schedule().scheduled_ids == ["a"]


def test_step_key_ignores_step_count_request_key_does_not():
    a, b = req("a", steps=4), req("b", steps=9)
    assert StepScheduler().batch_key(a) == StepScheduler().batch_key(b)
    assert RequestScheduler().batch_key(a) != RequestScheduler().batch_key(b)
    assert StepScheduler().batch_key(a) != StepScheduler().batch_key(req("c", size=32))
    assert StepScheduler().batch_key(a) != StepScheduler().batch_key(req("d", guidance_scale=3.0))


def test_no_head_of_line_blocking_in_request_mode():
    s = RequestScheduler(max_num_seqs=4)
    s.add_request(req("s0"))
    s.add_request(req("large", size=64))
    for i in range(1, 9):
        s.add_request(req(f"s{i}"))
    waves = []
    while s.has_requests():
        wave = s.schedule()
        waves.append(wave.scheduled_ids)
        finish_all(s, wave)
    # the incompatible request does not hold back the small ones behind it, and runs as soon as it is oldest
    assert waves == [["s0", "s1", "s2", "s3"], ["large"], ["s4", "s5", "s6", "s7"], ["s8"]]


def test_incompatible_request_waits_a_bounded_number_of_waves_in_step_mode():
    s = StepScheduler(max_num_seqs=2, starvation_limit=5)
    s.add_request(req("s0", steps=3))
    s.add_request(req("s1", steps=3))
    s.add_request(req("large", size=64))
    n = 2
    admitted_at = None
    for wave_no in range(100):
        # a steady stream of small compatible requests that would starve a FIFO-by-key scheduler
        s.add_request(req(f"s{n}", steps=3))
        n += 1
        wave = s.schedule()
        if "large" in wave.scheduled_ids:
            admitted_at = wave_no
            break
        out = RunnerOutput(outputs={rid: DiffusionOutput(rid) for rid in wave.scheduled_ids[:1]},
                           held_ids=set(wave.scheduled_ids[1:]))
        s.update_from_output(wave, out)
    assert admitted_at is not None and admitted_at <= 5 + 3


def test_capacity_and_key_in_step_mode():
    s = StepScheduler(max_num_seqs=3)
    for rid in ["a", "b", "c", "d"]:
        s.add_request(req(rid))
    assert s.schedule().scheduled_ids == ["a", "b", "c"]
    assert s.num_waiting == 1 and s.num_running == 3


def test_bad_capacity_is_a_clear_error():
    with pytest.raises(ValueError, match="max_num_seqs"):
        RequestScheduler(max_num_seqs=0)
