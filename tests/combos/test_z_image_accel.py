"""tea_cache and cache_dit on tiny Z-Image, by its DenoiserSpec alone (no change to those plugins or the core):
fewer denoiser evaluations at >= 30 dB PSNR against no cache, decided per request inside a batch. (Ulysses-2 /
Ring-2: ``tests/parallel/test_z_image_parallel.py``, apart because each mp engine start takes ~35 s here.)

Z-Image ships no TeaCache coefficients, so tea_cache runs on the raw relative change unless the user gives
coefficients or ``omni cache calibrate --write`` ships fitted ones in the folder; all three paths run here.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.pipelines import StepState
from omni_core.request import OmniDiffusionRequest
from omni_core.testing.driver import enabled_cache_backend, output_tensors, run_step_batch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red fox jumps over a lazy dog in the snow", "a cat", "an astronaut rides a horse on the moon"]
NEG = "blurry, low quality"
STEPS = 20


@pytest.fixture(scope="module")
def zi_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_z_image.testing import build_tiny_z_image

    return build_tiny_z_image(tmp_path_factory.mktemp("combo-z-image"))


def load(path: str):
    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    return load_pipeline(resolve_model(path), OmniDiffusionConfig(model=path, dtype="float32"), "cpu", torch.float32)


@pytest.fixture(scope="module")
def zi(zi_dir: str):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits on a shared machine
    yield load(zi_dir)
    torch.set_num_threads(threads)


def states(pipeline, folder, prompts=PROMPTS, *, steps=STEPS, seed=0, cfg=3.0):
    out = []
    for i, prompt in enumerate(prompts):
        params = type(pipeline).check_sampling_params(
            SamplingParams(height=32, width=32, num_inference_steps=steps, guidance_scale=cfg, seed=seed + i,
                           max_sequence_length=64), folder)
        req = OmniDiffusionRequest(prompt=prompt, negative_prompt=NEG, sampling_params=params)
        out.append(StepState(request=req, generator=torch.Generator().manual_seed(seed + i)))
    return out


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return -10 * math.log10(max(float(((a - b) ** 2).mean()), 1e-20))


@pytest.fixture(scope="module")
def plain(zi, zi_dir):
    return output_tensors(zi, states(zi, zi_dir))


def assert_fewer_and_close(backend, sts, outs, plain_outs):
    total = 0
    for s, out, ref in zip(sts, outs, plain_outs):
        m = backend.request_metrics(s)
        assert m["steps_computed"] + m["steps_reused"] == 2 * STEPS  # cond and uncond
        total += m["steps_reused"]
        assert psnr(out, ref) >= 30, f"PSNR {psnr(out, ref):.1f} dB against uncached"
    assert total > 0, "the cache never skipped"
    return total


# ---------------------------------------------------------------------------------------------- tea_cache
def test_tea_cache_without_shipped_coefficients_uses_the_raw_change(zi, zi_dir, plain):
    """No published coefficients for Z-Image: the spec ships none and tea_cache uses the raw relative change."""
    with enabled_cache_backend("tea_cache", zi, rel_l1_thresh=0.12) as backend:
        (den,) = backend.denoisers.values()
        assert den.options.coefficients == (1.0, 0.0)
        sts = states(zi, zi_dir)
        reused = assert_fewer_and_close(backend, sts, output_tensors(zi, sts, backend), plain)
        assert backend.mode_counts["slice"] + backend.mode_counts["none"] > 0
    print(f"tea_cache raw change: {reused} of {2 * STEPS * len(sts)} evaluations reused")


def test_tea_cache_with_user_coefficients_and_zero_threshold(zi, zi_dir, plain):
    with enabled_cache_backend("tea_cache", zi, rel_l1_thresh=0) as backend:
        assert all(torch.equal(a, b) for a, b in zip(output_tensors(zi, states(zi, zi_dir), backend), plain))
    with enabled_cache_backend("tea_cache", zi, coefficients=[2.0, 0.0], rel_l1_thresh=0.24) as backend:
        (den,) = backend.denoisers.values()
        assert den.options.coefficients == (2.0, 0.0)
        sts = states(zi, zi_dir)
        assert_fewer_and_close(backend, sts, output_tensors(zi, sts, backend), plain)


def test_tea_cache_step_batch_decides_per_request(zi, zi_dir, plain):
    """Requests joining at different steps keep their own decisions and stay close to uncached."""
    with enabled_cache_backend("tea_cache", zi, rel_l1_thresh=0.12) as backend:
        sts = states(zi, zi_dir)
        with torch.inference_mode():
            outs = [o.tensor for o in run_step_batch(zi, sts, [0, 2, 3], cache_backend=backend)]
        assert_fewer_and_close(backend, sts, outs, plain)


def test_calibrate_command_ships_coefficients_in_the_folder(zi_dir, tmp_path, capsys):
    from omni_core.cli.main import main
    from omni_core.pipelines.denoiser import denoisers_of

    folder = shutil.copytree(zi_dir, tmp_path / "z-image")
    code = main(["cache", "calibrate", "--model", str(folder), "--prompts", "2", "--steps", "5", "--height", "32",
                 "--width", "32", "--dtype", "float32", "--write", "--rel-l1-thresh", "0.2"])
    assert code == 0
    shipped = json.loads((folder / "cache_defaults.json").read_text())["tea_cache"]
    assert len(shipped["coefficients"]) == 5 and shipped["rel_l1_thresh"] == 0.2
    assert "coefficients: [" in capsys.readouterr().out
    pipeline = load(str(folder))
    (spec,) = denoisers_of(pipeline)
    with enabled_cache_backend("tea_cache", pipeline) as backend:
        assert list(backend.denoisers["transformer"].options.coefficients) == shipped["coefficients"]
        assert spec.defaults_for("tea_cache", str(folder))["rel_l1_thresh"] == 0.2


# ---------------------------------------------------------------------------------------------- cache_dit
def test_cache_dit_skips_and_a_batch_matches_each_alone(zi, zi_dir, plain):
    """cache-dit splits a batched call per request (Z-Image's texts differ in length) and joins the outputs."""
    if "cache_dit" not in __import__("omni_core.plugins", fromlist=["x"]).get_plugin_manager().components("cache"):
        pytest.skip("cache_dit is not installed")
    config = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.8, max_warmup_steps=2)
    with enabled_cache_backend("cache_dit", zi, **config) as backend:
        sts = states(zi, zi_dir)
        outs = output_tensors(zi, sts, backend)
        assert backend.split_calls > 0
        assert_fewer_and_close(backend, sts, outs, plain)
        for i in range(len(PROMPTS)):
            (alone_state,) = states(zi, zi_dir, [PROMPTS[i]], seed=i)
            (alone,) = output_tensors(zi, [alone_state], backend)
            torch.testing.assert_close(alone, outs[i], atol=1e-3, rtol=0)
            assert (backend.request_metrics(alone_state)["cache_branches"]
                    == backend.request_metrics(sts[i])["cache_branches"])
