"""Both cache backends work on HunyuanVideo 1.5 by its DenoiserSpec alone (the dual-stream blocks carry the video and
the condition streams): with the shipped defaults, fewer evaluations of the last block and >= 35 dB PSNR against
uncached, for a batch of three text-to-video requests with CFG over 16 steps."""

from __future__ import annotations

import pytest

from omni_core.testing import make_state, outputs_and_rows, psnr

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", 'a sign that reads "OPEN"']
STEPS = 16


def states(pipeline):
    return [make_state(pipeline, p, seed=3 + i, negative_prompt="blurry", guidance_scale=4.0, height=16, width=16,
                       num_frames=5, num_inference_steps=STEPS) for i, p in enumerate(PROMPTS)]


def counted(pipeline, backend):
    """(outputs, rows the last block computed)."""
    return outputs_and_rows(pipeline, states(pipeline), pipeline.pipe.transformer.transformer_blocks[-1].ff, backend)


@pytest.fixture(scope="module")
def uncached(omni_hv):
    return counted(omni_hv, None)


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(omni_hv, uncached, backend):
    from omni_core.plugins import get_plugin_manager

    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    plain, plain_rows = uncached
    assert plain_rows == 2 * len(PROMPTS) * STEPS  # cond and uncond rows, every step
    cached, rows = counted(omni_hv, backend)
    assert rows < plain_rows, f"{backend} computed every row"
    dbs = [psnr(a, b) for a, b in zip(plain, cached)]
    print(f"{backend}: {rows} of {plain_rows} rows computed, PSNR {min(dbs):.1f}-{max(dbs):.1f} dB")
    # 35 dB: with a constant TeaCache signal (a broken modulated_input) it computes 12 of 96 rows at 29.4 dB
    assert min(dbs) >= 35, f"{backend}: PSNR {min(dbs):.1f} dB against uncached"
