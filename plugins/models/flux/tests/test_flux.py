"""Omni's FluxPipeline against diffusers' own, on tiny random FLUX.1-dev and schnell folders (float32, CPU).

``TestFluxParity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step mode, CFG
on and off, three prompts in a batch, staggered admission, several outputs at a non-square size, one call per
wave equal to each request alone) plus FLUX's own: schnell (no guidance input), embedded guidance per row, the
pooled CLIP projection of the negative branch, and the engine end to end. Parity: at most one level of 255 per
value, final packed latents within 5e-5 (batching changes float summation order only).
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import resolve_model
from omni_core.testing import DiffusersParityContract, levels_apart, make_state

STEPS = 3
MSL = 64  # T5 tokens (one per character with the tiny tokenizer): no prompt below is truncated
SAMPLING = {"num_inference_steps": STEPS, "height": 16, "width": 16, "max_sequence_length": MSL}
NEG = DiffusersParityContract.negative_prompt
PROMPTS = list(DiffusersParityContract.prompts)


class TestFluxParity(DiffusersParityContract):
    tiny_model = "flux"
    sampling = SAMPLING
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    other_size = {"width": 24}
    non_square = {"height": 24, "width": 16}

    def batch_cases(self):
        """The contract's four requests, one with another embedded guidance scale."""
        cases = super().batch_cases()
        cases[1]["guidance_scale"] = 5.0
        return cases

    @pytest.mark.parametrize("cfg", [False, True], ids=["cfg-off", "cfg-on"])
    def test_schnell_has_no_guidance_input_and_matches_diffusers(self, schnell_dir, omni_schnell, diffusers_schnell,
                                                                cfg):
        self.bind(schnell_dir, omni_schnell, diffusers_schnell)
        assert not omni_schnell.transformer.config.guidance_embeds
        cases = [self.case(i, 20 + i, cfg=cfg) for i in range(2)]
        states = [self.make_state(c) for c in cases]
        seen = []
        hook = omni_schnell.transformer.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(kwargs["guidance"]), with_kwargs=True)
        try:
            outs = omni_schnell.forward(states)
        finally:
            hook.remove()
        assert seen == [None] * STEPS
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)

    def test_t5_is_padded_to_one_length_so_no_call_has_a_text_mask(self):
        """(The contract checks each call's requests and branches.)"""
        states = [self.make_state(c) for c in self.batch_cases()]
        with self.denoiser_calls() as calls:
            self.omni.forward(states)
        assert calls and all(call.text_mask is None for _, call, _ in calls)

    def test_embedded_guidance_is_per_row(self):
        """dev: requests with different guidance scales share one call (one guidance value per row); T5 is
        padded to max_sequence_length, so prompts of any length need no mask."""
        cases = [self.case(1, 5, cfg=False, guidance_scale=1.5), self.case(1, 5, cfg=False, guidance_scale=7.0),
                 self.case(2, 6, cfg=2.5, guidance_scale=3.5)]
        states = [self.make_state(c) for c in cases]
        outs = self.omni.forward(states)
        assert all(s.prompt_embeds.shape[1] == MSL for s in states)
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)
        assert levels_apart(outs[0].tensor, outs[1].tensor) > 1  # guidance really reaches the transformer

    def test_flux_parity_check_has_teeth(self, monkeypatch):
        """The negative branch with the prompt's pooled CLIP projection, or the embedded guidance left out, move
        the result far outside the parity tolerance (another seed or CFG scale: the contract's check)."""
        import omni_model_flux.pipeline as mod

        case = self.case(1, 11)
        ref = self.reference(case)
        state = self.make_state(case)
        self.omni.prepare_encode(state)
        state.extra["negative_pooled"] = state.extra["pooled"]
        monkeypatch.setattr(self.omni, "prepare_encode", lambda s: s)
        (out,) = self.omni.forward([state])
        monkeypatch.undo()
        assert levels_apart(out.tensor, ref[0]) > 5

        call = mod.FluxPipeline.call_denoiser
        monkeypatch.setattr(mod.FluxPipeline, "call_denoiser",
                            lambda self, *a, **kw: call(self, *a, **{**kw, "guidance": kw["guidance"] * 0 + 3.5}))
        case = self.case(1, 11, guidance_scale=7.0)
        (out,) = self.omni.forward([self.make_state(case)])
        monkeypatch.undo()
        assert levels_apart(out.tensor, self.reference(case)[0]) > 1


