"""Omni's ZImagePipeline against diffusers' own, on one tiny random folder (float32, CPU).

Parity: each Omni image equals the image diffusers makes for the same prompt alone with
``generator=torch.Generator("cpu").manual_seed(seed)`` -- at most one level of 255 apart per pixel -- and the
final latents agree to 2e-4 (batching changes float summation order only).
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState, load_pipeline, resolve_model
from omni_core.request import OmniDiffusionRequest

STEPS = 3
#: every prompt below fits (with the chat template) and the text encoder runs on 128 padded tokens, not 512
MSL = 128
NEG = "blurry, low quality, watermark, jpeg artifacts"
#: token lengths differ (the byte tokenizer gives one token per character)
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic lighting",
           "a cat",
           "an astronaut riding a green horse on the moon"]

_REFERENCES: dict = {}


def reference(pipe, prompt, seed, *, negative=None, cfg=0.0, height=32, width=32, n=1, **extra):
    """diffusers' image ``[n, 3, H, W]`` and its final latents (memoised for the session)."""
    key = (id(pipe), prompt, seed, negative, cfg, height, width, n, tuple(sorted(extra.items())))
    if key not in _REFERENCES:
        final = {}

        def keep(_pipe, _i, _t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        images = pipe(prompt, negative_prompt=negative, guidance_scale=cfg, height=height, width=width,
                      num_inference_steps=STEPS, num_images_per_prompt=n, output_type="pt", max_sequence_length=MSL,
                      generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep, **extra).images
        _REFERENCES[key] = images, final["latents"]
    return _REFERENCES[key]


def make_state(model_dir, prompt, seed, *, negative=None, cfg=0.0, height=32, width=32, n=1, **extra):
    from omni_model_z_image.pipeline import ZImagePipeline

    params = ZImagePipeline.check_sampling_params(
        SamplingParams(height=height, width=width, num_inference_steps=STEPS, guidance_scale=cfg, seed=seed,
                       num_outputs_per_prompt=n, max_sequence_length=MSL, **extra), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def levels(a, b) -> float:
    return ((a * 255).round() - (b * 255).round()).abs().max().item()


def assert_parity(state, output, ref):
    ref_images, ref_latents = ref
    assert output.tensor.shape == ref_images.shape
    diff = levels(output.tensor, ref_images)
    assert diff <= 1, f"{diff} levels of 255 apart from diffusers"
    torch.testing.assert_close(state.latents, ref_latents, atol=2e-4, rtol=0)


def test_registered_through_entry_point(zimage_dir):
    from omni_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().get_component("pipeline", "ZImagePipeline")
    assert spec.provider == "omni-model-z-image"
    assert resolve_model(zimage_dir).spec.name == "ZImagePipeline"


@pytest.mark.parametrize("cfg", [0.0, 3.0], ids=["cfg-off", "cfg-on"])
def test_request_batch_three_prompts_of_different_lengths(zimage_dir, omni_zimage, diffusers_zimage, cfg):
    negative = NEG if cfg else None
    states = [make_state(zimage_dir, p, 10 + i, negative=negative, cfg=cfg) for i, p in enumerate(PROMPTS)]
    outs = omni_zimage.forward(states)
    assert len({s.prompt_embeds.shape[0] for s in states}) == 3  # really different text lengths in one call
    for i, (state, out) in enumerate(zip(states, outs)):
        assert out.finished and out.status == "completed" and out.num_steps == STEPS
        assert_parity(state, out, reference(diffusers_zimage, PROMPTS[i], 10 + i, negative=negative, cfg=cfg))


def test_cfg_truncation_and_renormalization_match_diffusers(zimage_dir, omni_zimage, diffusers_zimage):
    """diffusers' cfg_truncation (no CFG on late steps) and cfg_normalization (norm cap), per request in one
    batch, with the default empty negative prompt."""
    cases = [dict(cfg=4.0, cfg_truncation=0.5), dict(cfg=4.0, cfg_normalization=1.0), dict(cfg=2.0)]
    states = [make_state(zimage_dir, PROMPTS[i], 30 + i, **c) for i, c in enumerate(cases)]
    outs = omni_zimage.forward(states)
    for i, (c, state, out) in enumerate(zip(cases, states, outs)):
        assert_parity(state, out, reference(diffusers_zimage, PROMPTS[i], 30 + i, **c))
    plain = reference(diffusers_zimage, PROMPTS[1], 31, cfg=4.0)[0]
    assert levels(outs[1].tensor, plain) > 1  # the renormalization really acted


def test_step_batch_requests_admitted_at_different_steps(zimage_dir, omni_zimage, diffusers_zimage):
    from omni_core.testing.driver import run_step_batch

    cases = [dict(prompt=PROMPTS[0], seed=1, negative=NEG, cfg=4.0),
             dict(prompt=PROMPTS[1], seed=2),
             dict(prompt=PROMPTS[2], seed=3, negative=NEG, cfg=3.0)]
    states = [make_state(zimage_dir, **c) for c in cases]
    seen_steps = []
    denoise = omni_zimage.denoise_step

    def spy(batch):
        seen_steps.append(sorted(s.step_index for s in batch))
        return denoise(batch)

    omni_zimage.denoise_step = spy
    try:
        outs = run_step_batch(omni_zimage, states, admit_at=[0, 1, 2])
    finally:
        del omni_zimage.denoise_step
    assert [0, 1, 2] in seen_steps  # one denoise_step held all three at different steps
    for c, state, out in zip(cases, states, outs):
        c = dict(c)
        assert_parity(state, out, reference(diffusers_zimage, c.pop("prompt"), c.pop("seed"), **c))


def test_non_square_and_several_outputs_per_prompt(zimage_dir, omni_zimage, diffusers_zimage):
    state = make_state(zimage_dir, PROMPTS[2], 5, height=48, width=32, n=2, negative=NEG, cfg=3.0)
    (out,) = omni_zimage.forward([state])
    assert out.tensor.shape == (2, 3, 48, 32)
    assert_parity(state, out, reference(diffusers_zimage, PROMPTS[2], 5, height=48, width=32, n=2, negative=NEG,
                                        cfg=3.0))


def test_parity_check_has_teeth(zimage_dir, omni_zimage, diffusers_zimage, monkeypatch):
    """Another prompt's text, the other CFG form, or another seed moves the result far outside the tolerance."""
    import omni_model_z_image.pipeline as mod

    ref = reference(diffusers_zimage, PROMPTS[1], 11, negative=NEG, cfg=3.0)
    # the standard CFG form neg + s * (pos - neg) instead of Z-Image's pos + s * (pos - neg)
    monkeypatch.setattr(mod.ZImagePipeline, "cfg_scale", lambda self, s: s.extra["guidance"])
    state = make_state(zimage_dir, PROMPTS[1], 11, negative=NEG, cfg=3.0)
    (out,) = omni_zimage.forward([state])
    assert levels(out.tensor, ref[0]) > 5
    monkeypatch.undo()
    # rows given the wrong text: the prompt moves the image by many levels
    state = make_state(zimage_dir, PROMPTS[0], 11, negative=NEG, cfg=3.0)
    (out,) = omni_zimage.forward([state])
    assert levels(out.tensor, ref[0]) > 5
    state = make_state(zimage_dir, PROMPTS[1], 12, negative=NEG, cfg=3.0)
    (out,) = omni_zimage.forward([state])
    assert levels(out.tensor, ref[0]) > 10


def test_sizes_and_lengths_the_model_cannot_take_name_the_field(zimage_dir):
    from omni_model_z_image.pipeline import ZImagePipeline

    with pytest.raises(ConfigError, match=r"height=34 .*a multiple of 4 .*e\.g\. 32 or 36") as err:
        ZImagePipeline.check_sampling_params(SamplingParams(height=34, width=32), zimage_dir)  # tiny VAE: 2 x 2
    assert err.value.field == "height"
    with pytest.raises(ConfigError, match=r"width=1000 .*a multiple of 16") as err:
        ZImagePipeline.check_sampling_params(SamplingParams(height=1024, width=1000))  # Z-Image: 8 x 2
    assert err.value.field == "width"
    with pytest.raises(ConfigError, match=r"width=256 .*at most 128") as err:  # tiny rotary table: 32 patches
        ZImagePipeline.check_sampling_params(SamplingParams(height=32, width=256), zimage_dir)
    assert err.value.field == "width"
    with pytest.raises(ConfigError, match="max_sequence_length=300 .*at most 223") as err:
        ZImagePipeline.check_sampling_params(SamplingParams(height=32, width=32, max_sequence_length=300),
                                             zimage_dir)
    assert err.value.field == "max_sequence_length"
    with pytest.raises(ConfigError, match="cfg_truncation") as err:
        SamplingParams(cfg_truncation=1.5)
    assert err.value.field == "cfg_truncation"
    ok = ZImagePipeline.check_sampling_params(SamplingParams(height=24, width=56), zimage_dir)
    assert (ok.height, ok.width, ok.num_inference_steps, ok.guidance_scale, ok.max_sequence_length,
            ok.cfg_normalization, ok.cfg_truncation) == (24, 56, 50, 5.0, 223, 0.0, 1.0)
    default = ZImagePipeline.check_sampling_params(SamplingParams())
    assert (default.height, default.width, default.max_sequence_length) == (1024, 1024, 512)


def test_cfg_fields_are_declared_on_the_record_and_other_models_fields_refused(zimage_dir):
    from omni_core.config import registered_sampling_fields
    from omni_core.plugins import get_plugin_manager
    from omni_model_z_image.fields import SAMPLING_FIELDS
    from omni_model_z_image.pipeline import ZImagePipeline

    assert get_plugin_manager().get_component("pipeline", "ZImagePipeline").sampling_fields == SAMPLING_FIELDS
    assert ZImagePipeline.sampling_fields is SAMPLING_FIELDS
    if "true_cfg_scale" in registered_sampling_fields():  # Qwen-Image installed too
        with pytest.raises(ConfigError, match="true_cfg_scale is not used by ZImagePipeline .*guidance_scale") as err:
            ZImagePipeline.check_sampling_params(SamplingParams(height=32, width=32, true_cfg_scale=2.0), zimage_dir)
        assert err.value.field == "true_cfg_scale"


def test_turbo_folders_default_to_few_steps_without_cfg(tmp_path):
    from omni_model_z_image.pipeline import ZImagePipeline, is_turbo

    turbo = tmp_path / "models--Tongyi-MAI--Z-Image-Turbo" / "snapshots" / "abc"
    turbo.mkdir(parents=True)
    params = ZImagePipeline.check_sampling_params(SamplingParams(), str(turbo))
    assert (params.num_inference_steps, params.guidance_scale) == (8, 0.0)
    assert is_turbo(str(tmp_path / "z_image_turbo")) and not is_turbo(str(tmp_path / "Z-Image"))
    assert ZImagePipeline.check_sampling_params(SamplingParams(guidance_scale=2.0), str(turbo)).guidance_scale == 2.0


def test_every_attention_call_goes_through_omni_layers_with_the_chosen_backend(zimage_dir):
    from omni_model_z_image.attention import OmniZImageAttnProcessor

    config = OmniDiffusionConfig(model=zimage_dir, dtype="float32",
                                 attention_config={"per_role": {"joint": "TORCH_SDPA"}})
    pipe = load_pipeline(resolve_model(zimage_dir), config, "cpu", torch.float32)
    t = pipe.transformer
    layers = pipe.attention_layers
    assert len(layers) == len(t.layers) + len(t.noise_refiner) + len(t.context_refiner) == 4
    blocks = [*t.layers, *t.noise_refiner, *t.context_refiner]
    assert all(isinstance(b.attention.processor, OmniZImageAttnProcessor) for b in blocks)
    roles = {(layer.role, layer.role_category, layer.skip_sequence_parallel) for layer in layers}
    assert roles == {("joint", "self", False), ("image_refiner", "self", True), ("text_refiner", "self", True)}
    assert {layer.selection.source for layer in layers if layer.role == "joint"} == {"per_role['joint']"}
    calls = []
    hooks = [layer.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append((mod.role, kwargs.get("attn_mask") is not None)),
        with_kwargs=True) for layer in layers]
    try:
        states = [make_state(zimage_dir, PROMPTS[0], 1, negative=NEG, cfg=4.0), make_state(zimage_dir, PROMPTS[1], 2)]
        pipe.forward(states)
    finally:
        for h in hooks:
            h.remove()
    # per step: ONE call per layer over both requests' cond rows and the CFG one's uncond rows; the text and
    # unified sequences differ in length (masked), the image sequences do not
    assert sorted(calls) == sorted([("image_refiner", False), ("text_refiner", True), ("joint", True),
                                    ("joint", True)] * STEPS)

    category = OmniDiffusionConfig(model=zimage_dir, attention_config={"per_role": {"self": "TORCH_SDPA"}})
    pipe = load_pipeline(resolve_model(zimage_dir), category, "cpu", torch.float32)
    assert {layer.selection.source for layer in pipe.attention_layers} == {"per_role['self'] (role category)"}


def test_preview_and_pil_output(zimage_dir, omni_zimage):
    from omni_model_z_image.pipeline import ZImagePipeline

    state = make_state(zimage_dir, PROMPTS[1], 3, width=48)
    omni_zimage.prepare_encode(state)
    preview = omni_zimage.preview(state)
    assert preview.shape == (3, 32 // 2, 48 // 2) and 0 <= preview.min() and preview.max() <= 1
    (out,) = omni_zimage.forward([make_state(zimage_dir, PROMPTS[1], 3, width=48)])
    out = ZImagePipeline.post_process(out, make_state(zimage_dir, PROMPTS[1], 3).request)
    assert out.images[0].size == (48, 32) and out.images[0].mode == "RGB"


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_engine_matches_diffusers(zimage_dir, diffusers_zimage, step_execution):
    """``Omni(model=<folder>)`` end to end: three prompts batched, PIL images equal to diffusers' within 1 level."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor

    from omni_core import Omni

    prompts = [{"prompt": PROMPTS[0], "negative_prompt": NEG}, PROMPTS[1], {"prompt": PROMPTS[2]}]
    with Omni(zimage_dir, dtype="float32", warmup=False, max_num_seqs=3, step_execution=step_execution,
              cpu_threads=1) as omni:
        outs = omni.generate(prompts, seed=21, height=32, width=32, num_inference_steps=STEPS, guidance_scale=3.0,
                             max_sequence_length=MSL, use_tqdm=False)
    for p, out in zip(prompts, outs):
        p = p if isinstance(p, dict) else {"prompt": p}
        ref = reference(diffusers_zimage, p["prompt"], 21, negative=p.get("negative_prompt"), cfg=3.0)[0][0]
        ref = np.asarray(VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(ref[None]))[0], dtype=np.int16)
        assert np.abs(np.asarray(out.images[0], dtype=np.int16) - ref).max() <= 1


def test_denoiser_spec_matches_the_transformer(zimage_dir, omni_zimage):
    """The declared spec is what accelerators rely on: the real block signature, forward parameters, heads,
    the SP plan's module paths, TeaCache's signal (one row per batch row, from block 0's real inputs)."""
    import inspect

    from omni_core.attention.parallel import SequenceParallelPlan
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(omni_zimage)
    t = omni_zimage.transformer
    assert spec.name == "transformer" and spec.module.transformer is t and spec.blocks is t.layers
    spec.check_block_signature("test")
    assert set(spec.batch_args) <= set(inspect.signature(spec.module.forward).parameters)
    assert spec.num_heads == t.config.n_heads == 2
    plan = spec.sp_plan
    assert isinstance(plan, SequenceParallelPlan)
    for name in [*plan.shard_before, *plan.gather_after]:
        spec.module.get_submodule(name)
    assert spec.rows_separable and spec.defaults_for("tea_cache") == {}  # no published coefficients

    seen = {}

    def grab(block, args, kwargs):
        seen.setdefault("signal", spec.modulated_input(t, block, {**dict(zip(spec.block_params, args)), **kwargs}))

    hook = spec.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        omni_zimage.forward([make_state(zimage_dir, PROMPTS[0], 1), make_state(zimage_dir, PROMPTS[1], 2, n=2)])
    finally:
        hook.remove()
    assert seen["signal"].shape[0] == 3  # one row per image of the call


def test_every_transformer_call_carries_the_typed_context(zimage_dir, omni_zimage):
    """Each call says which requests its rows belong to, the CFG branch and the expert."""
    from omni_core.forward_context import forward_context

    calls = []
    module = omni_zimage.experts["transformer"]
    hook = module.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append((forward_context().call, kwargs["hidden_states"].shape[0])),
        with_kwargs=True)
    states = [make_state(zimage_dir, PROMPTS[0], 1, negative=NEG, cfg=4.0), make_state(zimage_dir, PROMPTS[1], 2, n=2)]
    try:
        omni_zimage.forward(states)
    finally:
        hook.remove()
    assert len(calls) == STEPS  # the CFG branches are folded into one call per step
    for call, batch in calls:
        assert call.expert == "transformer" and call.covers(batch)
    assert [(g.state, g.rows, g.branch) for g in calls[0][0].groups] == [
        (states[0], 1, "cond"), (states[1], 2, "cond"), (states[0], 1, "uncond")]


def test_renormalization_on_a_cfg_parallel_rank_without_the_cond_branch(zimage_dir, omni_zimage):
    """A cfg-parallel rank that ran only the uncond rows recovers the cond prediction from the guided one and
    caps the norm exactly as the rank that has it."""
    state = make_state(zimage_dir, PROMPTS[1], 1, cfg=4.0, cfg_normalization=1.0)
    omni_zimage.prepare_encode(state)
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(2, 16, 1, 16, 16, generator=g), torch.randn(2, 16, 1, 16, 16, generator=g)
    pred = pos + 4.0 * (pos - neg)
    state.extra.update(pred_cond=pos, pred_uncond=neg)
    full = omni_zimage._renormalize(state, pred)
    del state.extra["pred_cond"]
    recovered = omni_zimage._renormalize(state, pred)
    torch.testing.assert_close(recovered, full, atol=1e-5, rtol=0)
    norms = torch.linalg.vector_norm(full.flatten(1), dim=1)
    torch.testing.assert_close(norms, torch.linalg.vector_norm(pos.flatten(1), dim=1))  # capped at 1.0 x |pos|
