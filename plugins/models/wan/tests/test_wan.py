"""Omni's WanPipeline against diffusers' own, on tiny random Wan 2.1 and Wan 2.2 (two experts) folders.

``TestWan21Parity`` / ``TestWan22Parity`` are the core's :class:`~omni_core.testing.DiffusersParityContract`
(request and step mode, CFG on and off, three prompts of different lengths, staggered admission -- on Wan 2.2 a
wave holds both experts --, several videos at a non-square size, one call per expert and wave equal to each
request alone) plus Wan's own: guidance_scale_2, max_sequence_length masks, the expert boundary, the first-frame
VAE, T5 embeddings, the engine end to end. Parity: at most one level of 255 per pixel, final latents within
5e-5 (batching changes float summation order only).
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.testing import DiffusersParityContract, make_state

#: with shift=7 the 4 timesteps are [1000, 934, 781, 47]: Wan 2.2's boundary 875 gives two steps per expert
STEPS = 4
FRAMES = 9
MSL = 32
SAMPLING = {"num_inference_steps": STEPS, "height": 16, "width": 16, "num_frames": FRAMES, "max_sequence_length": MSL}
NEG = "blurry, static, low quality"
#: token lengths differ (the character tokenizer gives one token per character)
PROMPTS = ["a red fox jumps over a dog", "a cat", "an astronaut rides a horse"]


class TestWan21Parity(DiffusersParityContract):
    tiny_model = "wan21"
    sampling = SAMPLING
    prompts = tuple(PROMPTS)
    negative_prompt = NEG
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 6.0, 1.0
    outputs_kwarg = "num_videos_per_prompt"
    other_size = {"width": 32}
    non_square = {"height": 32, "width": 16}

    def batch_cases(self):
        """The contract's four requests with different max_sequence_length (key-padding mask in
        cross-attention)."""
        cases = super().batch_cases()
        cases[1]["max_sequence_length"], cases[3]["max_sequence_length"] = 16, 24
        return cases

    def staggered_cases(self):
        """Different max_sequence_length too."""
        cases = super().staggered_cases()
        cases[1]["max_sequence_length"], cases[2]["max_sequence_length"] = 16, 24
        return cases


class TestWan22Parity(TestWan21Parity):
    tiny_model = "wan22"
    cfg_scale = 5.0
    #: non-square and several outputs: checked on Wan 2.1 (same code path)
    non_square = {}
    engine_requests, engine_fields = 2, {"guidance_scale_2": 3.0}

    def batch_cases(self):
        cases = super().batch_cases()
        cases[0]["guidance_scale_2"] = 2.0
        return cases

    def staggered_cases(self):
        cases = super().staggered_cases()
        cases[0]["guidance_scale_2"] = 3.0
        return cases

    def test_two_experts_request_batch_is_one_call_per_step(self):
        omni = self.omni
        assert set(omni.experts) == {"transformer", "transformer_2"} and omni.boundary_timestep == 875.0
        cases = [self.case(i, 20 + i, guidance_scale_2=2.0) for i in range(3)]
        states = [self.make_state(c) for c in cases]
        with self.denoiser_calls() as calls:
            outs = omni.forward(states)
        # 2 steps each: ONE call holds cond + uncond of all 3
        assert [name for name, _, _ in calls] == ["transformer"] * 2 + ["transformer_2"] * 2
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)

    def test_wan_parity_check_has_teeth(self, monkeypatch):
        """Ignoring the expert boundary, or the text mask, moves the result far outside the parity tolerance
        (another seed or CFG scale: the contract's check)."""
        import omni_model_wan.pipeline as mod

        case = self.case(1, 2, cfg=False, max_sequence_length=16)
        ref = self.reference(case)
        monkeypatch.setattr(self.omni, "boundary_timestep", None)  # always the first expert
        state = self.make_state(case)
        self.omni.forward([state])
        assert (state.latents - ref[1]).abs().max() > 1e-3
        monkeypatch.undo()
        pad = mod.WanPipeline.pad_text
        monkeypatch.setattr(mod.WanPipeline, "pad_text", staticmethod(lambda *a: (pad(*a)[0], None)))
        states = [self.make_state(case), self.make_state(self.case(0, 3, cfg=False))]
        self.omni.forward(states)
        assert (states[0].latents - ref[1]).abs().max() > 1e-3

    def test_vae_first_frame_convs_match_diffusers_conv3d(self):
        """Only the first latent frame (no cached frames) takes the conv2d path; the video equals diffusers' own
        decode up to float summation order."""
        z = torch.randn(2, self.omni.pipe.vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            fast = self.omni.pipe.vae.decode(z, return_dict=False)[0]
            ref = self.diffusers.vae.decode(z, return_dict=False)[0]
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)

    @pytest.mark.parametrize("msl", [512, 32, 8])
    def test_t5_embeds_equal_diffusers_padded_encoding(self, msl):
        """The text encoder runs on the longest prompt of the batch instead of max_sequence_length tokens; the
        embeddings equal diffusers' (padded to msl, zero beyond each prompt), truncation included."""
        texts = PROMPTS + [NEG, ""]
        with torch.no_grad():
            ours = self.omni.t5_embeds(texts, msl)
            ref = torch.cat([self.diffusers._get_t5_prompt_embeds(prompt=[t], max_sequence_length=msl)
                             for t in texts])
        assert ours.shape == ref.shape == (len(texts), msl, ref.shape[-1])
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
        n = int(self.omni.pipe.tokenizer(["a cat"], max_length=msl, truncation=True).attention_mask[0].__len__())
        row = ours[PROMPTS.index("a cat")]
        assert bool(row[:n].any(dim=-1).all()) and not bool(row[n:].any())  # zero after the prompt's tokens


def state_of(pipeline, prompt, seed, *, negative=None, g=6.0, g2=None, n=1, msl=MSL, **fields):
    """A request's ``StepState`` at the tiny sizes (``SAMPLING`` overridden by ``fields``)."""
    return make_state(pipeline, prompt, seed=seed, negative_prompt=negative, guidance_scale=g, guidance_scale_2=g2,
                      num_outputs_per_prompt=n, **{**SAMPLING, "max_sequence_length": msl, **fields})


def test_sizes_the_model_cannot_take_name_the_multiple(wan21_dir, wan22_dir):
    from omni_model_wan.pipeline import WanPipeline

    with pytest.raises(ConfigError, match=r"height=20 .*multiple of 16 .*e\.g\. 16 or 32") as err:
        WanPipeline.check_sampling_params(SamplingParams(height=20, width=16, num_frames=9), wan21_dir)
    assert err.value.field == "height"
    # num_frames off 4k+1 is rounded as diffusers' WanPipeline does (n // 4 * 4 + 1), with a warning
    for sent, made in ((10, 9), (32, 33), (35, 33), (2, 1), (9, 9)):
        params = WanPipeline.check_sampling_params(SamplingParams(height=16, width=16, num_frames=sent), wan21_dir)
        assert params.num_frames == made, sent
    with pytest.raises(ConfigError, match="guidance_scale_2 needs a two-expert"):
        WanPipeline.check_sampling_params(SamplingParams(guidance_scale_2=2.0), wan21_dir)
    ok = WanPipeline.check_sampling_params(SamplingParams(guidance_scale_2=2.0, height=16, width=48), wan22_dir)
    assert (ok.height, ok.width, ok.num_frames, ok.guidance_scale, ok.num_inference_steps) == (16, 48, 81, 5.0, 50)


def test_attn1_is_self_and_attn2_is_cross_in_both_experts(wan22):
    """Wan's roles by module (the contract checks routing and one call per layer and step): ``attn1`` is self-,
    ``attn2`` cross-attention, in each expert's blocks."""
    _, omni = wan22
    roles = {layer.prefix: layer.role for layer in omni.attention_layers}
    assert roles == {f"{expert}.blocks.{i}.{attn}": "self" if attn == "attn1" else "cross"
                     for expert in ("transformer", "transformer_2") for i in (0, 1) for attn in ("attn1", "attn2")}


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
    states = [state_of(omni, PROMPTS[0], 1, negative=NEG, g=5.0), state_of(omni, PROMPTS[1], 2, g=1.0,
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
