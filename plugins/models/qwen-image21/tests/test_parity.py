"""Omni's QwenImage21Pipeline against diffusers' own, on one tiny random folder (float32, CPU).

``TestQwenImage21Parity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step mode,
CFG on, off and mixed, three prompts of different lengths whose prefixes are padded and masked in one call,
staggered admission: a request joining a running wave brings its own prefix cache, several outputs at a
non-square size, one call per wave equal to each request alone, the engine end to end) plus Qwen-Image 2.1's own:
the prefix key/value cache per request, the per-row rotary tables. Parity: at most one level of 255 per pixel,
final latents within 5e-5.
"""

from __future__ import annotations

import torch

from omni_core.testing import DiffusersParityContract

SAMPLING = {"num_inference_steps": 3, "height": 32, "width": 32}
#: token lengths differ (the byte tokenizer gives one token per character)
PROMPTS = ("a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic",
           "a cat",
           "an astronaut riding a green horse")


class TestQwenImage21Parity(DiffusersParityContract):
    tiny_model = "q21"
    sampling = SAMPLING
    prompts = PROMPTS
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    other_size = {"width": 64}
    non_square = {"height": 64, "width": 32}
    #: alone, branches whose prefixes differ in length run as two unmasked calls, as diffusers does
    alone_folds_branches = False

    def reference(self, case):
        """diffusers' output cut to its RGB channels (the 2.1 VAE decodes RGBA; Omni returns RGB: see
        ``QwenImage21Pipeline.decode_latents``), and its final latents."""
        images, latents = super().reference(case)
        return images[:, :3], latents

    def test_prefix_cache_equals_diffusers_extract_step(self):
        """``prefix_kv`` (the prefix alone) holds what diffusers' first step stores in its ``QwenImage21KVCache``
        (the whole joint sequence, ``kv_cache_mode="extract"``): every block's post-RoPE keys and values."""
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        from omni_model_qwen_image21.model import prefix_kv

        pipe = self.diffusers
        embeds, _, img_mask = pipe._get_qwen_prompt_embeds([PROMPTS[0]], None, "cpu")
        latents = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(0))  # 32x32: 2x2 latents, 4 tokens
        img_mask = torch.cat([img_mask, img_mask.new_ones(1, 1)], dim=1)
        cache = QwenImage21KVCache(len(pipe.transformer.transformer_blocks))
        with torch.no_grad():
            pipe.transformer(hidden_states=latents, timestep=torch.tensor([0.7]), encoder_hidden_states=embeds,
                             img_shapes=[[(1, 2, 2)]], img_mask=img_mask, kv_cache=cache, kv_cache_mode="extract")
        ours = prefix_kv(self.omni.transformer, embeds)
        layers = len(cache.layer_caches)
        assert ours.shape[:2] == embeds.shape[:2]
        ours = ours.unflatten(-1, (layers, 2, *cache.layer_caches[0].k.shape[2:]))
        for i, layer in enumerate(cache.layer_caches):
            torch.testing.assert_close(ours[:, :, i, 0], layer.k, atol=2e-5, rtol=0)
            torch.testing.assert_close(ours[:, :, i, 1], layer.v, atol=2e-5, rtol=0)

    def test_prefix_is_computed_once_per_request_and_branch_and_joins_with_its_request(self, monkeypatch):
        """Staggered step mode: each request's prefix is computed once per branch when it is admitted, never per
        step; every denoiser call gets only the target image tokens, and each row the prefix of its own text."""
        import omni_model_qwen_image21.model as model
        from omni_core.testing import run_step_batch

        made = []
        real = model.prefix_kv
        monkeypatch.setattr(model, "prefix_kv", lambda t, text: made.append(text.shape[1]) or real(t, text))
        cases = self.staggered_cases()
        states = [self.make_state(c) for c in cases]
        seen = []
        with self.denoiser_calls() as calls:
            hook = self.omni.transformer.register_forward_pre_hook(
                lambda m, a, kw: seen.append((kw["hidden_states"].shape[1], kw["prefix_kv"].shape[1])),
                with_kwargs=True)
            try:
                run_step_batch(self.omni, states, admit_at=[0, 1, 2])
            finally:
                hook.remove()
        branches = sum(1 + bool(s.extra["do_cfg"]) for s in states)
        assert len(made) == branches  # once per request and branch, not per step
        for s in states:
            for branch, kv in s.extra["prefix"].items():
                text = s.prompt_embeds if branch == "cond" else s.negative_prompt_embeds
                assert kv.shape[1] == text.shape[1]
        tokens = {s.latents.shape[1] for s in states}
        assert len(calls) >= sum(s.num_steps for s in states) // 2 and all(n in tokens for n, _ in seen)

    def test_prefix_mask_and_per_row_rotary_have_teeth(self, monkeypatch):
        """Batched prompts of different lengths: the prefix padding is hidden by the mask (padding filled with noise
        changes nothing), and dropping the mask, or giving every row the rotary table of the longest prefix, moves
        the result far outside the parity tolerance (zero padding alone would barely show: zero keys get little
        weight next to the sharpened real ones)."""
        import omni_model_qwen_image21.pipeline as mod

        cases = [self.case(i, seed, cfg=False) for i, seed in enumerate(self.seeds)]
        ref = self.reference(cases[1])[1]

        def run() -> float:
            states = [self.make_state(c) for c in cases]
            self.omni.forward(states)
            return float((states[1].latents - ref).abs().max())

        assert run() <= self.latents_atol
        pad = mod.QwenImage21Pipeline.pad_text

        def noisy(*a):
            e, mask = pad(*a)
            noise = torch.randn(e.shape, generator=torch.Generator().manual_seed(0)) * 3
            return (e, mask) if mask is None else (torch.where(mask[..., None], e, noise), mask)

        with monkeypatch.context() as m:
            m.setattr(mod.QwenImage21Pipeline, "pad_text", staticmethod(noisy))
            assert run() <= self.latents_atol
            m.setattr(mod.QwenImage21Pipeline, "pad_text", staticmethod(lambda *a: (noisy(*a)[0], None)))
            assert run() > 1e-3
        def shared_layout(p, segs, rows):  # diffusers' one layout per call: the longest prefix for every row
            longest = max(p.segment_text(s, b)[0].shape[1] for s, b in segs)
            return torch.cat([p.target_table(longest, s)[None].expand(r, -1, -1) for (s, _), r in zip(segs, rows)])

        with monkeypatch.context() as m:
            m.setattr(mod.QwenImage21Pipeline, "rotary_rows", shared_layout)
            assert run() > 1e-3


