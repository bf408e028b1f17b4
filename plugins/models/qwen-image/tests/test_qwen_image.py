"""Omni's QwenImagePipeline against diffusers' own, on one tiny random folder (float32, CPU).

``TestQwenImageParity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step mode,
CFG on and off, three prompts of different lengths padded and masked in a batch, staggered admission, several
outputs at a non-square size, one call per wave equal to each request alone) plus Qwen-Image's own: the
key-padding mask, branches folded alone only without a mask, the single-frame VAE, the engine end to end.
Parity: at most one level of 255 per pixel, final latents within 5e-5.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.testing import DiffusersParityContract, make_state

STEPS = 3
SAMPLING = {"num_inference_steps": STEPS, "height": 32, "width": 32}
NEG = "blurry, low quality, watermark, jpeg artifacts"
#: token lengths differ (the byte tokenizer gives one token per character)
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic lighting",
           "a cat",
           "an astronaut riding a green horse on the moon"]


class TestQwenImageParity(DiffusersParityContract):
    pipeline_class = "QwenImagePipeline"
    tiny_model = "qwen"
    sampling = SAMPLING
    prompts = tuple(PROMPTS)
    negative_prompt = NEG
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    other_size = {"width": 48}
    non_square = {"height": 48, "width": 32}
    #: alone, prompts of different lengths run their branches as two unmasked calls, as diffusers does
    alone_folds_branches = False

    def test_prompts_are_padded_and_masked_in_one_call(self):
        states = [self.make_state(self.case(i, seed)) for i, seed in enumerate(self.seeds)]
        self.omni.forward(states)
        assert len({s.prompt_embeds.shape[1] for s in states}) == 3  # really padded and masked

    def test_qwen_parity_check_has_teeth(self, monkeypatch):
        """Dropping the key-padding mask moves the result far outside the parity tolerance (another seed or CFG
        scale: the contract's check)."""
        import omni_model_qwen_image.pipeline as mod

        cases = [self.case(i, seed, cfg=False) for i, seed in enumerate(self.seeds)]
        pad = mod.QwenImagePipeline.pad_text
        monkeypatch.setattr(mod.QwenImagePipeline, "pad_text", staticmethod(lambda *a: (pad(*a)[0], None)))
        states = [self.make_state(c) for c in cases]
        self.omni.forward(states)
        assert (states[1].latents - self.reference(cases[1])[1]).abs().max() > 1e-3

    def test_a_request_alone_folds_its_branches_only_when_no_mask_is_needed(self):
        """Alone, the branches share one call when the prompts have the same token length (no padding), and run
        as two unmasked calls (diffusers' shape) when they differ."""
        with self.denoiser_calls() as calls:
            self.omni.forward([self.make_state({**self.case(1, 1), "negative_prompt": "a dog"})])  # 5 tokens each
            same = [batch for _, _, batch in calls]
            calls.clear()
            self.omni.forward([self.make_state(self.case(0, 1))])
        assert same == [2] * STEPS
        assert [batch for _, _, batch in calls] == [1, 1] * STEPS

    def test_vae_single_frame_convs_match_diffusers_conv3d(self, monkeypatch):
        """The decoder's causal Conv3d on one frame with no cache runs as conv2d (the last temporal kernel
        slice) and gives diffusers' own decode up to float summation order."""
        from omni_core.pipelines.diffusers_step import _SingleFrameCausalConv

        omni_qwen, diffusers_qwen = self.omni, self.diffusers
        convs = [m for m in omni_qwen.pipe.vae.modules()
                 if isinstance(m.__dict__.get("forward"), _SingleFrameCausalConv)]
        assert convs and not any("forward" in m.__dict__ for m in diffusers_qwen.vae.modules()
                                 if isinstance(m, torch.nn.Conv3d))
        conv2d = torch.nn.functional.conv2d
        used = []
        monkeypatch.setattr(torch.nn.functional, "conv2d", lambda *a, **k: used.append(1) or conv2d(*a, **k))
        z = torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            fast = omni_qwen.pipe.vae.decode(z, return_dict=False)[0]
            monkeypatch.undo()
            ref = diffusers_qwen.vae.decode(z, return_dict=False)[0]
        assert len(used) >= len([m for m in convs if m in set(omni_qwen.pipe.vae.decoder.modules())])
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)


def state_of(pipeline, prompt, seed, *, negative=None, cfg=1.0, n=1, **fields):
    """A request's ``StepState`` at the tiny sizes (``SAMPLING`` overridden by ``fields``)."""
    return make_state(pipeline, prompt, seed=seed, negative_prompt=negative, true_cfg_scale=cfg,
                      num_outputs_per_prompt=n, **{**SAMPLING, **fields})


