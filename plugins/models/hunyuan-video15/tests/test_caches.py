"""Both cache backends work on HunyuanVideo 1.5 by its DenoiserSpec alone (the dual-stream blocks carry the video and
the condition streams): with the shipped defaults, fewer evaluations of the last block and >= 35 dB PSNR against
uncached, for a batch of three text-to-video requests with CFG over 16 steps."""

from __future__ import annotations

import math

import pytest

from omni_core.testing import enabled_cache_backend, make_state, output_tensors

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", 'a sign that reads "OPEN"']
STEPS = 16


def states(pipeline):
    return [make_state(pipeline, p, seed=3 + i, negative_prompt="blurry", guidance_scale=4.0, height=16, width=16,
                       num_frames=5, num_inference_steps=STEPS) for i, p in enumerate(PROMPTS)]


def counted(pipeline, backend):
    """(outputs, rows the last block's video MLP computed: the caches wrap the blocks' forward, so a hook on the
    block itself would count skipped calls too)."""
    rows = []
    hook = pipeline.pipe.transformer.transformer_blocks[-1].ff.register_forward_pre_hook(
        lambda m, a: rows.append(a[0].shape[0]))
    try:
        if backend is None:
            return output_tensors(pipeline, states(pipeline)), sum(rows)
        with enabled_cache_backend(backend, pipeline) as b:
            return output_tensors(pipeline, states(pipeline), b), sum(rows)
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def uncached(omni_hv):
    return counted(omni_hv, None)


def psnr(a, b):
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else -10 * math.log10(mse)


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
