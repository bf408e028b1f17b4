"""Both cache backends work on the toy model by its declaration alone: fewer evaluations, close images."""

import math

import pytest

from omni_core import Omni
from omni_core.plugins import get_plugin_manager

PROMPTS = ["a red fox in the snow", "a cat", "two ships at sea", "a mountain lake at sunrise"]


def generate(backend: str):
    with Omni("toy", warmup=False, max_num_seqs=4, cache_backend=backend) as omni:
        return omni.generate(PROMPTS, seed=3, num_inference_steps=20, use_tqdm=False, output_type="pt")


@pytest.fixture(scope="module")
def uncached():
    return generate("none")  # once for both backends


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(backend, uncached):
    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    for plain, cached in zip(uncached, generate(backend)):
        m = cached.metrics
        assert m["steps_computed"] + m["steps_reused"] == 40  # 20 steps, cond and uncond
        assert m["steps_computed"] < 40
        psnr = -10 * math.log10(float(((plain.images[0] - cached.images[0]) ** 2).mean()))
        assert psnr >= 30, f"{backend}: PSNR {psnr:.1f} dB against uncached"
