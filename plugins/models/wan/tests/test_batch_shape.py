"""The batch shape of a Wan wave: ONE call per expert present per step holding the cond rows of every request
and the uncond rows of the guided ones (different max_sequence_length padded and masked), and results equal
to running each request alone through the same pipeline."""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.pipelines import StepState
from omni_core.request import OmniDiffusionRequest

#: with shift=7 the 4 timesteps are [1000, 934, 781, 47]: Wan 2.2's boundary 875 gives two steps per expert
STEPS = 4
FRAMES = 9
NEG = "blurry, static, low quality"
PROMPTS = ["a red fox jumps over a dog", "a cat", "an astronaut rides a horse"]


def make_state(model_dir, prompt, seed, *, g=5.0, g2=None, negative=NEG, n=1, msl=32):
    from omni_model_wan.pipeline import WanPipeline

    params = WanPipeline.check_sampling_params(
        SamplingParams(height=16, width=16, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=g,
                       guidance_scale_2=g2, seed=seed, num_outputs_per_prompt=n, max_sequence_length=msl), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def count_calls(experts):
    """Forward pre-hooks recording (expert, batch size) of every call; returns (calls, handles)."""
    calls: list[tuple[str, int]] = []
    handles = [module.register_forward_pre_hook(
        lambda mod, args, kwargs, n=name: calls.append((n, kwargs["hidden_states"].shape[0])), with_kwargs=True)
        for name, module in experts.items()]
    return calls, handles


CASES = [dict(prompt=PROMPTS[0], seed=1, g2=2.0), dict(prompt=PROMPTS[1], seed=2, g=3.0, n=2, msl=16),
         dict(prompt=PROMPTS[2], seed=3, negative=None), dict(prompt=PROMPTS[1], seed=4, g=1.0, msl=24)]


@pytest.mark.parametrize("n_guided", [1, 3])
def test_a_wave_of_guided_requests_is_one_call_per_expert_per_step(wan22_dir, wan22, n_guided):
    _, omni = wan22
    states = [make_state(wan22_dir, **c) for c in CASES[:n_guided]]
    calls, handles = count_calls(omni.experts)
    try:
        omni.forward(states)
    finally:
        for h in handles:
            h.remove()
    rows = 2 * sum(s.latents.shape[0] for s in states)  # all guided: cond + uncond rows
    assert calls == [("transformer", rows)] * 2 + [("transformer_2", rows)] * 2


def test_batched_equals_one_by_one(wan22_dir, wan22):
    """Four requests (different max_sequence_length, guidance scales, outputs per prompt, one without CFG) as
    one wave and each alone: same latents and videos."""
    _, omni = wan22
    batched = [make_state(wan22_dir, **c) for c in CASES]
    outs = omni.forward(batched)
    for c, state, out in zip(CASES, batched, outs):
        alone = make_state(wan22_dir, **c)
        (ref,) = omni.forward([alone])
        torch.testing.assert_close(state.latents, alone.latents, atol=2e-5, rtol=0)
        torch.testing.assert_close(out.tensor, ref.tensor, atol=1e-4, rtol=0)


def test_step_waves_call_each_expert_present_once(wan22_dir, wan22):
    """Requests joining at different steps: a wave holding both experts' steps calls each expert once."""
    from omni_core.testing.driver import run_step_batch

    _, omni = wan22
    states = [make_state(wan22_dir, **c) for c in CASES]
    calls, handles = count_calls(omni.experts)
    expected = []
    denoise = omni.denoise_step

    def spy(batch):
        expected.append(sorted({omni.expert_for(s)[0] for s in batch}))
        before = len(calls)
        out = denoise(batch)
        assert sorted(n for n, _ in calls[before:]) == expected[-1]
        return out

    omni.denoise_step = spy
    try:
        run_step_batch(omni, states, admit_at=[0, 1, 2, 2])
    finally:
        del omni.denoise_step
        for h in handles:
            h.remove()
    assert ["transformer", "transformer_2"] in expected
    assert len(calls) == sum(len(e) for e in expected)


def test_vae_first_frame_convs_match_diffusers_conv3d(wan22):
    """Only the first latent frame (no cached frames) takes the conv2d path; the video equals diffusers' own
    decode up to float summation order."""
    ref_pipe, omni = wan22
    z = torch.randn(2, omni.pipe.vae.config.z_dim, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = omni.pipe.vae.decode(z, return_dict=False)[0]
        ref = ref_pipe.vae.decode(z, return_dict=False)[0]
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("msl", [512, 32, 8])
def test_t5_embeds_equal_diffusers_padded_encoding(wan22, msl):
    """The text encoder runs on the longest prompt of the batch instead of max_sequence_length tokens; the
    embeddings equal diffusers' (padded to msl, zero beyond each prompt), truncation included."""
    ref_pipe, omni = wan22
    texts = PROMPTS + [NEG, ""]
    with torch.no_grad():
        ours = omni.t5_embeds(texts, msl)
        ref = torch.cat([ref_pipe._get_t5_prompt_embeds(prompt=[t], max_sequence_length=msl) for t in texts])
    assert ours.shape == ref.shape == (len(texts), msl, ref.shape[-1])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    n = int(omni.pipe.tokenizer(["a cat"], max_length=msl, truncation=True).attention_mask[0].__len__())
    row = ours[PROMPTS.index("a cat")]
    assert bool(row[:n].any(dim=-1).all()) and not bool(row[n:].any())  # zero after the prompt's tokens
