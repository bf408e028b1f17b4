"""The built-in scheduling policy on its own (no engine): priority order, preemption and its bound, the learned
per-step cost cap; and a third-party scheduler plugin replacing the policy through the hook."""

from __future__ import annotations

import sys
import time
import types

import pytest

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.errors import ConfigError
from omni_core.outputs import DiffusionOutput
from omni_core.request import OmniDiffusionRequest
from omni_core.sched import DiffusionRequestStatus as S
from omni_core.sched import RequestScheduler, StepScheduler
from omni_core.sched.cost import StepCostModel
from omni_core.waves import RunnerOutput


def req(rid, priority=0, size=16, steps=4):
    return OmniDiffusionRequest(prompt=rid, request_id=rid, sampling_params=SamplingParams(
        height=size, width=size, num_inference_steps=steps, seed=0, priority=priority))


def step(s, wave):
    """Apply a wave in which every scheduled request ran one step and none finished."""
    s.update_from_output(wave, RunnerOutput(outputs={r: DiffusionOutput(r, finished=False)
                                                     for r in wave.scheduled_ids}, held_ids=set(wave.scheduled_ids)))


def test_waiting_requests_run_by_priority_then_arrival():
    s = RequestScheduler(max_num_seqs=2)
    for rid, prio in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5)]:
        s.add_request(req(rid, prio))
    waves = []
    while s.has_requests():
        wave = s.schedule()
        waves.append(wave.scheduled_ids)
        s.update_from_output(wave, RunnerOutput(outputs={r: DiffusionOutput(r) for r in wave.scheduled_ids}))
    assert waves == [["c", "a"], ["d", "b"], ["e"]]


def test_request_mode_never_preempts():
    s = RequestScheduler(max_num_seqs=1)
    s.add_request(req("low", 5))
    assert s.schedule().scheduled_ids == ["low"]
    s.add_request(req("high", 0))
    assert s.schedule().scheduled_ids == ["low"] and s.num_preemptions == 0


def test_an_urgent_request_takes_the_slot_of_the_least_urgent_and_the_victim_resumes_without_re_encoding():
    s = StepScheduler(max_num_seqs=2)
    s.add_request(req("a", 3))
    s.add_request(req("b", 3))
    step(s, s.schedule())
    s.add_request(req("h", 0))
    wave = s.schedule()
    assert wave.scheduled_ids == ["a", "h"] and [r.request_id for r in wave.new_requests] == ["h"]
    assert s.get_status("b") == S.PREEMPTED
    step(s, wave)
    s.update_from_output(s.schedule(), RunnerOutput(outputs={"a": DiffusionOutput("a", finished=False),
                                                             "h": DiffusionOutput("h")}, held_ids={"a", "b"}))
    wave = s.schedule()
    assert wave.scheduled_ids == ["a", "b"] and wave.new_requests == []  # b resumes: its state is on the worker


def test_another_shape_preempts_the_whole_wave_only_if_all_of_it_is_less_urgent():
    s = StepScheduler(max_num_seqs=2)
    s.add_request(req("a", 3))
    s.add_request(req("b", 1))
    step(s, s.schedule())
    s.add_request(req("h", 2, size=8))  # more urgent than a, not than b: no preemption; a and b drain
    assert s.schedule().scheduled_ids == ["b", "a"]  # admitted by priority
    s.add_request(req("u", 0, size=8))  # more urgent than both: the wave makes way
    wave = s.schedule()
    assert wave.scheduled_ids == ["u", "h"] and s.num_preemptions == 2


def test_without_preemption_a_more_urgent_request_of_another_shape_stops_less_urgent_ones_joining():
    s = StepScheduler(max_num_seqs=3, max_preemptions=0)
    s.add_request(req("a", 3))
    step(s, s.schedule())
    s.add_request(req("h", 0, size=8))
    s.add_request(req("late", 3))  # would join a's wave; h is first in line, so the wave drains instead
    assert s.schedule().scheduled_ids == ["a"] and s.num_preemptions == 0


def test_a_request_of_another_shape_more_urgent_than_part_of_the_wave_stops_less_urgent_ones_joining():
    """The wave runs priorities 1 and 4; ``h`` (another shape, priority 2) is more urgent than part of it, so only
    requests at least as urgent as ``h`` may still join the wave: ``late`` (3) waits, ``keen`` (2) joins."""
    s = StepScheduler(max_num_seqs=4, max_preemptions=0)
    s.add_request(req("a", 1))
    s.add_request(req("b", 4))
    step(s, s.schedule())
    s.add_request(req("h", 2, size=8))
    s.add_request(req("late", 3))
    assert sorted(s.schedule().scheduled_ids) == ["a", "b"], "late joined ahead of a more urgent request"
    s.add_request(req("keen", 2))
    assert sorted(s.schedule().scheduled_ids) == ["a", "b", "keen"]


