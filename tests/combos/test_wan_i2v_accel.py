"""Accelerators on Wan image-to-video with no change to them or the core: the WanImageToVideoPipeline's
denoiser specs (the ones WanPipeline declares) are the whole integration.

* tea_cache and cache_dit: fewer transformer block evaluations than without a cache, video PSNR >= 30 dB
  against the uncached one (Wan 2.1 I2V layout: condition channels and CLIP image tokens on every call);
* Ulysses-2 (Wan 2.1 I2V: the image cross-attention stays local, like the text one) and Ring-2 (Wan 2.2
  I2V-A14B, two experts) over ``mp`` gloo workers: max abs diff <= 1e-5 against one process.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.images import to_tensor
from omni_core.pipelines import StepState, load_pipeline, resolve_model
from omni_core.request import OmniDiffusionRequest
from omni_core.testing.driver import enabled_cache_backend, run_request_batch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red fox jumps over a lazy dog", "a cat"]
NEG = "blurry, low quality"
IMAGES = [Image.fromarray((np.random.RandomState(i).rand(20 + 4 * i, 24, 3) * 255).astype(np.uint8))
          for i in range(2)]


#: torch threads (``OMNI_TEST_THREADS``, default 1): two OpenMP threads of tiny ops spin against the other jobs
#: of a shared 2-core machine (20x slower at load average 7); both sides of a comparison use the same count
TEST_THREADS = int(os.environ.get("OMNI_TEST_THREADS", "1"))


@pytest.fixture(autouse=True)
def _test_threads():
    if torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="module")
def i2v21_dir(tmp_path_factory):
    from omni_model_wan.testing import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("accel-i2v21"))


@pytest.fixture(scope="module")
def i2v22_dir(tmp_path_factory):
    from omni_model_wan.testing import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("accel-i2v22"), wan22=True)


@pytest.fixture(scope="module")
def i2v21(i2v21_dir):
    return load_pipeline(resolve_model(i2v21_dir), OmniDiffusionConfig(model=i2v21_dir, dtype="float32"), "cpu",
                         torch.float32)


def states(pipeline, model_dir, *, steps, width=16, g=5.0):
    out = []
    for i, prompt in enumerate(PROMPTS):
        params = type(pipeline).check_sampling_params(SamplingParams(
            height=16, width=width, num_frames=5, num_inference_steps=steps, guidance_scale=g, seed=i), model_dir)
        req = OmniDiffusionRequest(prompt=prompt, negative_prompt=NEG, sampling_params=params,
                                   images=[to_tensor(IMAGES[i])])
        out.append(StepState(request=req, generator=torch.Generator().manual_seed(i)))
    return out


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1.0 / ((a - b) ** 2).mean().clamp_min(1e-12)))


def run_counting(pipeline, model_dir, backend=None, steps=10):
    """Videos of both prompts (one wave) and the rows through the second block's MLP (its evaluations; a cache replaces the block's forward, so hooks on the block itself still fire)."""
    rows = []
    hook = pipeline.experts["transformer"].blocks[1].ffn.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    try:
        with torch.inference_mode():
            outs = run_request_batch(pipeline, states(pipeline, model_dir, steps=steps), cache_backend=backend)
    finally:
        hook.remove()
    return [o.tensor for o in outs], sum(rows)


@pytest.mark.parametrize("backend_name, config", [
    ("tea_cache", {}),  # the model's shipped defaults (TeaCache4Wan2.1 1.3B polynomial, 0.08, warm-up 5)
    ("cache_dit", {"residual_diff_threshold": 0.1, "max_warmup_steps": 2, "Fn_compute_blocks": 1,
                   "Bn_compute_blocks": 0, "max_continuous_cached_steps": -1}),
], ids=["tea_cache", "cache_dit"])
def test_caches_skip_evaluations_and_stay_close(i2v21, i2v21_dir, backend_name, config):
    base, base_rows = run_counting(i2v21, i2v21_dir)
    assert base_rows == 10 * 4  # 10 steps x (2 cond + 2 uncond rows) in one call each
    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(enabled_cache_backend(backend_name, i2v21, **config))
        cached, cached_rows = run_counting(i2v21, i2v21_dir, backend)
    assert cached_rows < base_rows, f"{backend_name} skipped nothing"
    for a, b in zip(base, cached):
        assert psnr(a, b) >= 30.0, f"{backend_name}: PSNR {psnr(a, b):.1f} dB"


def engine_videos(model_dir, parallel_config=None, width=32, g2=None):
    """Both prompts through ``Omni(model, parallel_config=...)`` (the ``mp`` executor with gloo workers when
    the world size is > 1), CFG on: the final latents (what sequence parallelism computes; the tiny random
    VAE maps different latents to nearly the same frames, so they are the sharper check)."""
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": NEG, "image": im} for p, im in zip(PROMPTS, IMAGES)]
    with Omni(model_dir, dtype="float32", warmup=False, max_num_seqs=2, parallel_config=parallel_config or {},
              cpu_threads=TEST_THREADS) as omni:
        outs = omni.generate(prompts, seed=3, height=16, width=width, num_frames=5, num_inference_steps=4,
                             guidance_scale=5.0, **({"guidance_scale_2": g2} if g2 else {}),
                             output_type="latent", use_tqdm=False)
        executor = type(omni.engine.executor).__name__
    return [torch.stack(list(o.images)).float() for o in outs], executor


@pytest.mark.parametrize("layout, parallel_config", [("i2v21_dir", {"ulysses_degree": 2}),
                                                     ("i2v22_dir", {"ring_degree": 2})], ids=["ulysses2", "ring2"])
def test_sequence_parallel_matches_one_process(layout, parallel_config, request):
    """16x32 frames: 2 latent frames x 1 x 2 tokens (latents ``[16, 2, 2, 4]``), sharded over two ranks (the condition channels are in
    the patch embedding, before the shard; the image tokens join the unsharded text context)."""
    model_dir = request.getfixturevalue(layout)
    g2 = 3.0 if layout == "i2v22_dir" else None
    one, executor = engine_videos(model_dir, g2=g2)
    assert executor == "UniProcExecutor"
    two, executor = engine_videos(model_dir, parallel_config, g2=g2)
    assert executor == "MultiProcExecutor"
    assert (one[0] - one[1]).abs().max().item() > 1e-2  # the two requests really differ
    for a, b in zip(one, two):
        assert (a - b).abs().max().item() <= 1e-5
