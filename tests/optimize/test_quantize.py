"""int8/fp8 weight-only quantization (torchao) on the shapes model and a tiny Qwen-Image: the denoiser shrinks
to at most 0.35x of float32, images stay within 30 dB PSNR of float32 at the same seed, and shapes still draws
what the prompt says (its evaluator within 3 points)."""

from __future__ import annotations

import pytest
import torch

from omni_core.errors import ConfigError
from omni_core.optimize.components import model_bytes

from .conftest import load, psnr, run, run_qwen

pytest.importorskip("torchao")

#: scenes the shapes evaluator scores: one judging difference is 2.5 points
N_EVAL = 40


@pytest.fixture(scope="module")
def shapes_pair():
    return load("shapes"), load("shapes", quantization="int8")


def test_shapes_int8_saves_memory_and_keeps_images(shapes_pair):
    plain, q = shapes_pair
    before, after = model_bytes(plain), model_bytes(q)
    assert after["transformer"] <= 0.35 * before["transformer"], (before, after)
    assert after["text_encoder"] == before["text_encoder"]  # the denoiser only, by default
    prompts = ["a red circle in the top left", "a blue square in the center"]
    ref, _ = run(plain, prompts, [3, 4], num_inference_steps=2)
    got, _ = run(q, prompts, [3, 4], num_inference_steps=2)
    assert not torch.equal(got, ref)  # quantized weights really ran
    assert psnr(got, ref) >= 30


def test_shapes_int8_still_draws_what_the_prompt_says(shapes_pair):
    """The shapes evaluator (default 20 steps) within 3 points of float32 on every attribute."""
    from omni_model_shapes.evaluate import evaluate

    results = {name: evaluate(pipeline=pipe, n=N_EVAL, grid=None, batch_size=N_EVAL)
               for name, pipe in zip(("float32", "int8"), shapes_pair)}
    for key in ("colour", "shape", "position", "all"):
        a, b = results["float32"][key], results["int8"][key]
        assert abs(a - b) <= 0.03 + 1e-9, (key, a, b)


def test_qwen_int8_saves_memory_and_keeps_images(qwen_dir, qwen_plain):
    plain, ref, _ = qwen_plain
    q = load(qwen_dir, quantization="int8")
    before, after = model_bytes(plain), model_bytes(q)
    assert after["transformer"] <= 0.35 * before["transformer"], (before, after)
    assert after["vae"] == before["vae"] and after["text_encoder"] == before["text_encoder"]
    got, _ = run_qwen(q)
    assert not torch.equal(got, ref)  # quantized weights really ran
    assert psnr(got, ref) >= 30


def test_wan22_int8_quantizes_both_experts(wan22_dir):
    """Wan 2.2 declares two denoisers: ``quantization="int8"`` shrinks each of them, and only them."""
    plain, q = load(wan22_dir), load(wan22_dir, quantization="int8")
    before, after = model_bytes(plain), model_bytes(q)
    for expert in ("transformer", "transformer_2"):
        assert after[expert] <= 0.5 * before[expert], (expert, before, after)
    assert after["text_encoder"] == before["text_encoder"] and after["vae"] == before["vae"]
    assert q.omni_optimizations["quantization"] == {"method": "int8", "components": ["transformer", "transformer_2"]}


def test_text_encoder_too_and_bad_component_names(qwen_dir):
    q = load(qwen_dir, quantization="int8", quantize_components=["denoiser", "text_encoder"])
    assert q.omni_optimizations["quantization"] == {"method": "int8", "components": ["transformer", "text_encoder"]}
    with pytest.raises(ConfigError, match="'transformr'.*its components: text_encoder, transformer, vae") as exc:
        load(qwen_dir, quantization="int8", quantize_components="transformr")
    assert exc.value.field == "quantize_components"


def test_unknown_method_names_the_allowed_ones():
    from omni_core.config import OmniDiffusionConfig

    with pytest.raises(ConfigError, match="allowed: fp8, int8, none") as exc:
        OmniDiffusionConfig(model="shapes", quantization="int4")
    assert exc.value.field == "quantization"


def test_method_status_is_a_real_probe():
    from omni_core.optimize.quantize import method_status

    ok, why = method_status("int8", "cpu")
    assert ok and "Int8WeightOnlyConfig" in why and "not faster on CPU" in why
    assert method_status("int4", "cpu") == (False, "unknown method (allowed: int8, fp8)")


@pytest.mark.gpu
def test_fp8_on_the_accelerator(qwen_dir):
    from omni_core.optimize.quantize import method_status

    ok, why = method_status("fp8", "cuda")
    if not ok:
        pytest.skip(why)
    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    plain = load_pipeline(resolve_model(qwen_dir), OmniDiffusionConfig(model=qwen_dir, dtype="bfloat16"), "cuda",
                          torch.bfloat16)
    q = load_pipeline(resolve_model(qwen_dir), OmniDiffusionConfig(model=qwen_dir, dtype="bfloat16",
                                                                   quantization="fp8"), "cuda", torch.bfloat16)
    assert model_bytes(q)["transformer"] <= 0.6 * model_bytes(plain)["transformer"]
    ref, _ = run_qwen(plain)
    got, _ = run_qwen(q)
    assert psnr(got.cpu(), ref.cpu()) >= 25