def state_of(pipeline, prompt, seed, *, negative=None, cfg=1.0, n=1, **fields):
    """A request's ``StepState`` at the tiny sizes (``SAMPLING`` overridden by ``fields``)."""
    return make_state(pipeline, prompt, seed=seed, negative_prompt=negative, true_cfg_scale=cfg,
                      num_outputs_per_prompt=n, **{**SAMPLING, **fields})


def test_dev_and_schnell_are_one_pipeline_with_every_parallel_mode(flux_dir, schnell_dir):
    spec = resolve_model(schnell_dir).spec
    assert spec.name == resolve_model(flux_dir).spec.name == "FluxPipeline"
    assert spec.supported_parallel == ("tensor", "ulysses", "ring", "cfg")


def test_bad_sizes_and_lengths_are_refused_naming_the_field(flux_dir, schnell_dir):
    from omni_model_flux.pipeline import FluxPipeline

    with pytest.raises(ConfigError, match=r"height=17 .*a multiple of 2 .*e\.g\. 16 or 18") as err:
        FluxPipeline.check_sampling_params(SamplingParams(height=17, width=16), flux_dir)  # tiny VAE: 1 x 2
    assert err.value.field == "height"
    with pytest.raises(ConfigError, match=r"width=1000 .*a multiple of 16 .*e\.g\. 992 or 1008") as err:
        FluxPipeline.check_sampling_params(SamplingParams(height=1024, width=1000))  # FLUX.1: 8 x 2
    assert err.value.field == "width"
    with pytest.raises(ConfigError, match="max_sequence_length=513 .*at most 512") as err:
        FluxPipeline.check_sampling_params(SamplingParams(max_sequence_length=513), flux_dir)
    assert err.value.field == "max_sequence_length"
    with pytest.raises(ConfigError, match="num_frames=5") as err:
        FluxPipeline.check_sampling_params(SamplingParams(num_frames=5), flux_dir)
    dev = FluxPipeline.check_sampling_params(SamplingParams(), flux_dir)
    assert (dev.height, dev.width, dev.num_inference_steps, dev.guidance_scale, dev.max_sequence_length,
            dev.true_cfg_scale) == (128, 128, 28, 3.5, 512, 1.0)
    schnell = FluxPipeline.check_sampling_params(SamplingParams(), schnell_dir)
    assert (schnell.num_inference_steps, schnell.guidance_scale, schnell.max_sequence_length) == (4, None, 256)
    default = FluxPipeline.check_sampling_params(SamplingParams())
    assert (default.height, default.width) == (1024, 1024)


def test_denoiser_spec_declares_both_block_lists_the_joint_text_and_teacache_defaults(omni_flux):
    """FLUX's own declarations (the pipeline contract checks signatures, batch args, heads, the SP plan's paths
    and the signal's rows): double- then single-stream blocks, the text joined to the image sequence, and the
    published TeaCache polynomial."""
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(omni_flux)
    t = omni_flux.transformer
    assert spec.name == "transformer" and spec.module is t and spec.num_heads == 2
    assert spec.blocks == [*t.transformer_blocks, *t.single_transformer_blocks]
    assert spec.sp_plan.joint_text_input == "encoder_hidden_states"
    assert spec.sp_plan.shard_inputs == {"hidden_states": 1, "img_ids": 0}
    defaults = spec.defaults_for("tea_cache")
    assert defaults["rel_l1_thresh"] == 0.4 and defaults["coefficients"][0] == pytest.approx(498.651651)

