"""Engine behaviour with the in-process executor: determinism, validation, isolation, abort, leaks."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from omni_core import AsyncOmni, Omni, SamplingParams
from omni_core.errors import ConfigError, RequestFailedError
from omni_core.testing import wait_for

PROMPTS = ["a red circle", {"prompt": "a blue square in the top left corner", "negative_prompt": "blurry"}, "x"]


def pixels(out):
    return np.stack([np.asarray(im, dtype=np.int16) for im in out.images])


@pytest.fixture(scope="module")
def omni_request(tiny_model):
    with Omni(tiny_model, max_num_seqs=4) as omni:
        yield omni


@pytest.fixture(scope="module")
def omni_step(tiny_model):
    with Omni(tiny_model, step_execution=True, max_num_seqs=4) as omni:
        yield omni


def test_same_seed_same_images_across_modes_and_batch_sizes(tiny_model, omni_request, omni_step):
    kw = dict(seed=7, guidance_scale=3.0, use_tqdm=False)
    batched = omni_request.generate(PROMPTS, **kw)
    stepped = omni_step.generate(PROMPTS, **kw)
    with Omni(tiny_model, max_num_seqs=1) as serial_engine:
        serial = serial_engine.generate(PROMPTS, **kw)
    for a, b, c in zip(batched, stepped, serial):
        assert np.array_equal(pixels(a), pixels(b)) and np.array_equal(pixels(a), pixels(c))
    assert batched[0].metrics["batch_size"] == 2  # the two compatible prompts ran together
    assert not np.array_equal(pixels(batched[0]), pixels(omni_request.generate(PROMPTS[0], seed=8,
                                                                                guidance_scale=3.0)[0]))


def test_outputs_carry_ids_metrics_and_n_images(omni_request):
    (out,) = omni_request.generate("a cat", num_outputs_per_prompt=3, seed=1, use_tqdm=False)
    assert out.status == "completed" and len(out.images) == 3 and out.images[0].size == (16, 16)
    assert out.request_id and out.metrics["seed"] == 1 and out.metrics["steps_run"] == 4
    assert out.metrics["e2e_latency_s"] >= out.metrics["queue_time_s"] >= 0


@pytest.mark.parametrize("kwargs, field", [
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": -3}, "num_inference_steps"),
    ({"height": 20}, "height"),
    ({"num_inference_step": 4}, "num_inference_step"),
    ({"width": "16"}, "width"),
    ({"num_outputs_per_prompt": 1000}, "num_outputs_per_prompt"),
    ({"output_type": "gif"}, "output_type"),
])
def test_bad_sampling_params_fail_before_any_work(omni_request, kwargs, field):
    before = omni_request.stats()
    with pytest.raises(ConfigError) as info:
        omni_request.generate(["ok", "also ok"], **kwargs)
    assert field in str(info.value)
    after = omni_request.stats()
    assert after["tracked_requests"] == [] and after["requests_added"] == before["requests_added"]


def test_size_error_names_the_allowed_multiple(omni_request):
    with pytest.raises(ConfigError, match="multiple of 8"):
        omni_request.generate("x", height=20)


@pytest.mark.parametrize("engine", ["omni_request", "omni_step"])
def test_a_failing_request_fails_alone(engine, request):
    omni = request.getfixturevalue(engine)
    prompts = ["a", "b", "c"]
    params = [SamplingParams(seed=i, extra_args={"fail_at_step": 2} if i == 1 else {}) for i in range(3)]
    # submit together so they share a wave
    streams = [omni.engine.submit([omni_req])[0] for omni_req in _requests(prompts, params)]
    outs = [_final(s) for s in streams]
    assert [o.status for o in outs] == ["completed", "error", "completed"]
    assert "injected failure" in outs[1].error
    assert omni.stats()["tracked_requests"] == []
    with pytest.raises(RequestFailedError, match="injected failure"):
        omni.generate("boom", extra_args={"fail_at_step": 0}, use_tqdm=False)


def _requests(prompts, params):
    from omni_core.request import OmniDiffusionRequest

    return [OmniDiffusionRequest(prompt=p, sampling_params=sp) for p, sp in zip(prompts, params)]


def _final(stream):
    while True:
        out = stream.get(timeout=60)
        if out.finished:
            return out




@pytest.mark.parametrize("step_execution", [False, True])
def test_abort_of_a_running_request_stops_it_within_one_step(tiny_model, step_execution):
    with Omni(tiny_model, step_execution=step_execution, warmup=False) as omni:
        engine = omni.engine
        (req,) = _requests(["slow"], [SamplingParams(num_inference_steps=40, extra_args={"sleep_per_step": 0.05})])
        seen = []
        (stream,) = engine.submit([req], on_progress=lambda rid, step, total: seen.append(step))
        wait_for(lambda: len(seen) >= 3, "3 denoising steps")
        at_abort = seen[-1]
        engine.abort(req.request_id)
        out = _final(stream)
        assert out.status == "aborted"
        assert out.metrics["steps_run"] <= at_abort + 1
        assert omni.stats()["tracked_requests"] == []


def test_streaming_yields_a_preview_per_step_then_the_final_image(tiny_model):
    async def run():
        omni = AsyncOmni(tiny_model, streaming_output=True, warmup=False)
        try:
            outs = [o async for o in omni.generate("a star", {"seed": 5, "num_inference_steps": 5})]
        finally:
            await omni.close()
        return outs

    outs = asyncio.run(run())
    assert [o.finished for o in outs] == [False] * 5 + [True]
    assert all(o.preview is not None and o.preview.shape[0] == 3 for o in outs[:-1])
    assert [o.step_index for o in outs[:-1]] == [1, 2, 3, 4, 5]
    with Omni(tiny_model, warmup=False) as plain:
        (ref,) = plain.generate("a star", seed=5, num_inference_steps=5, use_tqdm=False)
    assert np.array_equal(pixels(outs[-1]), pixels(ref))


@pytest.mark.parametrize("step_execution", [False, True])
def test_200_requests_with_random_aborts_leave_nothing_behind(tiny_model, step_execution):
    """Mixed shapes, ~30% aborted or cancelled (some waiting, some mid-denoise): every stream ends."""
    rng = random.Random(1234 + step_execution)

    async def run():
        omni = AsyncOmni(tiny_model, step_execution=step_execution, max_num_seqs=4, warmup=False)
        endings = {}

        async def client(i):
            size = rng.choice([8, 16, 24])
            fate = rng.random()
            rid = f"r{i}"
            params = {"seed": i, "height": size, "width": size, "num_inference_steps": rng.choice([2, 4, 6]),
                      "extra_args": {"sleep_per_step": 0.002}}
            agen = omni.generate(f"prompt {i}", params, request_id=rid)
            try:
                if fate < 0.15:  # explicit abort, at a random moment
                    task = asyncio.ensure_future(_drain(agen))
                    await asyncio.sleep(rng.random() * 0.05)
                    await omni.abort(rid)
                    outs = await asyncio.wait_for(task, 30)
                    endings[rid] = outs[-1].status
                elif fate < 0.30:  # the consumer goes away
                    task = asyncio.ensure_future(_drain(agen))
                    await asyncio.sleep(rng.random() * 0.05)
                    task.cancel()
                    try:
                        await task
                        endings[rid] = "completed-before-cancel"
                    except asyncio.CancelledError:
                        endings[rid] = "cancelled"
                else:
                    outs = await asyncio.wait_for(_drain(agen), 60)
                    endings[rid] = outs[-1].status
            finally:
                await agen.aclose()

        await asyncio.gather(*(client(i) for i in range(200)))
        # cancelled consumers abort their requests; give the busy loop a moment to finalise them
        deadline = time.monotonic() + 30
        while omni.stats()["tracked_requests"]:
            assert time.monotonic() < deadline, f"still tracked after 30 s: {omni.stats()['tracked_requests']}"
            await asyncio.sleep(0.02)
        stats = omni.stats()
        await omni.close()
        return endings, stats

    endings, stats = asyncio.run(run())
    assert len(endings) == 200
    assert stats["tracked_requests"] == [] and stats["waiting"] == 0 and stats["running"] == 0
    values = list(endings.values())
    assert values.count("completed") >= 120
    assert values.count("aborted") + values.count("cancelled") >= 20
    assert set(values) <= {"completed", "aborted", "cancelled", "completed-before-cancel"}
    assert stats["requests_added"] == stats["requests_completed"] + stats["requests_aborted"]


async def _drain(agen):
    return [o async for o in agen]


def test_head_of_line_small_requests_pass_a_large_one_which_then_runs_next(tiny_model):
    """Queue: s0, LARGE, s1..s6 (max_num_seqs=4). Without head-of-line blocking the first wave is s0..s3 (the
    large request does not stop admission at it), the large one runs next (it is then the oldest), and the
    rest after it. A scheduler that stops at the head's incompatible neighbour runs s0 alone first."""
    with Omni(tiny_model, max_num_seqs=4, warmup=False) as omni:
        engine = omni.engine
        small = _requests([f"s{i}" for i in range(7)], [SamplingParams(seed=i) for i in range(7)])
        (large,) = _requests(["large"], [SamplingParams(height=32, width=32, seed=0)])
        streams = engine.submit([small[0], large, *small[1:]])  # queued at once: one scheduling round sees all
        outs = dict(zip(["s0", "large", *[f"s{i}" for i in range(1, 7)]], (_final(s) for s in streams)))
        assert all(o.status == "completed" for o in outs.values())
        assert [outs[f"s{i}"].metrics["batch_size"] for i in range(7)] == [4] * 4 + [3] * 3
        assert outs["large"].metrics["batch_size"] == 1
        # waves ran in the order (s0..s3), large, (s4..s6): compare when each request started
        started = {k: o.metrics["queue_time_s"] for k, o in outs.items()}
        assert max(started[f"s{i}"] for i in range(4)) < started["large"] < min(started[f"s{i}"] for i in range(4, 7))
        assert omni.stats()["tracked_requests"] == []


def test_close_aborts_pending_requests_and_refuses_new_ones(tiny_model):
    omni = Omni(tiny_model, warmup=False)
    (req,) = _requests(["slow"], [SamplingParams(num_inference_steps=50, extra_args={"sleep_per_step": 0.05})])
    (stream,) = omni.engine.submit([req])
    time.sleep(0.2)
    t0 = time.monotonic()
    omni.close()
    assert time.monotonic() - t0 < 5
    assert _final(stream).status == "aborted"
    with pytest.raises(Exception, match="closed"):
        omni.generate("x")
    omni.close()  # idempotent
