"""Every accelerator on tiny FLUX.1 by its DenoiserSpec alone (no change to the core or the backends):
``tea_cache`` and ``cache_dit`` skip denoiser evaluations at >= 30 dB PSNR against no cache, and Ulysses-2 /
Ring-2 over two gloo workers (``mp`` executor) give what one process gives (max abs diff <= 1e-5).

The folder has two double- and two single-stream blocks (the spec's ``blocks_attr`` tuple: four blocks for
the caches), 2 heads (Ulysses 2 divides them). Fixtures live here, not in a conftest."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEG = "blurry, low quality"
PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_flux.testing import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("accel-flux"), num_layers=2, num_single_layers=2)


def generate(folder, requests, **engine):
    """One engine over ``requests`` (dicts: prompt, negative_prompt, SamplingParams fields), all submitted at
    once; the finished outputs in order (their ``images``: float tensors)."""
    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    engine = {"dtype": "float32", "warmup": False, "max_num_seqs": 4, **engine}
    if not engine.get("parallel_config"):
        engine.setdefault("cpu_threads", 1)  # tiny kernels: one thread is ~10x faster on a shared machine
    with Omni(folder, **engine) as omni:
        streams = []
        for spec in requests:
            spec = dict(spec)
            prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
            streams += omni.engine.submit([OmniDiffusionRequest(
                prompt=prompt, negative_prompt=negative, sampling_params=SamplingParams(output_type="pt", **spec))])
        finals = []
        for stream in streams:
            while not (out := stream.get(timeout=300)).finished:
                pass
            finals.append(out)
    assert not [o.error for o in finals if o.status == "error"]
    return finals


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else -10 * math.log10(mse)


# ---------------------------------------------------------------------------------------------- caches
CACHE_REQUESTS = [{"prompt": p, "negative_prompt": NEG, "true_cfg_scale": 3.0, "height": 16, "width": 16,
                   "num_inference_steps": 20, "max_sequence_length": 32, "seed": 3 + i}
                  for i, p in enumerate(PROMPTS)]
#: per backend the cache config (None: the model's shipped defaults, TeaCache's published FLUX polynomial)
CACHES = {"tea_cache": None, "cache_dit": {"residual_diff_threshold": 0.3, "max_warmup_steps": 2}}


@pytest.fixture(scope="module")
def uncached(flux_dir):
    return generate(flux_dir, CACHE_REQUESTS)


@pytest.mark.parametrize("backend", list(CACHES))
def test_cache_skips_evaluations_and_stays_close(flux_dir, uncached, backend):
    from omni_core.plugins import get_plugin_manager

    if backend not in get_plugin_manager().components("cache"):
        pytest.skip(f"cache backend {backend!r} is not installed")
    extra = {"cache_config": CACHES[backend]} if CACHES[backend] else {}
    cached = generate(flux_dir, CACHE_REQUESTS, cache_backend=backend, **extra)
    evaluations = 2 * 20  # cond and uncond, every step
    for plain, out in zip(uncached, cached):
        m = out.metrics
        assert m["cache_backend"] == backend
        assert m["steps_computed"] + m["steps_reused"] == evaluations
        assert m["steps_computed"] < evaluations
        db = psnr(plain.images[0], out.images[0])
        assert db >= 30, f"{backend}: PSNR {db:.1f} dB against uncached"


# ---------------------------------------------------------------------------------------------- SP
#: VAE factor 1 and 2x2 packing: 6x10 is 3 x 5 = 15 image tokens (odd: the plan pads and strips), 8x8 is 16
SP_REQUESTS = [
    {"prompt": PROMPTS[0], "negative_prompt": NEG, "true_cfg_scale": 4.0, "height": 6, "width": 10,
     "num_inference_steps": 3, "max_sequence_length": 32, "seed": 1},
    {"prompt": PROMPTS[1], "negative_prompt": "low quality, watermark", "true_cfg_scale": 4.0, "height": 6,
     "width": 10, "num_inference_steps": 3, "max_sequence_length": 32, "seed": 2},
    {"prompt": PROMPTS[2], "height": 8, "width": 8, "num_inference_steps": 3, "max_sequence_length": 32, "seed": 3},
]


@pytest.fixture(scope="module")
def one_process(flux_dir):
    return generate(flux_dir, SP_REQUESTS)


@pytest.mark.dist
@pytest.mark.parametrize("parallel_config,engine", [({"ulysses_degree": 2}, {}),
                                                    ({"ring_degree": 2}, {"step_execution": True})],
                         ids=["ulysses2", "ring2"])
def test_sequence_parallel_equals_one_process(flux_dir, one_process, parallel_config, engine):
    outs = generate(flux_dir, SP_REQUESTS, parallel_config=parallel_config, **engine)
    for ref, out in zip(one_process, outs):
        assert out.images[0].shape == ref.images[0].shape
        assert (out.images[0] - ref.images[0]).abs().max().item() <= 1e-5
        assert out.metrics["communication_bytes"] > 0  # the ranks really split the tokens
