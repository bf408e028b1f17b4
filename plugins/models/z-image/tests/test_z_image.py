"""Omni's ZImagePipeline against diffusers' own, on one tiny random folder (float32, CPU).

``TestZImageParity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step mode,
CFG on and off, three prompts of different lengths in a batch, staggered admission, several outputs at a
non-square size, one call per wave equal to each request alone) plus Z-Image's own: cfg_truncation and
cfg_normalization, its CFG form, and the engine end to end. Parity: at most one level of 255 per pixel, final
latents within 2e-4 (batching changes float summation order only).
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.testing import DiffusersParityContract, levels_apart, make_state

STEPS = 3
#: every prompt below fits (with the chat template) and the text encoder runs on 128 padded tokens, not 512
MSL = 128
SAMPLING = {"num_inference_steps": STEPS, "height": 32, "width": 32, "max_sequence_length": MSL}
NEG = DiffusersParityContract.negative_prompt
#: token lengths differ (the byte tokenizer gives one token per character)
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic lighting",
           "a cat",
           "an astronaut riding a green horse on the moon"]


class TestZImageParity(DiffusersParityContract):
    tiny_model = "zimage"
    sampling = SAMPLING
    prompts = tuple(PROMPTS)
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 3.0, 0.0
    other_size = {"width": 48}
    non_square = {"height": 48, "width": 32}
    latents_atol = 2e-4
    batch_latents_atol, batch_atol = 2e-4, 1e-3

    def batch_cases(self):
        """The contract's four requests, one with cfg_truncation (no uncond rows on late steps)."""
        cases = super().batch_cases()
        cases[2]["cfg_truncation"] = 0.2
        return cases

    def guided_at(self, state, step):
        """diffusers' truncation: no uncond rows on a step whose (1000 - t) / 1000 exceeds cfg_truncation."""
        t = state.timesteps[step].item()
        return super().guided_at(state, step) and (1000 - t) / 1000 <= state.extra["cfg_truncation"]

    def test_cfg_truncation_and_renormalization_match_diffusers(self):
        """diffusers' cfg_truncation (no CFG on late steps) and cfg_normalization (norm cap), per request in one
        batch, with the default empty negative prompt."""
        cases = [self.case(0, 30, cfg=4.0, negative=None, cfg_truncation=0.5),
                 self.case(1, 31, cfg=4.0, negative=None, cfg_normalization=1.0),
                 self.case(2, 32, cfg=2.0, negative=None)]
        states = [self.make_state(c) for c in cases]
        outs = self.omni.forward(states)
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)
        plain = self.reference(self.case(1, 31, cfg=4.0, negative=None))[0]
        assert levels_apart(outs[1].tensor, plain) > 1  # the renormalization really acted

    def test_each_call_is_one_diffusers_transformer_call_with_every_row(self):
        """The wrapper module the spec declares runs diffusers' transformer once per call, on all its rows."""
        states = [self.make_state(c) for c in self.batch_cases()]
        inner = []
        hook = self.omni.transformer.register_forward_pre_hook(lambda mod, args: inner.append(len(args[0])))
        try:
            with self.denoiser_calls() as calls:
                self.omni.forward(states)
        finally:
            hook.remove()
        assert inner == [batch for _, _, batch in calls]

    def test_z_image_parity_check_has_teeth(self, monkeypatch):
        """Another prompt's text, or the other CFG form, moves the result far outside the tolerance (another
        seed or CFG scale: the contract's check)."""
        import omni_model_z_image.pipeline as mod

        case = self.case(1, 11)
        ref = self.reference(case)
        # the standard CFG form neg + s * (pos - neg) instead of Z-Image's pos + s * (pos - neg)
        monkeypatch.setattr(mod.ZImagePipeline, "cfg_scale", lambda self, s: s.extra["guidance"])
        (out,) = self.omni.forward([self.make_state(case)])
        assert levels_apart(out.tensor, ref[0]) > 5
        monkeypatch.undo()
        # rows given the wrong text: the prompt moves the image by many levels
        (out,) = self.omni.forward([self.make_state({**case, "prompt": PROMPTS[0]})])
        assert levels_apart(out.tensor, ref[0]) > 5


def state_of(pipeline, prompt, seed, *, negative=None, cfg=0.0, n=1, **fields):
    """A request's ``StepState`` at the tiny sizes (``SAMPLING`` overridden by ``fields``)."""
    return make_state(pipeline, prompt, seed=seed, negative_prompt=negative, guidance_scale=cfg,
                      num_outputs_per_prompt=n, **{**SAMPLING, **fields})


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


def test_turbo_folders_default_to_few_steps_without_cfg(tmp_path):
    from omni_model_z_image.pipeline import ZImagePipeline, is_turbo

    turbo = tmp_path / "models--Tongyi-MAI--Z-Image-Turbo" / "snapshots" / "abc"
    turbo.mkdir(parents=True)
    params = ZImagePipeline.check_sampling_params(SamplingParams(), str(turbo))
    assert (params.num_inference_steps, params.guidance_scale) == (8, 0.0)
    assert is_turbo(str(tmp_path / "z_image_turbo")) and not is_turbo(str(tmp_path / "Z-Image"))
    assert ZImagePipeline.check_sampling_params(SamplingParams(guidance_scale=2.0), str(turbo)).guidance_scale == 2.0


def test_attention_roles_and_which_calls_are_masked(omni_zimage):
    """Z-Image's own roles (the contract checks routing and one call per layer and step): the refiners run
    before the sequences are joined (never sharded), and a batch of prompts of different lengths masks the text
    and unified sequences but not the image ones."""
    layers = omni_zimage.attention_layers
    roles = {(layer.role, layer.role_category, layer.skip_sequence_parallel) for layer in layers}
    assert roles == {("joint", "self", False), ("image_refiner", "self", True), ("text_refiner", "self", True)}
    calls = []
    hooks = [layer.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append((mod.role, kwargs.get("attn_mask") is not None)),
        with_kwargs=True) for layer in layers]
    try:
        omni_zimage.forward([state_of(omni_zimage, PROMPTS[0], 1, negative=NEG, cfg=4.0),
                             state_of(omni_zimage, PROMPTS[1], 2)])
    finally:
        for h in hooks:
            h.remove()
    assert sorted(calls) == sorted([("image_refiner", False), ("text_refiner", True), ("joint", True),
                                    ("joint", True)] * STEPS)


def test_denoiser_spec_wraps_the_transformer_without_teacache_coefficients(omni_zimage):
    """Z-Image's own declarations (the pipeline contract checks signatures, batch args, heads, the SP plan's
    paths and the signal's rows): a wrapper module around diffusers' transformer whose main layers are the
    blocks, separable rows, and no published TeaCache coefficients."""
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(omni_zimage)
    t = omni_zimage.transformer
    assert spec.name == "transformer" and spec.module.transformer is t and spec.blocks is t.layers
    assert spec.num_heads == t.config.n_heads == 2 and spec.sp_plan is not None
    assert spec.rows_separable and spec.defaults_for("tea_cache") == {}

def test_renormalization_on_a_cfg_parallel_rank_without_the_cond_branch(zimage_dir, omni_zimage):
    """A cfg-parallel rank that ran only the uncond rows recovers the cond prediction from the guided one and
    caps the norm exactly as the rank that has it."""
    state = state_of(omni_zimage, PROMPTS[1], 1, cfg=4.0, cfg_normalization=1.0)
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
