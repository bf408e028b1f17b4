"""Streaming previews: a request of N steps streams exactly N intermediate outputs (the i-th after step i,
each with a preview), then one final output with the decoded image -- in every API that streams."""

from __future__ import annotations

import asyncio

import pytest

from omni_core import AsyncOmni, Omni, SamplingParams
from omni_core.request import OmniDiffusionRequest

STEPS = (1, 2, 3, 6)


def assert_stream(outs, n):
    assert [o.finished for o in outs] == [False] * n + [True], f"{n} steps: {[o.finished for o in outs]}"
    previews = outs[:-1]
    assert [o.step_index for o in previews] == list(range(1, n + 1))
    assert all(o.num_steps == n for o in previews)
    assert all(o.preview is not None and o.preview.shape[0] == 3 for o in previews)
    final = outs[-1]
    assert final.status == "completed" and final.images and final.metrics["steps_run"] == n


def test_async_omni_streams_one_preview_per_step_then_the_final_image(tiny_model):
    async def run():
        async with AsyncOmni(tiny_model, streaming_output=True, max_num_seqs=4, warmup=False) as omni:
            async def one(n):
                return [o async for o in omni.generate(f"p{n}", {"seed": n, "num_inference_steps": n})]

            return await asyncio.gather(*(one(n) for n in STEPS))  # concurrent: they share step waves

    for n, outs in zip(STEPS, asyncio.run(run())):
        assert_stream(outs, n)


def test_engine_stream_of_omni_gives_the_same_count(tiny_model):
    with Omni(tiny_model, streaming_output=True, max_num_seqs=2, warmup=False) as omni:
        requests = [OmniDiffusionRequest(prompt=f"p{n}", sampling_params=SamplingParams(seed=n, num_inference_steps=n))
                    for n in STEPS]
        streams = omni.engine.submit(requests)
        for n, stream in zip(STEPS, streams):
            outs = []
            while not outs or not outs[-1].finished:
                outs.append(stream.get(timeout=60))
            assert_stream(outs, n)
        assert omni.stats()["tracked_requests"] == []


def test_a_preview_count_computes_only_those_previews(tiny_model):
    """``preview_count`` (the server's ``partial_images``): the runner projects previews only after the chosen
    steps, next to a request in the same waves that wants one per step; every step still streams its progress."""
    from omni_core.request import preview_steps

    with Omni(tiny_model, streaming_output=True, max_num_seqs=2, warmup=False) as omni:
        pipeline = omni.engine.executor.runner.pipeline
        calls: list = []
        preview = pipeline.preview
        pipeline.preview = lambda state: calls.append(state.request.preview_count) or preview(state)
        requests = [OmniDiffusionRequest(prompt=p, sampling_params=SamplingParams(seed=1, num_inference_steps=8),
                                         preview_count=count) for p, count in (("a", 2), ("b", None))]
        outs = []
        for stream in omni.engine.submit(requests):
            outs.append([])
            while not outs[-1] or not outs[-1][-1].finished:
                outs[-1].append(stream.get(timeout=60))
    counted, every = outs
    assert [o.step_index for o in counted[:-1]] == list(range(1, 9))  # progress after every step
    assert [o.step_index for o in counted[:-1] if o.preview is not None] == sorted(preview_steps(2, 8)) == [3, 5]
    assert all(o.preview is not None for o in every[:-1])
    assert calls.count(2) == 2 and calls.count(None) == 8


@pytest.mark.parametrize("streaming", [False, True])
def test_progress_listener_sees_every_step_in_step_mode(tiny_model, streaming):
    """The last step counts too (the tqdm bar of ``Omni.generate`` ends at its total)."""
    with Omni(tiny_model, step_execution=True, streaming_output=streaming, warmup=False) as omni:
        (req,) = [OmniDiffusionRequest(prompt="p", sampling_params=SamplingParams(seed=1, num_inference_steps=3))]
        seen = []
        (stream,) = omni.engine.submit([req], on_progress=lambda rid, step, total: seen.append((step, total)))
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(stream.get(timeout=60))
        assert outs[-1].status == "completed"
        assert seen[-1] == (3, 3) and len(outs) == (4 if streaming else 1)
