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
NEG = DiffusersParityContract.negative_prompt
#: token lengths differ (the byte tokenizer gives one token per character)
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic lighting",
           "a cat",
           "an astronaut riding a green horse on the moon"]


class TestQwenImageParity(DiffusersParityContract):
    tiny_model = "qwen"
    sampling = SAMPLING
    prompts = tuple(PROMPTS)
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    other_size = {"width": 48}
    non_square = {"height": 48, "width": 32}
    #: alone, prompts of different lengths run their branches as two unmasked calls, as diffusers does
    alone_folds_branches = False

    def test_prompts_are_padded_and_masked_in_one_call(self):
        """Each call's text mask has a row per batch row, as long as the longest text, and masks the padding."""
        states = [self.make_state(self.case(i, seed)) for i, seed in enumerate(self.seeds)]
        with self.denoiser_calls() as calls:
            self.omni.forward(states)
        lengths = [s.prompt_embeds.shape[1] for s in states]
        assert len(set(lengths)) == 3  # really padded and masked
        for _, call, batch in calls:
            rows = [(g.state, g.branch) for g in call.groups for _ in range(g.rows)]
            texts = [(s.prompt_embeds if branch == "cond" else s.negative_prompt_embeds).shape[1] for s, branch in rows]
            assert call.text_mask.shape == (batch, max(texts))
            assert [int(row.sum()) for row in call.text_mask] == texts

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
        from omni_core.hooks import get_hook
        from omni_core.pipelines.vae_convs import SINGLE_FRAME_CONV, _SingleFrameCausalConv

        omni_qwen, diffusers_qwen = self.omni, self.diffusers
        convs = [m for m in omni_qwen.pipe.vae.modules()
                 if isinstance(get_hook(m, SINGLE_FRAME_CONV), _SingleFrameCausalConv)]
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


def test_denoiser_spec_declares_the_joint_text_and_teacache_defaults(omni_qwen):
    """Qwen-Image's own declarations (the pipeline contract checks signatures, batch args, heads, the SP plan's
    paths and the signal's rows): the text joined to the image sequence, separable rows, the published
    TeaCache polynomial."""
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(omni_qwen)
    t = omni_qwen.transformer
    assert spec.name == "transformer" and spec.module is t and spec.blocks is t.transformer_blocks
    assert spec.num_heads == 3 and spec.rows_separable
    assert spec.sp_plan.joint_text_input == "encoder_hidden_states"
    defaults = spec.defaults_for("tea_cache")
    assert defaults["rel_l1_thresh"] == 0.2 and defaults["warmup_steps"] == 1 and len(defaults["coefficients"]) == 5

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