def test_sizes_the_model_cannot_take_name_the_multiple(qwen_dir):
    from omni_model_qwen_image.pipeline import QwenImagePipeline

    with pytest.raises(ConfigError, match=r"height=36 .*a multiple of 8 .*e\.g\. 32 or 40"):
        QwenImagePipeline.check_sampling_params(SamplingParams(height=36, width=32), qwen_dir)  # tiny VAE: 4 x 2
    with pytest.raises(ConfigError, match=r"width=1000 .*a multiple of 16") as err:
        QwenImagePipeline.check_sampling_params(SamplingParams(height=1024, width=1000))  # Qwen-Image: 8 x 2
    assert err.value.field == "width"
    with pytest.raises(ConfigError, match="max_sequence_length=2048"):
        QwenImagePipeline.check_sampling_params(SamplingParams(max_sequence_length=2048), qwen_dir)
    ok = QwenImagePipeline.check_sampling_params(SamplingParams(height=24, width=56), qwen_dir)
    assert (ok.height, ok.width, ok.num_inference_steps, ok.true_cfg_scale) == (24, 56, 50, 4.0)
    default = QwenImagePipeline.check_sampling_params(SamplingParams())
    assert (default.height, default.width) == (1024, 1024)


def test_denoiser_spec_matches_the_transformer(qwen_dir, omni_qwen):
    """The declared spec is what accelerators rely on: the real block signature, forward parameters, heads,
    the SP plan, TeaCache's signal (one row per batch row, computed from block 0's real inputs) and defaults."""
    import inspect

    from omni_core.attention.parallel import SequenceParallelPlan
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(omni_qwen)
    t = omni_qwen.transformer
    assert spec.name == "transformer" and spec.module is t and spec.blocks is t.transformer_blocks
    spec.check_block_signature("test")
    assert set(spec.batch_args) <= set(inspect.signature(t.forward).parameters)
    assert spec.num_heads == t.config.num_attention_heads == 3
    assert isinstance(spec.sp_plan, SequenceParallelPlan) and spec.sp_plan.joint_text_input == "encoder_hidden_states"
    assert spec.rows_separable
    defaults = spec.defaults_for("tea_cache")
    assert defaults["rel_l1_thresh"] == 0.2 and defaults["warmup_steps"] == 1 and len(defaults["coefficients"]) == 5

    seen = {}

    def grab(block, args, kwargs):
        names = spec.block_params
        seen.setdefault("signal", spec.modulated_input(t, block, {**dict(zip(names, args)), **kwargs}))

    hook = spec.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        omni_qwen.forward([state_of(omni_qwen, PROMPTS[0], 1), state_of(omni_qwen, PROMPTS[1], 2, n=2)])
    finally:
        hook.remove()
    assert seen["signal"].shape[0] == 3  # one row per image of the call


def test_every_transformer_call_carries_the_typed_context(qwen_dir, omni_qwen):
    """Each call says which requests its rows belong to, the CFG branch, the expert and the text mask."""
    from omni_core.forward_context import forward_context

    calls = []
    hook = omni_qwen.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append((forward_context().call, kwargs["hidden_states"].shape[0])),
        with_kwargs=True)
    states = [state_of(omni_qwen, PROMPTS[0], 1, negative=NEG, cfg=4.0), state_of(omni_qwen, PROMPTS[1], 2, n=2)]
    try:
        omni_qwen.forward(states)
    finally:
        hook.remove()
    assert len(calls) == STEPS  # the CFG branches are folded into one call per step
    for call, batch in calls:
        assert call.expert == "transformer" and call.covers(batch)
    call = calls[0][0]
    assert [(g.state, g.rows, g.branch) for g in call.groups] == [(states[0], 1, "cond"), (states[1], 2, "cond"),
                                                                  (states[0], 1, "uncond")]
    longest = max(states[0].negative_prompt_embeds.shape[1], *(s.prompt_embeds.shape[1] for s in states))
    assert call.text_mask.shape == (4, longest)  # prompts differ in length
    assert not bool(call.text_mask[3, states[0].negative_prompt_embeds.shape[1]:].any())


def test_sequence_parallel_refused_for_zero_cond_t_before_workers(tmp_path):
    import json

    from omni_model_qwen_image.pipeline import QwenImagePipeline

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"num_attention_heads": 4, "zero_cond_t": True}))
    with pytest.raises(ConfigError, match="zero_cond_t") as err:
        QwenImagePipeline.check_parallel_config({"ulysses_degree": 2}, str(tmp_path))
    assert err.value.field == "parallel_config"
    QwenImagePipeline.check_parallel_config({"cfg_parallel_size": 2}, str(tmp_path))  # cfg parallel still works
    with pytest.raises(ConfigError, match="ulysses_degree=3"):
        QwenImagePipeline.check_parallel_config({"ulysses_degree": 3}, str(tmp_path))  # heads from the folder
