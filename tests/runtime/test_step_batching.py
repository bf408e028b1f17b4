"""STEP_BATCH's defining behaviour, observed in the denoiser itself, and what a consumer that stops reading
does to the engine (not only to the client): the request is aborted and runs no further steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_core import AsyncOmni, Omni, SamplingParams
from omni_core.request import OmniDiffusionRequest
from omni_core.testing import wait_for




def final(stream):
    while True:
        out = stream.get(timeout=60)
        if out.finished:
            return out


def test_a_request_joins_the_running_wave_at_the_next_step(tiny_model):
    # one torch thread: one lane, so the wave is one denoise_step call the log can show (with more threads a
    # CPU wave is split into per-core sub-batches; tests/runtime/test_lanes.py)
    with Omni(tiny_model, step_execution=True, max_num_seqs=4, warmup=False, cpu_threads=1) as omni:
        engine = omni.engine
        log = engine.executor.runner.pipeline.denoise_log  # (request_id, step_index) of every denoise_step call
        long = OmniDiffusionRequest(prompt="long", sampling_params=SamplingParams(
            seed=0, num_inference_steps=30, extra_args={"sleep_per_step": 0.05}))
        short = OmniDiffusionRequest(prompt="short", sampling_params=SamplingParams(seed=1, num_inference_steps=4))
        seen = []
        (long_stream,) = engine.submit([long], on_progress=lambda rid, step, total: seen.append(step))
        wait_for(lambda: len(seen) >= 3, "3 steps of the long request")
        at_submit = seen[-1]
        (short_stream,) = engine.submit([short])
        assert final(short_stream).status == "completed"
        short_done_at = seen[-1]
        assert final(long_stream).status == "completed"

        calls = [dict(call) for call in log]
        with_short = [c for c in calls if short.request_id in c]
        assert [c[short.request_id] for c in with_short] == [0, 1, 2, 3]
        # every step of the short request ran in the same denoise_step call as the long one ...
        assert all(long.request_id in c for c in with_short)
        # ... which it joined mid-way, at most one wave after it was submitted
        joined_at = with_short[0][long.request_id]
        assert at_submit <= joined_at <= at_submit + 2
        assert short_done_at < 30  # and it finished while the long request was still running
        assert [c[long.request_id] for c in calls if long.request_id in c] == list(range(30))


@pytest.mark.parametrize("streaming", [True, False], ids=["step-streaming", "request-mode"])
def test_a_consumer_that_stops_reading_aborts_its_request_in_the_engine(tiny_model, streaming):
    slow = {"seed": 0, "num_inference_steps": 40, "extra_args": {"sleep_per_step": 0.05}}

    async def run():
        async with AsyncOmni(tiny_model, streaming_output=streaming, warmup=False) as omni:
            engine = omni.engine
            if streaming:  # read three previews, then stop reading
                agen = omni.generate("slow", slow)
                async for out in agen:
                    if out.step_index >= 3:
                        break
                await agen.aclose()
            else:  # a consumer task waiting for the final output is cancelled mid-request
                task = asyncio.ensure_future(_drain(omni.generate("slow", slow)))
                deadline = time.monotonic() + 30
                while engine.stats()["denoise_steps"] < 3:
                    assert time.monotonic() < deadline, "no 3 steps within 30 s"
                    await asyncio.sleep(0.005)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            at_stop = engine.stats()["denoise_steps"]
            deadline = time.monotonic() + 30
            while engine.stats()["tracked_requests"]:
                assert time.monotonic() < deadline, f"still tracked after 30 s: {engine.stats()}"
                await asyncio.sleep(0.01)
            ended = engine.stats()
            await asyncio.sleep(0.5)  # long enough for 10 more steps, had it kept running
            return at_stop, ended, engine.stats()

    at_stop, ended, later = asyncio.run(run())
    assert ended["requests_aborted"] == 1 and ended["requests_completed"] == 0
    assert ended["denoise_steps"] <= at_stop + 2  # stopped within a step or two of the consumer leaving
    assert later["denoise_steps"] == ended["denoise_steps"]  # and never ran again


async def _drain(agen):
    return [o async for o in agen]
