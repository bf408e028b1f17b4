"""Omni's WanPipeline against diffusers' own, on tiny random Wan 2.1 and Wan 2.2 (two experts) folders.

Parity: each Omni video equals the video diffusers makes for the same prompt alone with
``generator=torch.Generator("cpu").manual_seed(seed)`` -- at most one level of 255 apart per pixel -- and the
final latents agree to 5e-5 (batching changes float summation order only).
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState, load_pipeline, resolve_model
from omni_core.request import OmniDiffusionRequest

#: with shift=7 the 4 timesteps are [1000, 934, 781, 47]: Wan 2.2's boundary 875 gives two steps per expert
STEPS = 4
FRAMES = 9
MSL = 32
NEG = "blurry, static, low quality"
#: token lengths differ (the character tokenizer gives one token per character)
PROMPTS = ["a red fox jumps over a dog", "a cat", "an astronaut rides a horse"]

_REFERENCES: dict = {}


def reference(pipe, prompt, seed, *, negative=None, g=6.0, g2=None, height=16, width=16, n=1, msl=MSL):
    """diffusers' video ``[n, F, 3, H, W]`` and its final latents (memoised for the session)."""
    key = (id(pipe), prompt, seed, negative, g, g2, height, width, n, msl)
    if key not in _REFERENCES:
        final = {}

        def keep(_pipe, _i, _t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        video = pipe(prompt, negative_prompt=negative, guidance_scale=g, guidance_scale_2=g2, height=height,
                     width=width, num_frames=FRAMES, num_inference_steps=STEPS, num_videos_per_prompt=n,
                     max_sequence_length=msl, output_type="pt", generator=torch.Generator("cpu").manual_seed(seed),
                     callback_on_step_end=keep).frames
        _REFERENCES[key] = (video, final["latents"])
    return _REFERENCES[key]


def make_state(model_dir, prompt, seed, *, negative=None, g=6.0, g2=None, height=16, width=16, n=1, msl=MSL):
    from omni_model_wan.pipeline import WanPipeline

    params = WanPipeline.check_sampling_params(
        SamplingParams(height=height, width=width, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=g,
                       guidance_scale_2=g2, seed=seed, num_outputs_per_prompt=n, max_sequence_length=msl), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def assert_parity(state, output, ref):
    ref_video, ref_latents = ref
    assert output.tensor.shape == ref_video.shape
    levels = ((output.tensor * 255).round() - (ref_video * 255).round()).abs().max().item()
    assert levels <= 1, f"{levels} levels of 255 apart from diffusers"
    torch.testing.assert_close(state.latents, ref_latents, atol=5e-5, rtol=0)


def test_registered_through_entry_point(wan21_dir):
    from omni_core.plugins.manager import get_plugin_manager

    spec = get_plugin_manager().get_component("pipeline", "WanPipeline")
    assert spec.provider == "omni-model-wan"
    assert resolve_model(wan21_dir).spec.name == "WanPipeline"


@pytest.mark.parametrize("g", [1.0, 6.0], ids=["cfg-off", "cfg-on"])
def test_wan21_request_batch_one_prompt(wan21_dir, wan21, g):
    ref_pipe, omni = wan21
    state = make_state(wan21_dir, PROMPTS[0], 7, negative=NEG, g=g)
    (out,) = omni.forward([state])
    assert out.finished and out.num_steps == STEPS and out.tensor.shape == (1, FRAMES, 3, 16, 16)
    assert_parity(state, out, reference(ref_pipe, PROMPTS[0], 7, negative=NEG, g=g))


@pytest.mark.parametrize("g", [1.0, 6.0], ids=["cfg-off", "cfg-on"])
def test_wan21_request_batch_three_prompts_of_different_lengths(wan21_dir, wan21, g):
    ref_pipe, omni = wan21
    states = [make_state(wan21_dir, p, 10 + i, g=g) for i, p in enumerate(PROMPTS)]  # no negative: "" as diffusers
    outs = omni.forward(states)
    for i, (state, out) in enumerate(zip(states, outs)):
        assert_parity(state, out, reference(ref_pipe, PROMPTS[i], 10 + i, g=g))


def test_wan22_two_experts_request_batch(wan22_dir, wan22):
    ref_pipe, omni = wan22
    assert set(omni.experts) == {"transformer", "transformer_2"} and omni.boundary_timestep == 875.0
    calls = {"transformer": 0, "transformer_2": 0}
    hooks = [omni.experts[name].register_forward_pre_hook(lambda *a, n=name: calls.__setitem__(n, calls[n] + 1))
             for name in calls]
    try:
        states = [make_state(wan22_dir, p, 20 + i, negative=NEG, g=5.0, g2=2.0) for i, p in enumerate(PROMPTS)]
        outs = omni.forward(states)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"transformer": 2, "transformer_2": 2}  # 2 steps each: ONE call holds cond + uncond of all 3
    for i, (state, out) in enumerate(zip(states, outs)):
        assert_parity(state, out, reference(ref_pipe, PROMPTS[i], 20 + i, negative=NEG, g=5.0, g2=2.0))


def test_wan22_step_batch_requests_admitted_at_different_steps(wan22_dir, wan22):
    """Requests join at steps 0, 1, 2, so one denoise_step holds both experts; CFG on and off, different
    max_sequence_length (key-padding mask in cross-attention) and a non-square size."""
    from omni_core.testing.driver import run_step_batch

    ref_pipe, omni = wan22
    cases = [dict(prompt=PROMPTS[0], seed=1, negative=NEG, g=5.0, g2=3.0),
             dict(prompt=PROMPTS[1], seed=2, g=1.0, msl=16),
             dict(prompt=PROMPTS[2], seed=3, g=4.0, msl=24),
             dict(prompt=PROMPTS[1], seed=4, g=4.0, width=32)]
    states = [make_state(wan22_dir, **c) for c in cases]
    experts_seen = []
    denoise = omni.denoise_step

    def spy(batch):
        experts_seen.append({omni.expert_for(s)[0] for s in batch})
        return denoise(batch)

    omni.denoise_step = spy
    try:
        outs = run_step_batch(omni, states, admit_at=[0, 1, 2, 2])
    finally:
        del omni.denoise_step
    assert {"transformer", "transformer_2"} in experts_seen
    for c, state, out in zip(cases, states, outs):
        c = dict(c)
        assert_parity(state, out, reference(ref_pipe, c.pop("prompt"), c.pop("seed"), **c))


def test_non_square_and_several_outputs_per_prompt(wan21_dir, wan21):
    ref_pipe, omni = wan21
    state = make_state(wan21_dir, PROMPTS[2], 5, height=32, width=16, n=2)
    (out,) = omni.forward([state])
    assert out.tensor.shape == (2, FRAMES, 3, 32, 16)
    assert_parity(state, out, reference(ref_pipe, PROMPTS[2], 5, height=32, width=16, n=2))


def test_parity_check_has_teeth(wan22_dir, wan22, monkeypatch):
    """Ignoring the expert boundary, or the text mask, moves the result far outside the parity tolerance."""
    import omni_model_wan.pipeline as mod

    ref_pipe, omni = wan22
    ref = reference(ref_pipe, PROMPTS[1], 2, g=1.0, msl=16)
    monkeypatch.setattr(omni, "boundary_timestep", None)  # always the first expert
    state = make_state(wan22_dir, PROMPTS[1], 2, g=1.0, msl=16)
    omni.forward([state])
    assert (state.latents - ref[1]).abs().max() > 1e-3
    monkeypatch.undo()
    pad = mod.WanPipeline.pad_text
    monkeypatch.setattr(mod.WanPipeline, "pad_text", staticmethod(lambda *a: (pad(*a)[0], None)))
    states = [make_state(wan22_dir, PROMPTS[1], 2, g=1.0, msl=16), make_state(wan22_dir, PROMPTS[0], 3, msl=32)]
    omni.forward(states)
    assert (states[0].latents - ref[1]).abs().max() > 1e-3


def test_sizes_the_model_cannot_take_name_the_multiple(wan21_dir, wan22_dir):
    from omni_model_wan.pipeline import WanPipeline

    with pytest.raises(ConfigError, match=r"height=20 .*multiple of 16 .*e\.g\. 16 or 32") as err:
        WanPipeline.check_sampling_params(SamplingParams(height=20, width=16, num_frames=9), wan21_dir)
    assert err.value.field == "height"
    with pytest.raises(ConfigError, match=r"num_frames=10 .*num_frames - 1 must be a multiple of 4 .*9 or 13"):
        WanPipeline.check_sampling_params(SamplingParams(height=16, width=16, num_frames=10), wan21_dir)
    with pytest.raises(ConfigError, match="guidance_scale_2 needs a two-expert"):
        WanPipeline.check_sampling_params(SamplingParams(guidance_scale_2=2.0), wan21_dir)
    ok = WanPipeline.check_sampling_params(SamplingParams(guidance_scale_2=2.0, height=16, width=48), wan22_dir)
    assert (ok.height, ok.width, ok.num_frames, ok.guidance_scale, ok.num_inference_steps) == (16, 48, 81, 5.0, 50)


def test_guidance_scale_2_is_declared_on_the_record_and_splits_waves(wan22_dir):
    from omni_core.plugins import get_plugin_manager
    from omni_core.sched import RequestScheduler, StepScheduler
    from omni_model_wan.fields import SAMPLING_FIELDS
    from omni_model_wan.pipeline import WanPipeline

    assert get_plugin_manager().get_component("pipeline", "WanPipeline").sampling_fields == SAMPLING_FIELDS
    assert WanPipeline.sampling_fields is SAMPLING_FIELDS

    def req(rid, **kw):
        params = WanPipeline.check_sampling_params(SamplingParams(height=16, width=16, num_frames=5, **kw), wan22_dir)
        return OmniDiffusionRequest(prompt=rid, request_id=rid, sampling_params=params)

    assert req("a").sampling_params.guidance_scale_2 is None  # unset: guidance_scale applies at run time
    for sched in (RequestScheduler(), StepScheduler()):
        assert sched.batch_key(req("a", guidance_scale_2=3.0)) == sched.batch_key(req("b", guidance_scale_2=3.0))
        assert sched.batch_key(req("a", guidance_scale_2=3.0)) != sched.batch_key(req("c", guidance_scale_2=2.0))
    from omni_core.config import registered_sampling_fields

    if "true_cfg_scale" in registered_sampling_fields():  # Qwen-Image installed too: this pipeline's own refusal
        with pytest.raises(ConfigError, match=r"true_cfg_scale is not used by WanPipeline .*; use guidance_scale "
                                              r"\(and guidance_scale_2 for Wan 2.2's second expert\)") as err:
            WanPipeline.check_sampling_params(SamplingParams(true_cfg_scale=2.0), wan22_dir)
    else:  # installed alone: no model declares it, so SamplingParams itself refuses it
        with pytest.raises(ConfigError, match="unknown field 'true_cfg_scale'") as err:
            SamplingParams(true_cfg_scale=2.0)
    assert err.value.field == "true_cfg_scale"


def test_every_attention_call_goes_through_omni_layers_with_the_chosen_backend(wan22_dir):
    from omni_model_wan.attention import OmniWanAttnProcessor

    config = OmniDiffusionConfig(model=wan22_dir, dtype="float32",
                                 attention_config={"per_role": {"cross": "TORCH_SDPA"}})
    pipe = load_pipeline(resolve_model(wan22_dir), config, "cpu", torch.float32)
    layers = pipe.attention_layers
    assert len(layers) == 2 * 2 * 2  # two experts x two blocks x (attn1, attn2)
    for expert in pipe.experts.values():
        assert all(isinstance(p, OmniWanAttnProcessor) for p in expert.attn_processors.values())
    roles = {layer.prefix: (layer.role, layer.selection.source) for layer in layers}
    assert roles["transformer.blocks.0.attn2"] == ("cross", "per_role['cross']")
    assert roles["transformer_2.blocks.1.attn1"][0] == "self"
    assert all(src != "per_role['cross']" for role, src in roles.values() if role == "self")
    calls = {"self": 0, "cross": 0}
    hooks = [layer.register_forward_hook(lambda mod, a, o: calls.__setitem__(mod.role, calls[mod.role] + 1))
             for layer in layers]
    try:
        pipe.forward([make_state(wan22_dir, PROMPTS[0], 1, negative=NEG, g=5.0)])
    finally:
        for h in hooks:
            h.remove()
    # 4 steps x one call (cond + uncond folded) x 2 blocks, on whichever expert the step uses
    assert calls == {"self": STEPS * 2, "cross": STEPS * 2}


def test_preview(wan21_dir, wan21):
    _, omni = wan21
    state = omni.prepare_encode(make_state(wan21_dir, PROMPTS[1], 3, width=32))
    preview = omni.preview(state)
    assert preview.shape == (3, 16 // 8, 32 // 8) and 0 <= preview.min() and preview.max() <= 1


def test_write_mp4(tmp_path):
    import imageio.v2 as imageio
    import numpy as np

    from omni_model_wan.video import write_mp4

    frames = torch.linspace(0, 1, 9)[:, None, None, None].expand(9, 3, 32, 48).contiguous()
    path = write_mp4(frames, tmp_path / "clip.mp4", fps=8)
    reader = imageio.get_reader(path)
    read = [f for f in reader]
    assert len(read) == 9 and read[0].shape == (32, 48, 3)
    assert reader.get_meta_data()["fps"] == 8
    assert abs(float(np.mean(read[-1])) - 255) < 3 and float(np.mean(read[0])) < 3
    with pytest.raises(ValueError, match="at least one frame"):
        write_mp4([], tmp_path / "empty.mp4")


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_engine_matches_diffusers(wan22_dir, wan22, step_execution):
    """``Omni(model=<folder>)`` end to end: PIL frames equal to diffusers' within one level."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor

    from omni_core import Omni

    ref_pipe, _ = wan22
    prompts = [{"prompt": PROMPTS[0], "negative_prompt": NEG}, PROMPTS[1]]
    with Omni(wan22_dir, dtype="float32", warmup=False, max_num_seqs=2, step_execution=step_execution) as omni:
        outs = omni.generate(prompts, seed=31, height=16, width=16, num_frames=FRAMES, num_inference_steps=STEPS,
                             guidance_scale=5.0, guidance_scale_2=3.0, max_sequence_length=MSL, use_tqdm=False)
    for p, out in zip(prompts, outs):
        p = p if isinstance(p, dict) else {"prompt": p}
        video = reference(ref_pipe, p["prompt"], 31, negative=p.get("negative_prompt"), g=5.0, g2=3.0)[0][0]
        ref = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(video))
        frames = out.images[0]
        assert len(frames) == FRAMES
        for got, want in zip(frames, ref):
            assert np.abs(np.asarray(got, dtype=np.int16) - np.asarray(want, dtype=np.int16)).max() <= 1


def test_wan22_declares_one_spec_per_expert(wan22_dir, wan22):
    """Two specs (own module, heads, SP plan, TeaCache defaults by width); block signature and forward
    parameters are the real ones."""
    import inspect

    from omni_core.attention.parallel import SequenceParallelPlan
    from omni_core.pipelines.denoiser import denoisers_of

    _, omni = wan22
    specs = denoisers_of(omni)
    assert [s.name for s in specs] == ["transformer", "transformer_2"]
    for spec in specs:
        assert spec.module is omni.experts[spec.name] and spec.blocks is spec.module.blocks
        spec.check_block_signature("test")
        assert set(spec.batch_args) <= set(inspect.signature(spec.module.forward).parameters)
        assert spec.num_heads == spec.module.config.num_attention_heads
        assert isinstance(spec.sp_plan, SequenceParallelPlan) and "blocks.0" in spec.sp_plan.shard_before
        defaults = spec.defaults_for("tea_cache")  # the tiny model is narrow: the 1.3B polynomial
        assert (defaults["rel_l1_thresh"], defaults["warmup_steps"], len(defaults["coefficients"])) == (0.08, 5, 5)


def test_wan22_calls_carry_the_typed_context(wan22_dir, wan22):
    """Each expert call names its expert, branch and requests; prompts of different max_sequence_length share
    a call with a key-padding mask that the cross-attention reads."""
    from omni_core.forward_context import forward_context

    _, omni = wan22
    calls = []
    hooks = [model.register_forward_pre_hook(
        lambda mod, args, kwargs, n=name: calls.append((n, forward_context().call, kwargs["hidden_states"].shape[0])),
        with_kwargs=True) for name, model in omni.experts.items()]
    states = [make_state(wan22_dir, PROMPTS[0], 1, negative=NEG, g=5.0), make_state(wan22_dir, PROMPTS[1], 2, g=1.0,
                                                                                     msl=16)]
    try:
        omni.forward(states)
    finally:
        for h in hooks:
            h.remove()
    assert {n for n, _, _ in calls} == {"transformer", "transformer_2"}
    assert len(calls) == STEPS  # one call per step: both requests' cond rows and the guided one's uncond rows
    for name, call, batch in calls:
        assert call.expert == name and call.covers(batch)
        assert [(g.state, g.branch) for g in call.groups] == [(states[0], "cond"), (states[1], "cond"),
                                                              (states[0], "uncond")]
        assert call.text_mask.shape == (3, 32)  # 32 vs 16 text tokens
        assert not bool(call.text_mask[1, 16:].any()) and bool(call.text_mask[[0, 2]].all())
