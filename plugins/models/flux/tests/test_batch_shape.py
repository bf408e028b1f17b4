"""The batch shape of a FLUX wave: ONE transformer call per step holding the cond rows of every request and the
uncond rows of the guided ones (T5 prompts all padded to ``max_sequence_length``, so nothing is masked), and
results equal to running each request alone through the same pipeline."""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.pipelines import StepState
from omni_core.request import OmniDiffusionRequest

STEPS = 3
NEG = "blurry, low quality, watermark, jpeg artifacts"
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn", "a cat",
           "an astronaut riding a green horse on the moon"]


def make_state(model_dir, prompt, seed, *, cfg=4.0, negative=NEG, n=1, guidance=3.5, msl=64):
    from omni_model_flux.pipeline import FluxPipeline

    params = FluxPipeline.check_sampling_params(
        SamplingParams(height=16, width=16, num_inference_steps=STEPS, true_cfg_scale=cfg, seed=seed,
                       guidance_scale=guidance, num_outputs_per_prompt=n, max_sequence_length=msl), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def count_calls(module):
    """A forward pre-hook that records the batch size of every call of ``module``; returns (calls, handle)."""
    calls: list[int] = []
    handle = module.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]),
                                              with_kwargs=True)
    return calls, handle


CASES = [dict(prompt=PROMPTS[0], seed=1), dict(prompt=PROMPTS[1], seed=2, cfg=3.0, n=2, guidance=5.0),
         dict(prompt=PROMPTS[2], seed=3, negative="ugly"), dict(prompt=PROMPTS[1], seed=4, cfg=1.0, negative=None)]


@pytest.mark.parametrize("n_guided", [2, 3])
def test_a_wave_of_guided_requests_is_one_transformer_call_per_step(flux_dir, omni_flux, n_guided):
    states = [make_state(flux_dir, **c) for c in CASES[:n_guided]] + [make_state(flux_dir, **CASES[3])]
    calls, handle = count_calls(omni_flux.transformer)
    try:
        omni_flux.forward(states)
    finally:
        handle.remove()
    rows = sum(s.latents.shape[0] for s in states)
    guided_rows = sum(s.latents.shape[0] for s in states if s.extra["do_cfg"])
    assert calls == [rows + guided_rows] * STEPS  # all branches of all requests folded into each step's call


def test_batched_equals_one_by_one(flux_dir, omni_flux):
    """Four requests of different prompts, CFG scales, guidance, outputs per prompt and one without CFG, as one
    wave (one call per step, batched text encoding and VAE decode) and each alone."""
    batched = [make_state(flux_dir, **c) for c in CASES]
    outs = omni_flux.forward(batched)
    for c, state, out in zip(CASES, batched, outs):
        alone = make_state(flux_dir, **c)
        (ref,) = omni_flux.forward([alone])
        torch.testing.assert_close(state.latents, alone.latents, atol=2e-5, rtol=0)
        torch.testing.assert_close(out.tensor, ref.tensor, atol=1e-4, rtol=0)


def test_step_waves_are_one_call_each(flux_dir, omni_flux):
    """Step mode: requests joining at different steps share one call per wave; a request alone folds its two
    branches too (both prompts have the T5 length, so one call computes what diffusers' two compute)."""
    from omni_core.testing.driver import run_step_batch

    states = [make_state(flux_dir, **c) for c in CASES[:3]]
    calls, handle = count_calls(omni_flux.transformer)
    per_wave = []
    denoise = omni_flux.denoise_step

    def spy(batch):
        before = len(calls)
        out = denoise(batch)
        per_wave.append((len(batch), len(calls) - before))
        return out

    omni_flux.denoise_step = spy
    try:
        run_step_batch(omni_flux, states, admit_at=[0, 1, 2])
    finally:
        del omni_flux.denoise_step
        handle.remove()
    assert per_wave == [(1, 1), (2, 1), (3, 1), (2, 1), (1, 1)]


def test_different_t5_lengths_never_share_a_call(flux_dir, omni_flux):
    """``max_sequence_length`` sets the text length of a call (no mask), so requests that differ in it run as
    one call each, every step."""
    states = [make_state(flux_dir, PROMPTS[1], 1, msl=32), make_state(flux_dir, PROMPTS[1], 1, msl=64)]
    calls, handle = count_calls(omni_flux.transformer)
    try:
        omni_flux.forward(states)
    finally:
        handle.remove()
    assert calls == [2, 2] * STEPS