def test_sizes_defaults_and_fields(q21_dir, tmp_path):
    """Multiples of 32 (diffusers' fixed VAE factor 16 x 2), diffusers' defaults (1024x1024, 40 steps,
    ``true_cfg_scale`` 1.0), a folder's ``sample_sigmas`` deciding the default step count and the grid."""
    import json
    import types

    import pytest

    from omni_core.config import SamplingParams
    from omni_core.errors import ConfigError
    from omni_model_qwen_image21.pipeline import QwenImage21Pipeline

    with pytest.raises(ConfigError, match=r"height=48 .*a multiple of 32") as err:
        QwenImage21Pipeline.check_sampling_params(SamplingParams(height=48, width=32), q21_dir)
    assert err.value.field == "height"
    p = QwenImage21Pipeline.check_sampling_params(SamplingParams(), q21_dir)
    assert (p.height, p.width, p.num_inference_steps, p.true_cfg_scale) == (1024, 1024, 40, 1.0)
    index = json.loads(open(f"{q21_dir}/model_index.json").read())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.8, 0.5, 0.2]}))
    assert QwenImage21Pipeline.check_sampling_params(SamplingParams(), str(tmp_path)).num_inference_steps == 4
    from omni_model_qwen_image21.pipeline import sample_sigmas_for

    pipe = types.SimpleNamespace(config=types.SimpleNamespace(sample_sigmas=[1.0, 0.8, 0.5, 0.2]))
    assert sample_sigmas_for(pipe, 4) == [1.0, 0.8, 0.5, 0.2]
    assert list(sample_sigmas_for(pipe, 2)) == [1.0, 0.5]