def test_preemption_is_bounded_per_request():
    s = StepScheduler(max_num_seqs=1, max_preemptions=2)
    s.add_request(req("low", 9))
    step(s, s.schedule())
    for i in range(4):
        s.add_request(req(f"h{i}", 0))
        wave = s.schedule()
        done = {r: DiffusionOutput(r) for r in wave.scheduled_ids if r != "low"}
        s.update_from_output(wave, RunnerOutput(outputs={**done, "low": DiffusionOutput("low", finished=False)},
                                                held_ids={"low"}))
        wave = s.schedule()  # h_i done: low resumes (or kept running)
        step(s, wave)
    assert s._states["low"].preemptions == 2 and s.num_preemptions == 2


def test_cost_model_learns_per_shape_and_caps_a_wave_to_the_budget():
    m = StepCostModel(alpha=1.0)
    assert m.max_batch(("big",), 4096, 0.1, 8) == 8  # nothing measured: no cap
    m.observe(("big",), 4096, 4, 0.2)  # 50 ms per request-step
    assert m.max_batch(("big",), 4096, 0.1, 8) == 2
    assert m.max_batch(("small",), 256, 0.1, 8) == 8  # unseen shape: from seconds per token, 256/4096 of it
    assert m.max_batch(("big",), 4096, None, 8) == 8  # no budget: no cap

    s = StepScheduler(max_num_seqs=8, step_time_budget_s=0.05)
    for i in range(4):
        s.add_request(req(f"r{i}"))
    wave = s.schedule()
    assert len(wave.scheduled_ids) == 4  # nothing learned yet: max_num_seqs is the only limit
    s.observe_wave(wave, 0.08)  # 20 ms per request-step: 2 fit the 50 ms budget
    step(s, wave)
    s.add_request(req("late"))
    assert len(s.schedule().scheduled_ids) == 4  # over the cap: no one joins, no one is preempted for cost
    s.update_from_output(s.schedule(), RunnerOutput(outputs={f"r{i}": DiffusionOutput(f"r{i}") for i in range(4)}))
    for i in range(4):
        s.add_request(req(f"n{i}"))
    assert s.schedule().scheduled_ids == ["late", "n0"]  # a fresh wave of that shape is capped at 2
    s2 = StepScheduler(max_num_seqs=8)  # no budget (the default): the same measurements change nothing
    for i in range(6):
        s2.add_request(req(f"r{i}"))
    s2.observe_wave(s2.schedule(), 10.0)
    s2.add_request(req("late"))
    assert len(s2.schedule().scheduled_ids) == 7


def test_policy_knobs_are_checked():
    with pytest.raises(ConfigError, match="max_preemptions"):
        OmniDiffusionConfig(model="x", max_preemptions=-1)
    with pytest.raises(ConfigError, match="step_time_budget_s"):
        OmniDiffusionConfig(model="x", step_time_budget_s=0.0)
    with pytest.raises(ConfigError, match="timeout"):
        SamplingParams(timeout=0)
    with pytest.raises(ConfigError, match="priority"):
        SamplingParams(priority=1.5)


class ArrivalOnlyScheduler(StepScheduler):
    """A third-party policy: strict arrival order, priorities ignored, nothing preempted."""

    can_preempt = False

    def _order(self):
        return sorted(self._waiting, key=lambda r: self._states[r].seq)


def test_a_scheduler_plugin_replaces_the_built_in_policy(tiny_model, register_omni_plugin):
    from omni_core import Omni, hookimpl
    from omni_core.plugins.types import SchedulerSpec

    module = types.ModuleType("omni_sched_arrival_plugin")
    module.ArrivalOnlyScheduler = ArrivalOnlyScheduler

    @hookimpl
    def omni_register_schedulers():
        return [SchedulerSpec(name="arrival", impl="omni_sched_arrival_plugin:ArrivalOnlyScheduler",
                              description="arrival order only")]

    module.omni_register_schedulers = omni_register_schedulers
    sys.modules[module.__name__] = module
    try:
        register_omni_plugin(module, "omni-scheduler-arrival")
        with Omni(tiny_model, step_execution=True, scheduler="arrival", max_num_seqs=1, warmup=False,
                  cpu_threads=1) as omni:
            engine = omni.engine
            assert type(engine.scheduler).__name__ == "ArrivalOnlyScheduler"
            low = OmniDiffusionRequest(prompt="low", sampling_params=SamplingParams(
                seed=0, num_inference_steps=6, priority=9, extra_args={"sleep_per_step": 0.02}))
            (h_low,) = engine.submit([low])
            while engine.stats()["denoise_steps"] < 1:
                time.sleep(0.002)
            high = OmniDiffusionRequest(prompt="high", sampling_params=SamplingParams(
                seed=1, num_inference_steps=2, priority=0))
            (h_high,) = engine.submit([high])
            out_high, out_low = h_high.result(timeout=60), h_low.result(timeout=60)
            assert out_high.status == out_low.status == "completed"
            assert out_low.metrics["preemptions"] == 0 and engine.stats()["requests_preempted"] == 0
            # the urgent request ran only after every step of the low-priority one: the plugin's order, not the
            # built-in scheduler's (which would have preempted it)
            calls = [dict(c) for c in engine.executor.runner.pipeline.denoise_log]
            first_high = next(i for i, c in enumerate(calls) if high.request_id in c)
            last_low = max(i for i, c in enumerate(calls) if low.request_id in c)
            assert first_high > last_low
    finally:
        sys.modules.pop(module.__name__, None)
