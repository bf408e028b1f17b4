"""The shapes pipeline through the real loader: contract, batching invariance, CFG, sizes, previews."""

from __future__ import annotations

import os

import pytest
import torch

from omni_core.errors import ConfigError

from omni_core.testing.driver import make_state

PROMPTS = ["a red circle in the top left", "a blue square in the center", "a green triangle in the bottom right"]


def run(pipeline, states):
    return [o.tensor for o in pipeline.forward(states)]


def test_resolves_by_name_to_the_shipped_folder(shapes_pipeline):
    from omni_core.pipelines import resolve_model
    from omni_model_shapes.pipeline import ShapesPipeline
    from omni_model_shapes.weights import model_path

    resolved = resolve_model("shapes")
    assert resolved.spec.name == "ShapesPipeline"
    assert resolved.model_path == model_path()
    assert isinstance(shapes_pipeline, ShapesPipeline)
    # the folder is also addressable by path, through model_index.json
    assert resolve_model(model_path()).spec.name == "ShapesPipeline"


def test_shipped_weights_are_small_safetensors():
    from omni_model_shapes.weights import model_path

    files = [os.path.join(d, f) for d, _, fs in os.walk(model_path()) for f in fs]
    weights = [f for f in files if f.endswith(".safetensors")]
    assert len(weights) == 2
    assert sum(os.path.getsize(f) for f in weights) <= 20 * 2**20


def test_every_attention_goes_through_omni_attention(shapes_pipeline):
    from omni_core.attention import Attention

    roles = [m.role for m in shapes_pipeline.transformer.modules() if isinstance(m, Attention)]
    n = len(shapes_pipeline.transformer.blocks)
    assert roles.count("self") == n and roles.count("cross") == n
    assert not [m for m in shapes_pipeline.transformer.modules()
                if isinstance(m, torch.nn.MultiheadAttention)]


def test_output_contract(shapes_pipeline):
    out = shapes_pipeline.forward([make_state(shapes_pipeline, PROMPTS[0], seed=0)])[0]
    assert out.finished and out.status == "completed"
    assert out.tensor.shape == (1, 3, 32, 32) and out.tensor.dtype == torch.float32
    assert 0 <= out.tensor.min() and out.tensor.max() <= 1
    assert out.step_index == out.num_steps == shapes_pipeline.default_num_inference_steps


def test_batch_size_does_not_change_images(shapes_pipeline):
    p = shapes_pipeline
    alone = [run(p, [make_state(p, prompt, seed=10 + i)])[0] for i, prompt in enumerate(PROMPTS)]
    together = run(p, [make_state(p, prompt, seed=10 + i) for i, prompt in enumerate(PROMPTS)])
    for a, b in zip(alone, together):
        assert torch.equal(a, b)


def test_step_wise_with_requests_at_different_steps_matches_request_batch(shapes_pipeline):
    p = shapes_pipeline
    expected = run(p, [make_state(p, prompt, seed=20 + i) for i, prompt in enumerate(PROMPTS)])
    states = [make_state(p, prompt, seed=20 + i) for i, prompt in enumerate(PROMPTS)]
    for s in states:
        p.prepare_encode(s)
    for k, s in enumerate(states):  # stagger: request k starts 3k steps after request 0
        for _ in range(3 * (len(states) - 1 - k)):
            p.step_scheduler(s, p.denoise_step([s])[0])
    assert len({s.step_index for s in states}) == len(states)
    while not all(s.done for s in states):
        active = [s for s in states if not s.done]
        for s, pred in zip(active, p.denoise_step(active)):
            p.step_scheduler(s, pred)
    for s, e in zip(states, expected):
        assert torch.equal(p.post_decode(s).tensor, e)


def test_several_outputs_per_prompt(shapes_pipeline):
    p = shapes_pipeline
    two = run(p, [make_state(p, PROMPTS[1], seed=3, num_outputs_per_prompt=2)])[0]
    assert two.shape == (2, 3, 32, 32)
    assert not torch.equal(two[0], two[1])