def test_blocks_run_in_sequence_reproduce_the_forward(flux_dir, omni_flux):
    """What caches assume of a tuple ``blocks_attr``: the module's output is the blocks of both lists applied in
    order to the carried streams, with nothing in between (so a reused residual stands for all of them)."""
    from omni_core.pipelines.denoiser import denoisers_of

    (spec,) = denoisers_of(omni_flux)
    t = omni_flux.transformer
    first, last = {}, {}
    hooks = [spec.blocks[0].register_forward_pre_hook(lambda m, a, kw: first.update(kw), with_kwargs=True),
             spec.blocks[-1].register_forward_hook(lambda m, a, out: last.update(out=out))]
    state = state_of(omni_flux, PROMPTS[0], 1)
    omni_flux.prepare_encode(state)
    try:
        with torch.no_grad():
            (pred,) = omni_flux.denoise_step([state])
    finally:
        for h in hooks:
            h.remove()
    streams = {k: first[k] for k in spec.carried}
    with torch.no_grad():
        for block in spec.blocks:
            out = block(**{**first, **streams})
            streams = dict(zip(spec.block_outputs, out))
        torch.testing.assert_close(streams["hidden_states"], last["out"][1], atol=0, rtol=0)
        head = t.proj_out(t.norm_out(streams["hidden_states"], first["temb"]))
    torch.testing.assert_close(head, pred, atol=1e-6, rtol=0)


def test_ulysses_degree_must_divide_the_heads_before_workers(flux_dir):
    from omni_model_flux.pipeline import FluxPipeline

    FluxPipeline.check_parallel_config({"ulysses_degree": 2}, flux_dir)
    with pytest.raises(ConfigError, match="ulysses_degree=4"):
        FluxPipeline.check_parallel_config({"ulysses_degree": 4}, flux_dir)  # 2 heads in the tiny folder


def test_different_t5_lengths_never_share_a_call(omni_flux):
    """``max_sequence_length`` sets the text length of a call (no mask), so requests that differ in it run as
    one call each, every step (the rest of a wave's batch shape: ``TestFluxParity``)."""
    states = [state_of(omni_flux, PROMPTS[1], 1, negative=NEG, cfg=4.0, max_sequence_length=32),
              state_of(omni_flux, PROMPTS[1], 1, negative=NEG, cfg=4.0, max_sequence_length=64)]
    calls = []
    hook = omni_flux.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        omni_flux.forward(states)
    finally:
        hook.remove()
    assert calls == [2, 2] * STEPS


def test_a_scheduler_that_draws_noise_draws_it_from_the_requests_generator(flux_dir, tmp_path):
    """A folder whose scheduler samples stochastically (FlowMatchEuler's ``stochastic_sampling``) draws each step's
    noise from the request's own generator (as diffusers' pipelines that pass ``generator`` to ``step`` do; its FLUX
    call passes none, so diffusers itself is not reproducible there): the same seed gives the same image, alone or
    beside another request, and another seed another image."""
    import json
    import shutil

    from omni_core import Omni
    from omni_core.config import SamplingParams

    folder = tmp_path / "flux-stochastic"
    shutil.copytree(flux_dir, folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "stochastic_sampling": True}))
    fields = dict(height=32, width=32, num_inference_steps=4, guidance_scale=3.5, output_type="pt")
    with Omni(str(folder), warmup=False, cpu_threads=1, max_num_seqs=2) as omni:
        first, again = (omni.generate("a cat", seed=3, use_tqdm=False, **fields)[0].tensor for _ in range(2))
        paired = omni.generate(["a cat", "a dog"], sampling_params=[SamplingParams(seed=s, **fields) for s in (3, 4)],
                               use_tqdm=False)
    assert levels_apart(first, again) == 0
    assert levels_apart(paired[0].tensor, first) <= 1  # a batch's own kernel sums in another order
    assert levels_apart(paired[1].tensor, first) > 1
