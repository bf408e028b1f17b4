"""The batch shape of a Z-Image wave: ONE transformer call per step holding the cond rows of every request and
the uncond rows of the guided ones (texts of different lengths: the transformer pads and masks inside), and
results equal to running each request alone through the same pipeline."""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.pipelines import StepState
from omni_core.request import OmniDiffusionRequest

STEPS = 3
NEG = "blurry, low quality, watermark, jpeg artifacts"
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic lighting", "a cat",
           "an astronaut riding a green horse on the moon"]


def make_state(model_dir, prompt, seed, *, cfg=4.0, negative=NEG, n=1, **extra):
    from omni_model_z_image.pipeline import ZImagePipeline

    params = ZImagePipeline.check_sampling_params(
        SamplingParams(height=32, width=32, num_inference_steps=STEPS, guidance_scale=cfg, seed=seed,
                       num_outputs_per_prompt=n, max_sequence_length=128, **extra), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def count_calls(pipeline):
    """Record the row count of every denoiser call (and of the diffusers transformer inside); returns
    (calls, inner_calls, remove)."""
    calls: list[int] = []
    inner: list[int] = []
    handles = [pipeline.experts["transformer"].register_forward_pre_hook(
                   lambda mod, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True),
               pipeline.transformer.register_forward_pre_hook(lambda mod, args: inner.append(len(args[0])))]
    return calls, inner, lambda: [h.remove() for h in handles]


CASES = [dict(prompt=PROMPTS[0], seed=1), dict(prompt=PROMPTS[1], seed=2, cfg=3.0, n=2),
         dict(prompt=PROMPTS[2], seed=3, negative="ugly", cfg_truncation=0.2),
         dict(prompt=PROMPTS[1], seed=4, cfg=0.0, negative=None)]


@pytest.mark.parametrize("n_guided", [2, 3])
def test_a_wave_of_guided_requests_is_one_transformer_call_per_step(zimage_dir, omni_zimage, n_guided):
    states = [make_state(zimage_dir, **c) for c in CASES[:n_guided]] + [make_state(zimage_dir, **CASES[3])]
    calls, inner, remove = count_calls(omni_zimage)
    try:
        omni_zimage.forward(states)
    finally:
        remove()
    rows = sum(s.latents.shape[0] for s in states)
    # diffusers' truncation: no uncond rows on a step whose (1000 - t) / 1000 exceeds cfg_truncation
    guided = [sum(s.latents.shape[0] for s in states if s.extra["guided"]
                  and (1000 - s.timesteps[step].item()) / 1000 <= s.extra["cfg_truncation"]) for step in range(STEPS)]
    assert n_guided < 3 or len(set(guided)) == 2  # the truncated request really dropped its uncond rows
    assert calls == inner == [rows + g for g in guided]  # all branches of all requests folded into each call


def test_batched_equals_one_by_one(zimage_dir, omni_zimage):
    """Four requests of different prompt lengths, CFG scales, outputs per prompt, truncation and one without
    CFG, as one wave (one call per step, batched text encoding and VAE decode) and each alone."""
    batched = [make_state(zimage_dir, **c) for c in CASES]
    outs = omni_zimage.forward(batched)
    for c, state, out in zip(CASES, batched, outs):
        alone = make_state(zimage_dir, **c)
        (ref,) = omni_zimage.forward([alone])
        torch.testing.assert_close(state.latents, alone.latents, atol=2e-4, rtol=0)
        torch.testing.assert_close(out.tensor, ref.tensor, atol=1e-3, rtol=0)


def test_step_waves_are_one_call_each(zimage_dir, omni_zimage):
    """Step mode: requests joining at different steps share one call per wave; a request alone runs its two
    branches as one call too (texts of different lengths included), as diffusers does."""
    from omni_core.testing.driver import run_step_batch

    states = [make_state(zimage_dir, **c) for c in CASES[:2]] + [make_state(zimage_dir, PROMPTS[2], 3)]
    calls, inner, remove = count_calls(omni_zimage)
    per_wave = []
    denoise = omni_zimage.denoise_step

    def spy(batch):
        before = len(calls)
        out = denoise(batch)
        per_wave.append((len(batch), len(calls) - before, sum(calls[before:])))
        return out

    omni_zimage.denoise_step = spy
    try:
        run_step_batch(omni_zimage, states, admit_at=[0, 1, 2])
    finally:
        del omni_zimage.denoise_step
        remove()
    # rows: request 0 has 1 image, request 1 two, request 2 one; all guided (x2)
    assert per_wave == [(1, 1, 2), (2, 1, 6), (3, 1, 8), (2, 1, 6), (1, 1, 2)]
