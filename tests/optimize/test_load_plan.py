"""The load plan (``omni_core.optimize.plan``): where the weights are at each step. With offload or quantization
no step puts the whole float transformer on the target device before the transform; the target here is torch's
``meta`` device (the only device besides the CPU on this machine), so "on the device" is visible per parameter."""

from __future__ import annotations

import pytest
import torch

from omni_core.config import OmniDiffusionConfig
from omni_core.pipelines import load_pipeline, resolve_model


def record_load(model: str, device: str, **options) -> tuple[object, list[tuple[str, dict]]]:
    """Load through the plan, recording after each step where the transformer's weights are:
    ``{"on_device": float weights there, "quantized": quantized weights there, "total": weights}``."""
    trace = []

    def observe(step, pipeline):
        transformer = pipeline.pipe.transformer
        on, quantized, total = 0, 0, 0
        for p in transformer.parameters():
            total += 1
            if p.device.type == torch.device(device).type:
                if type(p.data) is torch.Tensor:
                    on += 1
                else:
                    quantized += 1
        trace.append((step.action, {"on_device": on, "quantized": quantized, "total": total}))

    config = OmniDiffusionConfig(model=model, dtype="float32", **options)
    return load_pipeline(resolve_model(model), config, device, torch.float32, observe=observe), trace


@pytest.mark.parametrize("options", [dict(offload="model"), dict(offload="model", quantization="int8")],
                         ids=["model", "int8+model"])
def test_offload_never_puts_the_transformer_on_the_device_at_load(qwen_dir, options):
    pipe, trace = record_load(qwen_dir, "meta", **options)
    assert [a for a, _ in trace][0] == "read" and trace[-1][0] == "offload"
    for action, where in trace:
        assert where["on_device"] == 0 and where["quantized"] == 0, (action, where)
    assert pipe.device == torch.device("meta"), "the execution device is the target; the weights come per call"


def test_quantization_moves_each_linear_on_the_way_and_the_rest_last(qwen_dir):
    pipe, trace = record_load(qwen_dir, "meta", quantization="int8")
    steps = dict(trace)
    assert [a for a, _ in trace] == ["read", "parallel", "quantize", "place"]
    assert steps["read"]["on_device"] == 0 and steps["parallel"]["on_device"] == 0, "read to the host first"
    q = steps["quantize"]
    assert q["quantized"] > 0, "Linear weights arrive quantized"
    linear_floats = [p for m in pipe.pipe.transformer.modules() if isinstance(m, torch.nn.Linear)
                     for name, p in m.named_parameters(recurse=False) if name == "weight" and type(p.data) is torch.Tensor]
    assert not linear_floats, "no Linear weight reached the device in float"
    assert steps["place"]["on_device"] + steps["place"]["quantized"] == steps["place"]["total"]


def test_without_options_the_weights_are_read_straight_to_the_device(qwen_dir):
    from omni_core.optimize.plan import plan_load

    config = OmniDiffusionConfig(model=qwen_dir, dtype="float32")
    steps = plan_load(config, "cuda:0")
    assert steps[0].action == "read" and steps[0].device == "cuda:0"
    assert steps[-1].action == "place" and "already there" in steps[-1].detail
    group = plan_load(OmniDiffusionConfig(model=qwen_dir, offload="group"), "cuda:0")  # (diffusers' group
    # offloading cannot target ``meta``, so it is checked on the plan: read to the host, hooks last)
    assert [(s.action, s.device) for s in group] == [("read", "cpu"), ("parallel", "cpu"), ("offload", "cpu")]
    heavy = plan_load(OmniDiffusionConfig(model=qwen_dir, quantization="int8", compile=True, vae_tiling=True),
                      "cuda:0")
    assert [s.action for s in heavy] == ["read", "parallel", "quantize", "vae", "compile", "place"]
    assert heavy[0].device == "cpu" and heavy[2].device == "cuda:0"


def test_omni_env_prints_the_plan(qwen_dir, capsys):
    from omni_core.cli.main import main

    assert main(["env", "--model", qwen_dir, "--plan", "--offload", "group", "--quantization", "int8"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("load plan"):]
    assert [line.split()[1] for line in plan.splitlines()[1:] if line.strip()] == ["read", "parallel", "quantize",
                                                                                   "offload"]
    assert "group offload hooks" in plan and "on the host" in plan


@pytest.mark.gpu
def test_peak_gpu_memory_during_a_quantized_load_stays_below_the_float_model(qwen_dir):
    """On an accelerator: with int8 the float transformer never sits on the GPU, so the load's peak device
    memory stays below the transformer's float bytes (the tiny model here; the plan is the same at any size)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from omni_core.optimize.components import module_bytes

    plain = load_pipeline(resolve_model(qwen_dir), OmniDiffusionConfig(model=qwen_dir, dtype="float32"), "cpu",
                          torch.float32)
    float_bytes = module_bytes(plain.pipe.transformer)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    pipe = load_pipeline(resolve_model(qwen_dir), OmniDiffusionConfig(model=qwen_dir, dtype="float32",
                                                                      quantization="int8", quantize_components=
                                                                      ("denoiser", "text_encoder")),
                         "cuda", torch.float32)
    peak = torch.cuda.max_memory_allocated() - base
    total = sum(module_bytes(m) for m in (plain.pipe.transformer, plain.pipe.text_encoder, plain.pipe.vae))
    assert peak < total, (peak, total, float_bytes)
    assert pipe.device.type == "cuda"


@pytest.mark.parametrize("model", ["shapes", "qwen"])
def test_a_loaded_pipeline_holds_no_parameter_that_requires_grad(request, model):
    """The engine only runs inference: every component's parameters come out of the load without ``requires_grad``
    (diffusers loads them requiring it and peft turns it off at the first adapter; dynamo guards on it, so a graph
    compiled before the first LoRA request would be compiled again after it)."""
    name = request.getfixturevalue("qwen_dir") if model == "qwen" else model
    pipeline = load_pipeline(resolve_model(name), OmniDiffusionConfig(model=name, dtype="float32"), "cpu",
                             torch.float32)
    from omni_core.optimize.components import components_of

    grads = {n: sum(p.requires_grad for p in m.parameters()) for n, m in components_of(pipeline).items()}
    assert len(grads) >= (3 if model == "qwen" else 1) and not any(grads.values()), grads
