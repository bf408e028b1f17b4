"""Both cache backends work on FLUX.2 by its DenoiserSpec alone (one block list over the double- and single-stream
blocks): with the shipped defaults, fewer transformer evaluations and >= 30 dB PSNR against uncached, for a batch
of four [klein] requests with CFG over 20 steps."""

from __future__ import annotations

import pytest

from omni_core.testing import make_state, outputs_and_rows, psnr

#: one worker under ``pytest -n``: the module's uncached run is made once for both backends
pytestmark = pytest.mark.xdist_group("flux2-caches")

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]
STEPS = 20


def states(pipeline):
    return [make_state(pipeline, p, seed=3 + i, negative_prompt="blurry", guidance_scale=3.0, height=16, width=16,
                       num_inference_steps=STEPS, max_sequence_length=48) for i, p in enumerate(PROMPTS)]


def counted(pipeline, backend):
    """(outputs, rows the last block computed)."""
    return outputs_and_rows(pipeline, states(pipeline), pipeline.transformer.single_transformer_blocks[-1], backend)


@pytest.fixture(scope="module")
def uncached(omni_klein):
    return counted(omni_klein, None)


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(omni_klein, uncached, backend):
    from omni_core.plugins import get_plugin_manager

    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    plain, plain_rows = uncached
    assert plain_rows == 2 * len(PROMPTS) * STEPS  # cond and uncond rows, every step
    cached, rows = counted(omni_klein, backend)
    assert rows < plain_rows, f"{backend} computed every row"
    dbs = [psnr(a, b) for a, b in zip(plain, cached)]
    print(f"{backend}: {rows} of {plain_rows} rows computed, PSNR {min(dbs):.1f}-{max(dbs):.1f} dB")
    assert min(dbs) >= 30, f"{backend}: PSNR {min(dbs):.1f} dB against uncached"
