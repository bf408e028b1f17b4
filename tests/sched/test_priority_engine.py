"""Priorities, preemption between steps, and deadlines, observed through the engine in both executors.

The preempted request's final image is compared bit for bit with an uninterrupted run of the same requests: a
preempted request keeps its step state on the worker and resumes where it stopped. (The tiny model's bits depend
on the batch size, ~1e-7, so each scenario keeps the preempted request at the same batch size as its reference.)
"""

from __future__ import annotations

import time

import pytest
import torch

from omni_core import Omni, SamplingParams
from omni_core.request import OmniDiffusionRequest

STEP_S = 0.04  # sleep per denoising step: steps are at least this long, so step counts bound the time


def req(name, priority, steps, seed, size=16, request_id=None, **extra):
    ids = {"request_id": request_id} if request_id else {}
    return OmniDiffusionRequest(prompt=name, **ids, sampling_params=SamplingParams(
        seed=seed, num_inference_steps=steps, priority=priority, output_type="pt", height=size, width=size,
        extra_args={"sleep_per_step": STEP_S}, **extra))


@pytest.fixture(scope="module", params=["uni", "mp"])
def engine(request, tiny_model):
    with Omni(tiny_model, step_execution=True, max_num_seqs=2, warmup=False, cpu_threads=1,
              executor=request.param, max_preemptions=1) as omni:
        yield omni.engine


class Events:
    """Progress events in order: (request name, step)."""

    def __init__(self):
        self.log, self.names = [], {}

    def __call__(self, rid, step, total):
        self.log.append((self.names.get(rid, rid), step))

    def submit(self, engine, **named):
        handles = engine.submit(list(named.values()), on_progress=self)
        for name, r in named.items():
            self.names[r.request_id] = name
        return handles

    def steps_of(self, name):
        return [s for n, s in self.log if n == name]

    def wait_steps(self, name, n, timeout=60):
        deadline = time.monotonic() + timeout
        while len(self.steps_of(name)) < n:
            assert time.monotonic() < deadline, f"{name} did not reach {n} steps"
            time.sleep(0.002)


def results(handles):
    return [h.result(timeout=120) for h in handles]