def test_cfg_on_and_off(shapes_pipeline):
    p = shapes_pipeline
    batches = []
    hook = p.transformer.register_forward_pre_hook(lambda m, args: batches.append(args[0].shape[0]))
    try:
        off = run(p, [make_state(p, PROMPTS[0], seed=5, guidance_scale=1.0, num_inference_steps=4)])[0]
        on = run(p, [make_state(p, PROMPTS[0], seed=5, guidance_scale=5.0, num_inference_steps=4)])[0]
        neg = run(p, [make_state(p, PROMPTS[0], seed=5, guidance_scale=5.0, num_inference_steps=4,
                                 negative_prompt="a red circle")])[0]
    finally:
        hook.remove()
    assert batches == [1] * 4 + [2] * 8  # the unconditional branch runs only with guidance
    assert not torch.equal(off, on) and not torch.equal(on, neg)


@pytest.mark.parametrize("field, value", [("height", 30), ("width", 33)])
def test_bad_sizes_name_the_allowed_multiple(field, value):
    from omni_core.config import SamplingParams
    from omni_model_shapes.pipeline import ShapesPipeline

    with pytest.raises(ConfigError, match="multiple of 4") as err:
        ShapesPipeline.check_sampling_params(SamplingParams(**{field: value}))
    assert err.value.field == field


def test_defaults_and_extra_args():
    from omni_core.config import SamplingParams
    from omni_model_shapes.pipeline import ShapesPipeline

    sp = ShapesPipeline.check_sampling_params(SamplingParams())
    assert (sp.height, sp.width, sp.num_inference_steps) == (32, 32, ShapesPipeline.default_num_inference_steps)
    assert sp.guidance_scale == ShapesPipeline.default_guidance_scale
    with pytest.raises(ConfigError, match="upscale"):
        ShapesPipeline.check_sampling_params(SamplingParams(extra_args={"upscale": 0}))
    with pytest.raises(ConfigError, match="allowed: upscale"):
        ShapesPipeline.check_sampling_params(SamplingParams(extra_args={"zoom": 2}))


def test_pil_output_is_upscaled_for_display(shapes_pipeline):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest
    from omni_model_shapes.pipeline import ShapesPipeline

    raw = shapes_pipeline.forward([make_state(shapes_pipeline, PROMPTS[0], seed=0, num_inference_steps=2)])[0]
    for extra, size in (({}, 256), ({"upscale": 1}, 32)):
        request = OmniDiffusionRequest(prompt=PROMPTS[0], sampling_params=SamplingParams(extra_args=extra))
        out = ShapesPipeline.post_process(raw, request)
        assert out.images[0].size == (size, size)


def test_other_sizes_and_unknown_words_do_not_crash(shapes_pipeline):
    p = shapes_pipeline
    out = run(p, [make_state(p, "a shiny magenta dodecahedron, 8k", seed=0, height=48, width=24,
                             num_inference_steps=2)])[0]
    assert out.shape == (1, 3, 48, 24)
    assert p.tokenizer.unknown_words("a shiny red circle") == ["shiny"]


def test_preview_is_the_current_clean_estimate(shapes_pipeline):
    p = shapes_pipeline
    s = make_state(p, PROMPTS[0], seed=0, num_inference_steps=3)
    p.prepare_encode(s)
    assert p.preview(s) is None
    while not s.done:
        before, sigma = s.latents, s.scheduler.sigmas[s.step_index]
        velocity = p.denoise_step([s])[0]
        p.step_scheduler(s, velocity)
        # a step keeps its inputs and computes nothing for previews; a preview computes the estimate when asked
        assert s.extra["flow_step"][0] is before and s.extra["flow_step"][2] is velocity
        assert torch.equal(p.preview(s), ((before.float() - sigma * velocity)[0] + 1).div(2).clamp(0, 1))
    # at the last step the estimate is the result
    assert torch.allclose(p.preview(s), p.post_decode(s).tensor[0], atol=1e-5)


def test_modulated_input_is_what_the_block_computes(shapes_pipeline):
    tr = shapes_pipeline.transformer
    seen = {}
    attn1 = tr.blocks[1].attn1
    hook = attn1.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    block_in = {}
    hook2 = tr.blocks[1].register_forward_pre_hook(lambda m, args: block_in.setdefault("args", args))
    try:
        ids, mask = shapes_pipeline.tokenizer([PROMPTS[0], ""])
        with torch.no_grad():
            tr(torch.randn(2, 3, 32, 32), torch.tensor([500.0, 500.0]), shapes_pipeline.text_encoder(ids, mask), mask)
            hidden, temb = block_in["args"][:2]
            assert torch.equal(tr.modulated_input(1, hidden, temb), seen["x"])
    finally:
        hook.remove()
        hook2.remove()


