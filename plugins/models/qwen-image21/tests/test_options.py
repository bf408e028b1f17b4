"""Per-request LoRA, offload, int8 and GGUF on Qwen-Image 2.1, whose text prefix is computed outside the
transformer's ``forward`` (``model.prefix_kv``, once per request and branch in ``prepare_encode``).

* LoRA: one wave of three requests -- adapter ``text`` (on ``txt_in`` only: a layer that runs in the prefix
  computation and nowhere else, so it can only act through the prefix path), no adapter (with CFG), adapter
  ``attn`` (q/k/v/out of every block: the prefix and the target tokens) -- equals each request alone, in step
  mode and in request mode, and each adapter moves its image.
* offload ``"model"`` / ``"group"`` give the same wave bit for bit (CPU: the hooks run, no memory is saved), and
  the prefix path brings offloaded weights in (:func:`test_prefix_path_brings_offloaded_weights_in`: group
  offload to disk leaves NaN in offloaded weights, model offload's ring must hold the transformer).
* ``quantization="int8"`` and ``denoiser_weights=<Q8_0 .gguf>`` (``write_gguf`` of the folder's transformer)
  stay close to float and are really applied.

Every run is one engine on the same wave (a module fixture: each computed once, shared by the tests)."""

from __future__ import annotations

import os

import pytest
import torch

P0, P1 = "a red fox jumping over a lazy dog", "a cat on a sofa"
NEG = "blurry, low quality"
SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 3}
#: (prompt, seed, adapter, negative prompt): the mixed wave
WAVE = [(P0, 1, "text", None), (P1, 2, None, NEG), (P0, 1, "attn", None)]
#: the same request without its adapter (each adapter's effect is measured against it)
PLAIN = (P0, 1, None, None)
#: what each adapter must move its image by at least (max |diff| of [0, 1] images): ``attn`` (B of std 1.0) the
#: combination matrix's LORA_EFFECT; ``text`` (B of std 0.5, on ``txt_in``: measured 0.012) changes only the text
#: tokens' projection, which the tiny model's image follows less, but 100x above batch rounding (without the
#: prefix path applying it the difference would be exactly 0: ``txt_in`` runs nowhere else)
LORA_EFFECT = {"attn": 0.02, "text": 1e-3}
#: rows of a mixed wave against alone (batch rounding; the matrix's lora tolerance)
LORA_ATOL = 1e-5
#: torchao int8 weight-only and Q8_0 GGUF against float32 (the combination matrix's tolerances) for the rows
#: without CFG; the CFG row (scale 4 multiplies the quantization error of cond - uncond: Q8_0 moves it by 0.11 on
#: the tiny folder's sharpened attention) is held to diffusers' own pipeline with the same quantized transformer
INT8_ATOL, GGUF_ATOL = 0.05, 5e-3
#: Omni's images against diffusers' for the same weights (the parity tests: 8e-6 measured)
PARITY_ATOL = 1e-4

RUNS = {
    "step": {"step_execution": True},
    "request": {"step_execution": False},
    "offload_model": {"step_execution": True, "offload": "model"},
    "offload_group": {"step_execution": True, "offload": "group"},
    "int8": {"step_execution": True, "quantization": "int8"},
    "gguf": {"step_execution": True, "denoiser_weights": "<gguf>"},
}


@pytest.fixture(scope="module")
def files(q21_dir, tmp_path_factory) -> dict[str, str]:
    from diffusers import QwenImage21Transformer2DModel

    from omni_core.lora.testing import make_lora
    from omni_core.optimize.quantize import write_gguf

    root = tmp_path_factory.mktemp("q21-options")
    transformer = QwenImage21Transformer2DModel.from_pretrained(os.path.join(q21_dir, "transformer"))
    return {"text": make_lora(q21_dir, str(root / "text"), seed=1, std=0.5, targets=("in_layer", "out_layer")),
            "attn": make_lora(q21_dir, str(root / "attn"), seed=2, std=1.0),
            "gguf": write_gguf(transformer, str(root / "transformer-q8_0.gguf"), arch="qwen_image")}


def _request(spec):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    prompt, seed, lora, negative = spec
    return OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=SamplingParams(
        seed=seed, output_type="pt", lora=lora, true_cfg_scale=4.0, **SAMPLING))


def _submit(omni, specs) -> list:
    outs = []
    for stream in omni.engine.submit([_request(s) for s in specs]):
        while not (out := stream.get(timeout=300)).finished:
            pass
        assert out.status == "completed", out.error
        outs.append(out.images[0].float())
    return outs


@pytest.fixture(scope="module")
def run(q21_dir, files):
    """``run(name)``: the engine of ``RUNS[name]`` (adapters ``text`` and ``attn`` loaded) on :data:`WAVE`, then
    (``step`` only) each request of the wave alone and :data:`PLAIN`; computed once per name."""
    from omni_core import Omni

    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            options = {k: files["gguf"] if v == "<gguf>" else v for k, v in RUNS[name].items()}
            with Omni(q21_dir, dtype="float32", warmup=False, cpu_threads=1, max_num_seqs=3, max_lora_rank=8,
                      loras={"text": files["text"], "attn": files["attn"]}, **options) as omni:
                result = {"wave": _submit(omni, WAVE)}
                if name == "step":
                    result["alone"] = [_submit(omni, [s])[0] for s in WAVE]
                    result["plain"] = _submit(omni, [PLAIN])[0]
                pipeline = omni.engine.executor.runner.pipeline
                result["applied"] = dict(getattr(pipeline, "omni_optimizations", {}) or {})
                block = pipeline.transformer.transformer_blocks[0].attn.to_q
                result["to_q"] = type(getattr(block, "base_layer", block)).__name__
            cache[name] = result
        return cache[name]

    return get


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def test_lora_rows_equal_alone_and_each_adapter_acts_through_the_prefix(run):
    """A mixed wave equals each request alone (step mode; request mode equals step mode); the ``text`` adapter,
    on layers only the prefix computation runs, moves its image as much as one on every block's attention."""
    step, request = run("step"), run("request")
    for i, (row, alone) in enumerate(zip(step["wave"], step["alone"])):
        assert max_diff(row, alone) <= LORA_ATOL, f"row {i} ({WAVE[i][2]}) of the mixed wave differs from it alone"
    for i, (a, b) in enumerate(zip(request["wave"], step["wave"])):
        assert max_diff(a, b) <= LORA_ATOL, f"row {i}: request mode differs from step mode"
    effects = {WAVE[i][2]: max_diff(step["alone"][i], step["plain"]) for i in (0, 2)}
    print(f"adapter effects (max |diff| against no adapter): {effects}")
    assert all(e > LORA_EFFECT[name] for name, e in effects.items()), effects


