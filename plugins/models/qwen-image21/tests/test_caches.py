"""Both cache backends work on Qwen-Image 2.1 by its DenoiserSpec alone (the blocks of the cached-prefix step, the
prefix keys/values a per-row side input): with the shipped defaults, fewer transformer evaluations and >= 30 dB
PSNR against uncached, for a batch of four requests with CFG over 20 steps."""

from __future__ import annotations

import pytest

from omni_core.testing import make_state, outputs_and_rows, psnr

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]
STEPS = 20


def states(pipeline):
    return [make_state(pipeline, p, seed=3 + i, negative_prompt="blurry", true_cfg_scale=3.0, height=32, width=32,
                       num_inference_steps=STEPS) for i, p in enumerate(PROMPTS)]


def counted(pipeline, backend):
    """(outputs, rows the last block computed)."""
    return outputs_and_rows(pipeline, states(pipeline), pipeline.transformer.transformer_blocks[-1].attn, backend)


@pytest.fixture(scope="module")
def uncached(omni_q21):
    return counted(omni_q21, None)


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(omni_q21, uncached, backend):
    from omni_core.plugins import get_plugin_manager

    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    plain, plain_rows = uncached
    assert plain_rows == 2 * len(PROMPTS) * STEPS  # cond and uncond rows, every step
    cached, rows = counted(omni_q21, backend)
    assert rows < plain_rows, f"{backend} computed every row"
    dbs = [psnr(a, b) for a, b in zip(plain, cached)]
    print(f"{backend}: {rows} of {plain_rows} rows computed, PSNR {min(dbs):.1f}-{max(dbs):.1f} dB")
    assert min(dbs) >= 30, f"{backend}: PSNR {min(dbs):.1f} dB against uncached"