def assert_nothing_left(engine):
    deadline = time.monotonic() + 10
    while engine.stats()["tracked_requests"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert stats["tracked_requests"] == [] and stats["waiting"] == 0 and stats["running"] == 0


def test_an_urgent_request_preempts_the_least_urgent_and_it_resumes_bit_identical(engine):
    ref_a, ref_b = results(engine.submit([req("a", 5, 12, 1), req("b", 5, 8, 2)]))
    before = engine.stats()["requests_preempted"]
    ev = Events()
    a, b = ev.submit(engine, a=req("a", 5, 12, 1), b=req("b", 5, 8, 2))
    ev.wait_steps("a", 3)
    time.sleep(STEP_S / 2)  # mid-step: with mp the next wave is queued behind the running one by now
    at_submit = len(ev.steps_of("a"))
    replaced = engine.stats()["step_waves_replaced"]
    (h,) = ev.submit(engine, h=req("h", 0, 3, 3))
    out_h, out_a, out_b = results([h, a, b])
    if engine.config.executor == "mp":  # h came in a wave that replaced the queued one, whose step was skipped
        assert engine.stats()["step_waves_replaced"] == replaced + 1
    assert out_h.status == out_a.status == out_b.status == "completed"
    # the urgent request is in the wave after the one running when it arrived (with mp, whose pipelined loop had
    # the next wave queued already, a wave replacing the queued one): before h's first event come a's events up
    # to then, the running wave's, and a's own in h's first wave
    a_steps_before_h = sum(1 for n, _ in ev.log[:ev.log.index(("h", 1))] if n == "a")
    assert a_steps_before_h <= at_submit + 1 + 1, ev.log
    # b (same priority as a, later arrival) made way: it ran no step while h ran, then resumed where it stopped
    h_span = [i for i, e in enumerate(ev.log) if e[0] == "h"]
    assert not [e for e in ev.log[h_span[0]:h_span[-1]] if e[0] == "b"], ev.log
    assert ev.steps_of("b") == list(range(1, 9)) and ev.steps_of("a") == list(range(1, 13))
    assert out_b.metrics["preemptions"] == 1 and out_a.metrics["preemptions"] == 0
    assert engine.stats()["requests_preempted"] == before + 1
    assert torch.equal(out_b.tensor, ref_b.tensor)  # bit for bit
    assert_nothing_left(engine)


def test_an_urgent_request_of_another_shape_preempts_the_whole_wave(engine):
    ref_a, ref_b = results(engine.submit([req("a", 5, 10, 1), req("b", 5, 10, 2)]))
    ev = Events()
    a, b = ev.submit(engine, a=req("a", 5, 10, 1), b=req("b", 5, 10, 2))
    ev.wait_steps("a", 3)
    at_submit = len(ev.steps_of("a"))
    (h,) = ev.submit(engine, h=req("h", 0, 3, 3, size=8))
    out_h, out_a, out_b = results([h, a, b])
    assert out_h.status == out_a.status == out_b.status == "completed"
    a_steps_before_h = sum(1 for n, _ in ev.log[:ev.log.index(("h", 1))] if n == "a")
    assert a_steps_before_h <= at_submit + 1 + 1, ev.log
    h_span = [i for i, e in enumerate(ev.log) if e[0] == "h"]
    assert not [e for e in ev.log[h_span[0]:h_span[-1]] if e[0] != "h"], ev.log  # h ran alone
    assert out_a.metrics["preemptions"] == out_b.metrics["preemptions"] == 1
    assert torch.equal(out_a.tensor, ref_a.tensor) and torch.equal(out_b.tensor, ref_b.tensor)
    assert_nothing_left(engine)


def test_an_aborted_running_request_ends_at_the_next_step_boundary(engine):
    """The aborted request's final output comes at once (mp: a wave replacing the queued one leaves it out), the
    other keeps running, and a lone running request aborted the same way ends too."""
    ev = Events()
    replaced = engine.stats()["step_waves_replaced"]
    a, b = ev.submit(engine, a=req("a", 5, 40, 1), b=req("b", 5, 40, 2))
    for handle, name, other in ((a, "a", b), (b, "b", None)):
        ev.wait_steps(name, len(ev.steps_of(name)) + 3)
        time.sleep(STEP_S / 2)  # mid-step: with mp the next wave is queued behind the running one by now
        at_abort = len(ev.steps_of(name))
        t0 = time.monotonic()
        handle.abort()
        out = handle.result(timeout=60)
        assert out.status == "aborted" and out.metrics["steps_run"] <= at_abort + 1
        assert time.monotonic() - t0 < 30 * STEP_S  # generous under load; a wave is ~STEP_S
        if other is not None:
            steps = len(ev.steps_of("b"))
            ev.wait_steps("b", steps + 2)  # b goes on
    assert len(ev.steps_of("a")) < 40 and len(ev.steps_of("b")) < 40
    assert_nothing_left(engine)  # the waves that release them have come back: so have the skipped ones
    if engine.config.executor == "mp":  # each abort replaced the queued wave, which held the aborted request
        assert engine.stats()["step_waves_replaced"] == replaced + 2


def test_an_id_reused_right_after_an_abort_names_a_new_request(engine):
    """The aborted request's output comes before the wave that releases it has returned (mp); a request submitted
    at once under the same id is a new one and runs to completion."""
    ev = Events()
    a, b = ev.submit(engine, a=req("a", 5, 40, 1, request_id="reused"), b=req("b", 5, 8, 2))
    ev.wait_steps("a", 2)
    time.sleep(STEP_S / 2)
    a.abort()
    assert a.result(timeout=60).status == "aborted"
    (again,) = ev.submit(engine, again=req("again", 5, 3, 3, request_id="reused"))
    assert again.result(timeout=60).status == "completed" and b.result(timeout=60).status == "completed"
    assert_nothing_left(engine)


def test_no_request_is_preempted_beyond_the_bound(engine):
    # max_preemptions=1: the first urgent request preempts b, the second a (b is at its bound), the third
    # preempts nobody and waits for a slot
    ev = Events()
    a, b = ev.submit(engine, a=req("a", 5, 24, 1), b=req("b", 5, 24, 2))
    urgent = []
    for i in range(3):
        ev.wait_steps("a", 2 + 4 * i)
        urgent += ev.submit(engine, **{f"h{i}": req(f"h{i}", 0, 2, 10 + i)})
        ev.wait_steps(f"h{i}", 1)
    outs = results([a, b, *urgent])
    assert all(o.status == "completed" for o in outs)
    assert outs[0].metrics["preemptions"] == 1 and outs[1].metrics["preemptions"] == 1
    assert ev.steps_of("a") == list(range(1, 25)) and ev.steps_of("b") == list(range(1, 25))
    assert_nothing_left(engine)


def test_a_request_past_its_timeout_ends_with_a_timeout_error_within_a_step(engine):
    before = engine.stats()
    timeout = 0.3
    running = req("slow", 0, 60, 1, timeout=timeout)
    blockers = [req("x", -1, 30, 2, size=8), req("y", -1, 30, 3, size=8)]
    waiting = req("queued", 5, 4, 4, timeout=timeout)  # behind two more urgent requests of another shape
    (h_run,) = engine.submit([running])
    t0 = time.monotonic()
    while engine.stats()["denoise_steps"] - before["denoise_steps"] < 2:
        time.sleep(0.002)
    hx, hy, h_wait = engine.submit([*blockers, waiting])
    out_run, out_wait = h_run.result(timeout=60), h_wait.result(timeout=60)
    for out in (out_run, out_wait):
        assert out.status == "error" and out.metrics["timed_out"] is True
        assert "timed out" in out.error and "0.3 s" in out.error
    # each step sleeps STEP_S, so at most timeout / STEP_S + 1 steps began before the deadline, and none after it
    # (a watcher thread ends the request at its deadline; mp: a wave replacing the queued one leaves it out)
    for out in (out_run, out_wait):
        assert out.metrics["steps_run"] <= timeout / STEP_S + 1
        assert timeout <= out.metrics["e2e_latency_s"] <= timeout + 10 * STEP_S  # slack for a loaded machine
    hx.abort(), hy.abort()
    results([hx, hy])
    assert_nothing_left(engine)
    stats = engine.stats()
    assert stats["requests_timed_out"] - before["requests_timed_out"] == 2


def test_a_running_request_ends_at_its_deadline_while_the_other_goes_on(engine):
    timeout = 0.3
    replaced = engine.stats()["step_waves_replaced"]
    ev = Events()
    late, other = ev.submit(engine, late=req("late", 5, 60, 1, timeout=timeout), other=req("other", 5, 30, 2))
    out_late = late.result(timeout=60)
    assert out_late.status == "error" and out_late.metrics["timed_out"] is True
    assert out_late.metrics["steps_run"] <= timeout / STEP_S + 1  # none began after the deadline
    assert timeout <= out_late.metrics["e2e_latency_s"] <= timeout + 10 * STEP_S
    assert other.result(timeout=60).status == "completed"
    assert ev.steps_of("other") == list(range(1, 31))
    assert_nothing_left(engine)
    if engine.config.executor == "mp":  # the watcher replaced the queued wave, which held the late request
        assert engine.stats()["step_waves_replaced"] == replaced + 1


def test_the_earliest_deadline_fires_first_whatever_the_order_they_were_set(engine):
    """A request with a 3 s deadline, then one with a 0.3 s deadline: the watcher wakes for the earliest one
    (not the latest), so the second ends at 0.3 s while the first runs on."""
    ev = Events()
    (long_one,) = ev.submit(engine, long=req("long", 5, 200, 1, timeout=3.0))
    ev.wait_steps("long", 1)
    (short,) = ev.submit(engine, short=req("short", 5, 200, 2, timeout=0.3))
    out = short.result(timeout=60)
    long_one.abort()
    # the order, whatever the machine's speed: the short one timed out while the long one still ran (a watcher
    # sleeping until the latest deadline fires both at 3 s, and the long one then times out instead)
    assert long_one.result(timeout=60).status == "aborted"  # its own deadline had not passed
    assert out.status == "error" and out.metrics["timed_out"] is True
    assert 0.3 <= out.metrics["e2e_latency_s"] < 3.0, out.metrics
    assert_nothing_left(engine)


def test_a_timeout_in_request_mode_stops_the_running_request_within_a_step(tiny_model):
    with Omni(tiny_model, max_num_seqs=1, warmup=False, cpu_threads=1) as omni:
        engine = omni.engine
        slow, queued = req("slow", 0, 60, 1, timeout=0.3), req("queued", 0, 4, 2, timeout=0.3)
        h_slow, h_queued = engine.submit([slow, queued])  # capacity 1: queued waits behind slow
        out_slow, out_queued = h_slow.result(timeout=60), h_queued.result(timeout=60)
        assert out_slow.status == out_queued.status == "error"
        assert out_slow.metrics["timed_out"] and out_queued.metrics["timed_out"]
        assert out_slow.metrics["steps_run"] <= 0.3 / STEP_S + 2
        assert_nothing_left(engine)
        with pytest.raises(Exception, match="timed out"):  # Omni.generate raises RequestFailedError
            omni.generate("late", seed=0, num_inference_steps=60, timeout=0.2, extra_args={"sleep_per_step": STEP_S},
                          use_tqdm=False)


@pytest.mark.parametrize("budget, batch", [(None, 4), (1e-4, 1)], ids=["no-budget", "tiny-budget"])
def test_a_step_time_budget_caps_waves_by_the_cost_learned_from_earlier_waves(tiny_model, budget, batch):
    with Omni(tiny_model, step_execution=True, max_num_seqs=4, warmup=False, cpu_threads=1,
              step_time_budget_s=budget) as omni:
        engine = omni.engine

        def run():
            reqs = [OmniDiffusionRequest(prompt=f"r{i}", sampling_params=SamplingParams(seed=i, num_inference_steps=2))
                    for i in range(4)]
            results(engine.submit(reqs))
            ids = {r.request_id for r in reqs}
            return [len([rid for rid, _ in call if rid in ids]) for call in engine.executor.runner.pipeline.denoise_log
                    if any(rid in ids for rid, _ in call)]

        assert run() == [4, 4]  # nothing measured yet: max_num_seqs is the only limit
        assert set(run()) == {batch}  # one step of this shape costs more than 0.1 ms: one request per wave
        assert_nothing_left(engine)


@pytest.fixture(scope="module")
def mp_one_slot(tiny_model):
    with Omni(tiny_model, step_execution=True, max_num_seqs=1, warmup=False, cpu_threads=1, executor="mp") as omni:
        yield omni.engine


def test_a_request_whose_last_step_is_queued_keeps_its_slot_when_another_arrives(mp_one_slot):
    """mp, one slot: x's last step is queued behind the running one when y arrives. Nothing may start early by
    replacing that wave (x would lose its step and share a wave of two with y, over max_num_seqs=1)."""
    engine, ev = mp_one_slot, Events()
    replaced = engine.stats()["step_waves_replaced"]
    (x,) = ev.submit(engine, x=req("x", 5, 6, 1))
    ev.wait_steps("x", 4)
    time.sleep(STEP_S / 2)  # step 5 runs, step 6 (the last) is queued
    (y,) = ev.submit(engine, y=req("y", 5, 3, 2))
    out_x, out_y = results([x, y])
    assert out_x.status == out_y.status == "completed"
    assert out_x.metrics["batch_size"] == 1 and out_y.metrics["batch_size"] == 1  # never a wave of two
    assert ev.steps_of("x") == list(range(1, 7)) and ev.log.index(("x", 6)) < ev.log.index(("y", 1))
    assert engine.stats()["step_waves_replaced"] == replaced
    assert_nothing_left(engine)


def test_an_abort_during_the_last_running_step_keeps_the_finished_image(mp_one_slot):
    """mp: the last step already runs when the abort comes; its output is the request's result, as in-process
    when a request completes in the wave its abort or deadline falls in."""
    engine, ev = mp_one_slot, Events()
    (x,) = ev.submit(engine, x=req("x", 5, 6, 3))
    ev.wait_steps("x", 5)
    time.sleep(STEP_S / 4)  # inside step 6, the last
    x.abort()
    (y,) = ev.submit(engine, y=req("y", 5, 2, 4))  # takes x's slot in the next wave, scheduled at once
    out = x.result(timeout=60)
    assert out.status == "completed" and out.tensor is not None
    assert y.result(timeout=60).status == "completed"
    assert_nothing_left(engine)


def test_only_waves_the_pipelined_loop_sends_ask_the_ranks_to_agree_on_a_skip(engine, monkeypatch):
    """A replica of several ranks broadcasts whether to skip a step wave only where a later wave may replace
    it (mp's pipelined loop); waves run one at a time (in process, data-parallel, Ray) are never replaced."""
    executor, seen = engine.executor, []
    for name in ("send_step", "execute_step"):
        original = getattr(executor, name)
        monkeypatch.setattr(executor, name, lambda sched, _f=original: (seen.append(sched.may_be_replaced), _f(sched))[1])
    (out,) = results(engine.submit([req("a", 5, 4, 1)]))
    assert out.status == "completed"
    assert len(seen) >= 4 and set(seen) == {engine.config.executor == "mp"}
