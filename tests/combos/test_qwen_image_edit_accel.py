"""Accelerators on tiny Qwen-Image-Edit (and its multi-image Plus variant) with no change to them or the core: the DenoiserSpec the edit pipeline
inherits from Qwen-Image is the whole integration. The condition tokens (the input image's VAE latents) are
image tokens appended to the noisy ones in ``hidden_states``, so the SP plan shards them with the rest of the
image stream (and the image half of the rotary table), and caches see them in block 0's modulated input.

* tea_cache and cache_dit: fewer evaluations of the second block, PSNR >= 30 dB against no cache;
* Ulysses-2 and Ring-2 over ``mp`` gloo workers (``Omni``): max abs diff <= 1e-5 against the same wave in
  one process.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZE = 64
NEG = "blurry, low quality"
PROMPTS = [("make the sky red and add a small boat on the lake", NEG), ("make it night", None)]


@pytest.fixture(scope="module", params=[False, True], ids=["edit", "edit-plus"])
def edit_dir(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny QwenImageEditPipeline folder, then a QwenImageEditPlusPipeline one (every test runs on both)."""
    from omni_model_qwen_image.testing import build_tiny_qwen_image_edit

    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("accel-qwen-image-edit"), num_heads=4,  # Ulysses-2
                                      plus=request.param)


@pytest.fixture(scope="module")
def edit_image():
    import numpy as np
    from PIL import Image

    x = np.linspace(0, 1, 64)[None, :, None]
    rgb = np.concatenate([np.broadcast_to(1 - x, (48, 64, 1)), np.full((48, 64, 1), 0.3),
                          np.broadcast_to(x, (48, 64, 1))], axis=2).copy()
    rgb[12:30, 16:40] = 1.0
    return Image.fromarray((rgb * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def edit(edit_dir: str):
    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    return load_pipeline(resolve_model(edit_dir), OmniDiffusionConfig(model=edit_dir, dtype="float32"), "cpu",
                         torch.float32)


def states(pipeline, edit_dir, image, steps, seed=None):
    from omni_core.config import SamplingParams
    from omni_core.images import to_tensor
    from omni_core.pipelines import StepState
    from omni_core.request import OmniDiffusionRequest

    out = []
    for i, (prompt, negative) in enumerate(PROMPTS):
        s = i if seed is None else seed
        params = type(pipeline).check_sampling_params(
            SamplingParams(height=SIZE, width=SIZE, num_inference_steps=steps, seed=s, true_cfg_scale=4.0), edit_dir)
        req = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
        req.images = [to_tensor(image)]
        out.append(StepState(request=req, generator=torch.Generator().manual_seed(s)))
    return out


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(10 * torch.log10(1 / ((a - b) ** 2).mean().clamp_min(1e-12)))


STEPS = 6


def count_block_rows(pipeline):
    """Rows through the second block's MLP (it runs only when a step is computed); returns (rows, handle)."""
    rows: list[int] = []
    hook = pipeline.transformer.transformer_blocks[1].img_mlp.register_forward_pre_hook(
        lambda m, a: rows.append(a[0].shape[0]))
    return rows, hook


@pytest.fixture(scope="module")
def no_cache(edit, edit_dir, edit_image):
    """The outputs without a cache and the rows the second block computed for them."""
    rows, hook = count_block_rows(edit)
    try:
        with torch.inference_mode():
            outs = [o.tensor for o in edit.forward(states(edit, edit_dir, edit_image, STEPS))]
    finally:
        hook.remove()
    return outs, sum(rows)


@pytest.mark.parametrize("backend, config", [
    ("tea_cache", {"rel_l1_thresh": 0.6}),
    ("cache_dit", {"residual_diff_threshold": 0.6, "max_warmup_steps": 2, "max_continuous_cached_steps": -1}),
], ids=["tea_cache", "cache_dit"])
def test_cache_skips_evaluations_and_stays_close(edit, edit_dir, edit_image, no_cache, backend, config):
    from omni_core.testing.driver import enabled_cache_backend, run_request_batch

    base, base_rows = no_cache
    rows, hook = count_block_rows(edit)
    try:
        with enabled_cache_backend(backend, edit, **config) as cache, torch.inference_mode():
            cached_states = states(edit, edit_dir, edit_image, STEPS)
            cached = [o.tensor for o in run_request_batch(edit, cached_states, cache_backend=cache)]
            reused = sum(cache.request_metrics(s)["steps_reused"] for s in cached_states)
    finally:
        hook.remove()
    assert base_rows == 3 * STEPS  # 2 cond rows + 1 uncond row per step
    assert reused > 0 and sum(rows) == base_rows - reused
    quality = [psnr(a, b) for a, b in zip(base, cached)]
    print(f"{backend}: {reused} of {base_rows} evaluations reused, PSNR {[f'{q:.1f}' for q in quality]} dB")
    assert min(quality) >= 30


def engine_images(edit_dir, image, parallel_config=None, **options):
    from omni_core import Omni

    prompts = [{"prompt": p, "image": image, **({"negative_prompt": n} if n else {})} for p, n in PROMPTS]
    with Omni(edit_dir, dtype="float32", warmup=False, max_num_seqs=2, parallel_config=parallel_config or {},
              **options) as omni:
        outs = omni.generate(prompts, seed=5, height=SIZE, width=SIZE, num_inference_steps=2, true_cfg_scale=4.0,
                             output_type="pt", use_tqdm=False)
        executor = type(omni.engine.executor).__name__
    return [torch.stack(list(o.images)).float() for o in outs], [o.metrics for o in outs], executor


@pytest.fixture(scope="module")
def one_process(edit, edit_dir, edit_image):
    """The same two requests as one wave in this process (what the single-process engine runs)."""
    sts = states(edit, edit_dir, edit_image, 2, seed=5)
    with torch.inference_mode():
        return [o.tensor.float() for o in edit.forward(sts)]


@pytest.mark.dist
@pytest.mark.parametrize("parallel_config, options", [
    ({"ulysses_degree": 2}, {}),
    ({"ring_degree": 2}, {"step_execution": True}),
], ids=["ulysses2", "ring2"])
def test_sequence_parallel_matches_one_process(edit_dir, edit_image, one_process, parallel_config, options):
    images, metrics, executor = engine_images(edit_dir, edit_image, parallel_config, **options)
    assert executor == "MultiProcExecutor"
    assert all(m.get("communication_bytes", 0) > 0 for m in metrics)  # the waves really were sharded
    diff = max((a - b).abs().max().item() for a, b in zip(images, one_process))
    print(f"{parallel_config}: max |diff| {diff:.2e}")
    assert diff <= 1e-5

