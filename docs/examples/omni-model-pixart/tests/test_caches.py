"""Both cache backends work on PixArt by its ``DenoiserSpec`` alone: fewer evaluations, close images (a backend
that is not installed is skipped)."""

import math

import pytest

from omni_core import Omni
from omni_core.plugins import get_plugin_manager

PROMPTS = ["a red fox in the snow", "a cat", "two ships at sea", "a mountain lake at sunrise"]


def generate(folder: str, backend: str):
    with Omni(folder, warmup=False, max_num_seqs=4, cache_backend=backend, cpu_threads=1) as omni:
        return omni.generate(PROMPTS, seed=3, num_inference_steps=20, height=16, width=16, max_sequence_length=64,
                             use_tqdm=False, output_type="pt")


@pytest.fixture(scope="module")
def uncached(pixart_dir):
    return generate(pixart_dir, "none")


@pytest.mark.parametrize("backend", ["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(pixart_dir, uncached, backend):
    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    for plain, cached in zip(uncached, generate(pixart_dir, backend)):
        m = cached.metrics
        assert m["steps_computed"] + m["steps_reused"] == 40  # 20 steps, cond and uncond
        assert m["steps_computed"] < 40
        psnr = -10 * math.log10(float(((plain.images[0] - cached.images[0]) ** 2).mean()))
        assert psnr >= 40, f"{backend}: PSNR {psnr:.1f} dB against uncached"