def test_model_kwargs_are_checked(tmp_path):
    from omni_core.config import OmniDiffusionConfig
    from omni_model_shapes.pipeline import ShapesPipeline
    from omni_model_shapes.weights import model_path

    with pytest.raises(ConfigError, match="takes none"):
        ShapesPipeline.load(model_path(), OmniDiffusionConfig(model="shapes", model_kwargs={"threads": 1}))
    with pytest.raises(ConfigError, match="--cpu-threads"):  # the old per-model knob points at the engine's
        ShapesPipeline.load(model_path(), OmniDiffusionConfig(model="shapes", model_kwargs={"cpu_threads": 1}))


def test_per_sample_modules_run_in_one_call_with_the_row_by_row_bits(shapes_pipeline):
    """Per-request vectors (timestep, pooled text, adaLN modulation) go through one batched call per module,
    and every row has exactly the bits it has when computed alone (so batching never changes an image)."""
    from omni_model_shapes.models import per_sample

    tr = shapes_pipeline.transformer
    calls = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: calls.append(type(m).__name__))
    try:
        for b in (2, 5, 16):
            torch.manual_seed(b)
            t, h = torch.randn(b, 256), torch.randn(b, 128)
            for module, x in ((tr.time_embed, t), (tr.text_pool, h), (tr.blocks[0].adaLN_modulation, h),
                              (tr.out_modulation, h)):
                alone = torch.cat([module(row) for row in x.split(1)])
                calls.clear()
                assert torch.equal(per_sample(module, x, True), alone)
                assert calls.count("Linear") == 0  # no per-row module calls: the linears run as one bmm
    finally:
        hook.remove()


def test_tanh_gelu_is_torchs_tanh_approximation():
    from omni_model_shapes.models import TanhGELU

    x = torch.linspace(-8, 8, 10001)
    ref = torch.nn.functional.gelu(x.double(), approximate="tanh")
    with torch.no_grad():
        fast = TanhGELU()(x.clone())
    assert (fast.double() - ref).abs().max() < 1e-6
    y = x.clone().requires_grad_()  # training keeps an autograd-friendly form
    TanhGELU()(y).sum().backward()
    assert y.grad is not None and torch.isfinite(y.grad).all()


def test_a_waves_texts_are_encoded_in_one_call_with_the_bits_of_each_alone(shapes_pipeline, monkeypatch):
    """Inside ``encoded_prompts`` the prompts and negative prompts of every request share one text-encoder call
    (per ``max_sequence_length``), and each text's states are exactly those it gets encoded alone; outside the
    window, or for a text the window did not see, nothing is shared. (Without the embedding cache, which would
    answer texts earlier tests encoded: tests/runtime/test_embedding_cache.py.)"""
    p = shapes_pipeline
    monkeypatch.setattr(p, "embedding_cache", None)
    states = [make_state(p, "a red circle in the top left", seed=0),
              make_state(p, "a blue square in the center", seed=1, negative_prompt="blurry"),
              make_state(p, "a green triangle", seed=2, guidance_scale=1.0),  # CFG off: no negative prompt
              make_state(p, "a red circle in the top left", seed=3, max_sequence_length=5)]  # truncated
    texts = [("a red circle in the top left", None), ("", None), ("a blue square in the center", None),
             ("blurry", None), ("a green triangle", None), ("a red circle in the top left", 5), ("", 5)]
    with torch.inference_mode():
        alone = [p.encode_prompt(t, n) for t, n in texts]
        calls = []
        handle = p.text_encoder.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
        try:
            with p.encoded_prompts(states) as memo:
                assert sorted(calls) == [2, 5]  # 5 distinct texts at the default length, 2 truncated to 5 tokens
                got = [p.encode_prompt(t, n) for t, n in texts]
                assert len(memo) == 7 and len(calls) == 2  # all read from the window
                p.encode_prompt("a yellow cross", None)  # not in the window: encoded alone
                assert calls[-1] == 1
            p.encode_prompt(texts[0][0], None)
            assert len(calls) == 4  # the window is closed
        finally:
            handle.remove()
    for (a_states, a_mask), (g_states, g_mask) in zip(alone, got):
        assert torch.equal(a_states, g_states) and torch.equal(a_mask, g_mask)