@pytest.mark.parametrize("mode", ["model", "group"])
def test_offload_equals_no_offload(run, mode):
    """Offload moves weights, not values: the mixed LoRA wave bit for bit (adapters loaded under the hooks)."""
    got = run(f"offload_{mode}")
    assert got["applied"].get("offload") == mode, got["applied"]
    for i, (a, b) in enumerate(zip(got["wave"], run("step")["wave"])):
        assert torch.equal(a, b), f"row {i}: offload={mode!r} differs by {max_diff(a, b):.3g}"


@pytest.mark.parametrize("name, atol, layer", [("int8", INT8_ATOL, "Linear"), ("gguf", GGUF_ATOL, "GGUFLinear")])
def test_quantized_denoiser_stays_close_to_float(run, files, q21_dir, diffusers_q21, name, atol, layer):
    """torchao int8 weight-only / Q8_0 GGUF weights (``write_gguf`` of the folder's transformer, loaded by diffusers'
    ``from_single_file``): applied, the rows without CFG within the combination matrix's tolerance of float32;
    the CFG row (GGUF) equals diffusers' own pipeline with the same GGUF transformer, so what remains is
    quantization error, not Omni's."""
    got, ref = run(name), run("step")
    key = {"int8": "quantization", "gguf": "denoiser_weights"}[name]
    assert key in got["applied"], got["applied"]
    assert got["to_q"] == layer
    diffs = [max_diff(a, b) for a, b in zip(got["wave"], ref["wave"])]
    print(f"{name}: max |diff| per row against float32 {[f'{d:.2e}' for d in diffs]}")
    plain = [d for d, (_, _, _, negative) in zip(diffs, WAVE) if negative is None]
    assert 0 < max(plain) <= atol, diffs
    if name != "gguf":
        assert max(diffs) <= atol, diffs
        return
    import diffusers
    from diffusers import GGUFQuantizationConfig

    transformer = diffusers.QwenImage21Transformer2DModel.from_single_file(
        files["gguf"], config=os.path.join(q21_dir, "transformer"), torch_dtype=torch.float32,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32))
    pipe = diffusers.QwenImage21Pipeline(**{**diffusers_q21.components, "transformer": transformer})
    i = next(i for i, spec in enumerate(WAVE) if spec[3] is not None)
    prompt, seed, _, negative = WAVE[i]
    want = pipe(prompt=prompt, negative_prompt=negative, true_cfg_scale=4.0, output_type="pt",
                generator=torch.Generator().manual_seed(seed), **SAMPLING)[0][0, :3]
    assert max_diff(got["wave"][i], want) <= PARITY_ATOL


def test_prefix_path_brings_offloaded_weights_in(q21_dir, tmp_path):
    """``prefix_kv`` uses the transformer's submodules directly, so it runs their offload hooks itself
    (``model.weights_in``): group offload to disk (weights offloaded are left empty: NaN under torch's
    deterministic mode) gives the same prefix, and model offload brings the transformer in first."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.hooks import apply_group_offloading

    from omni_core.hooks import add_hook
    from omni_core.optimize.model_offload import MODEL_OFFLOAD_HOOK, ModelOffload, OffloadRing
    from omni_model_qwen_image21.model import install_step_forward, prefix_kv

    def fresh():
        return install_step_forward(QwenImage21Transformer2DModel.from_pretrained(os.path.join(q21_dir, "transformer")))

    text = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(0))
    t = fresh()
    ref = prefix_kv(t, text)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty fills NaN (fill_uninitialized_memory)
    try:
        cpu = torch.device("cpu")
        apply_group_offloading(t, onload_device=cpu, offload_device=cpu, offload_type="block_level",
                               num_blocks_per_group=1, offload_to_disk_path=str(tmp_path / "groups"))
        assert t.txt_in.in_layer.weight.isnan().all()  # offloaded: nothing usable until the hook brings it in
        torch.testing.assert_close(prefix_kv(t, text), ref, atol=0, rtol=0)
        assert t.txt_in.in_layer.weight.isnan().all()  # and offloaded again after
    finally:
        torch.use_deterministic_algorithms(deterministic)

    t, other = fresh(), torch.nn.Linear(2, 2)
    ring = OffloadRing("cpu")
    for module in (t, other):
        add_hook(module, MODEL_OFFLOAD_HOOK, ModelOffload(ring))
    ring.bring_in(other)  # the text encoder ran last
    seen = []
    t.txt_in.register_forward_pre_hook(lambda m, a: seen.append(ring.current is t))
    torch.testing.assert_close(prefix_kv(t, text), ref, atol=0, rtol=0)
    assert seen == [True], "prefix_kv ran before model offload brought the transformer in"
