"""The batch shape of a Qwen-Image wave: ONE transformer call per step holding the cond rows of every request
and the uncond rows of the guided ones (prompts of different lengths padded and masked), and results equal to
running each request alone through the same pipeline."""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.pipelines import StepState
from omni_core.request import OmniDiffusionRequest

STEPS = 3
NEG = "blurry, low quality, watermark, jpeg artifacts"
#: three prompt lengths, and the negative prompt a fourth (one byte token per character)
PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic lighting", "a cat",
           "an astronaut riding a green horse on the moon"]


def make_state(model_dir, prompt, seed, *, cfg=4.0, negative=NEG, n=1):
    from omni_model_qwen_image.pipeline import QwenImagePipeline

    params = QwenImagePipeline.check_sampling_params(
        SamplingParams(height=32, width=32, num_inference_steps=STEPS, true_cfg_scale=cfg, seed=seed,
                       num_outputs_per_prompt=n), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def count_calls(module):
    """A forward pre-hook that records the batch size of every call of ``module``; returns (calls, handle)."""
    calls: list[int] = []
    handle = module.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["hidden_states"].shape[0]),
                                              with_kwargs=True)
    return calls, handle


CASES = [dict(prompt=PROMPTS[0], seed=1), dict(prompt=PROMPTS[1], seed=2, cfg=3.0, n=2),
         dict(prompt=PROMPTS[2], seed=3, negative="ugly"), dict(prompt=PROMPTS[1], seed=4, cfg=1.0, negative=None)]


@pytest.mark.parametrize("n_guided", [2, 3])
def test_a_wave_of_guided_requests_is_one_transformer_call_per_step(qwen_dir, omni_qwen, n_guided):
    states = [make_state(qwen_dir, **c) for c in CASES[:n_guided]] + [make_state(qwen_dir, **CASES[3])]
    calls, handle = count_calls(omni_qwen.transformer)
    try:
        omni_qwen.forward(states)
    finally:
        handle.remove()
    rows = sum(s.latents.shape[0] for s in states)
    guided_rows = sum(s.latents.shape[0] for s in states if s.extra["do_cfg"])
    assert calls == [rows + guided_rows] * STEPS  # all branches of all requests folded into each step's call


def test_batched_equals_one_by_one(qwen_dir, omni_qwen):
    """Four requests of different prompt lengths, CFG scales, outputs per prompt and one without CFG, as one
    wave (one masked call per step, batched text encoding and VAE decode) and each alone."""
    batched = [make_state(qwen_dir, **c) for c in CASES]
    outs = omni_qwen.forward(batched)
    for c, state, out in zip(CASES, batched, outs):
        alone = make_state(qwen_dir, **c)
        (ref,) = omni_qwen.forward([alone])
        torch.testing.assert_close(state.latents, alone.latents, atol=2e-5, rtol=0)
        torch.testing.assert_close(out.tensor, ref.tensor, atol=1e-4, rtol=0)


def test_step_waves_are_one_call_each(qwen_dir, omni_qwen):
    """Step mode: requests joining at different steps still share one call per wave. A request alone whose
    prompt and negative prompt differ in length runs its branches as two unmasked calls, as diffusers does
    (folding them would need a padding mask, and one request alone computes what diffusers computes)."""
    from omni_core.testing.driver import run_step_batch

    states = [make_state(qwen_dir, **c) for c in CASES[:3]]
    calls, handle = count_calls(omni_qwen.transformer)
    per_wave = []
    denoise = omni_qwen.denoise_step

    def spy(batch):
        before = len(calls)
        out = denoise(batch)
        per_wave.append((len(batch), len(calls) - before))
        return out

    omni_qwen.denoise_step = spy
    try:
        run_step_batch(omni_qwen, states, admit_at=[0, 1, 2])
    finally:
        del omni_qwen.denoise_step
        handle.remove()
    assert per_wave == [(1, 2), (2, 1), (3, 1), (2, 1), (1, 2)]


def test_a_request_alone_folds_its_branches_only_when_no_mask_is_needed(qwen_dir, omni_qwen):
    """Alone, the branches share one call when the prompts have the same token length (no padding), and run
    as two unmasked calls (diffusers' shape) when they differ."""
    calls, handle = count_calls(omni_qwen.transformer)
    try:
        omni_qwen.forward([make_state(qwen_dir, "a cat", 1, negative="a dog")])  # 5 byte tokens each
        same = list(calls)
        calls.clear()
        omni_qwen.forward([make_state(qwen_dir, PROMPTS[0], 1)])
    finally:
        handle.remove()
    assert same == [2] * STEPS
    assert calls == [1, 1] * STEPS


def test_vae_single_frame_convs_match_diffusers_conv3d(omni_qwen, diffusers_qwen, monkeypatch):
    """The decoder's causal Conv3d on one frame with no cache runs as conv2d (the last temporal kernel slice)
    and gives diffusers' own decode up to float summation order."""
    from omni_core.pipelines.diffusers_step import _SingleFrameCausalConv

    convs = [m for m in omni_qwen.pipe.vae.modules() if isinstance(m.__dict__.get("forward"), _SingleFrameCausalConv)]
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
