"""The pipelined step loop (``DiffusionEngine._pipelined_loop``): with the ``mp`` executor, step wave N+1 is sent
before wave N's result is read. Results must not change: the same pixels as in-process step mode for requests
joining at different steps, failures and aborts confined to their request, and a request that runs more steps
than the engine expects (so it guesses its end wrong) still completes correctly."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from omni_core import Omni, SamplingParams
from omni_core.request import OmniDiffusionRequest
from omni_core.testing import abort_after_steps

pytestmark = pytest.mark.dist

STEPS = {"num_inference_steps": 6, "guidance_scale": 2.5}


def pixels(out):
    return np.stack([np.asarray(im, dtype=np.int16) for im in out.images])


def staggered(omni, prompts, extra=None):
    """Submit one request per prompt, each after the previous has run a step; returns the final outputs."""
    engine = omni.engine
    handles = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams.from_kwargs(seed=20 + i, **STEPS, extra_args={"sleep_per_step": 0.02,
                                                                             **(extra or {}).get(i, {})})
        req = engine.prepare_request(OmniDiffusionRequest(prompt=prompt, sampling_params=params))
        started = threading.Event()
        (handle,) = engine.submit([req], on_progress=lambda rid, step, total, e=started: e.set())
        handles.append(handle)
        assert started.wait(60), "a request must start within 60 s"
    return [h.result(timeout=120) for h in handles]


@pytest.fixture(scope="module")
def reference(tiny_model):
    with Omni(tiny_model, step_execution=True, max_num_seqs=4, warmup=False, cpu_threads=1) as omni:
        return staggered(omni, ["a red circle", "a blue square", "a green cross"], {1: {"extra_steps": 2}})


@pytest.fixture(scope="module")
def pipelined(tiny_model):
    with Omni(tiny_model, executor="mp", step_execution=True, max_num_seqs=4, warmup=False) as omni:
        assert omni.engine.mode.pipeline_depth(omni.engine.executor) == 2
        yield omni


def test_pipelined_waves_give_the_in_process_pixels(pipelined, reference):
    outs = staggered(pipelined, ["a red circle", "a blue square", "a green cross"], {1: {"extra_steps": 2}})
    assert [o.status for o in outs] == ["completed"] * 3
    assert outs[1].metrics["steps_run"] == 8  # 6 asked + 2 the engine could not foresee
    for a, b in zip(outs, reference):
        assert np.array_equal(pixels(a), pixels(b))
    assert pipelined.stats()["tracked_requests"] == []


def test_a_failure_stays_with_its_request(pipelined):
    outs = staggered(pipelined, ["ok one", "fails", "ok two"], {1: {"fail_at_step": 2}})
    assert [o.status for o in outs] == ["completed", "error", "completed"]
    assert "injected failure at step 2" in outs[1].error
    assert pipelined.stats()["tracked_requests"] == []


def test_abort_ends_a_running_request_within_two_steps(pipelined):
    engine = pipelined.engine
    req = OmniDiffusionRequest(prompt="slow", sampling_params=SamplingParams(
        num_inference_steps=200, extra_args={"sleep_per_step": 0.05}))
    handle, at_abort = abort_after_steps(engine, req)
    out = handle.result(timeout=60)
    assert out.status == "aborted" and out.metrics["steps_run"] <= at_abort + 3
    deadline = time.monotonic() + 10
    while pipelined.stats()["tracked_requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pipelined.stats()["tracked_requests"] == []


def test_wave_time_is_not_counted_twice(pipelined):
    before = pipelined.engine.wave_timing()
    t0 = time.perf_counter()
    pipelined.generate(["a", "b", "c", "d"], num_inference_steps=8, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = pipelined.engine.wave_timing()
    assert after["waves"] - before["waves"] >= 8
    assert after["wave_s"] - before["wave_s"] <= wall  # overlapping waves count from the previous one's end
