"""Ulysses-2, Ring-2, TP-2 and CFG-2 over two gloo processes on the tiny LTX-2 equal one process, video and audio,
loaded through the real load plan, in step mode with a request joining the running wave. CFG: the guidance
branches of a wave (cond, uncond, STG, modality for diffusers' defaults; cond and uncond for a CFG-only request;
cond alone for an unguided one, on both ranks) spread over the cfg ranks by ``LTX2Pipeline._branches_over_ranks``.
Ulysses / Ring: the video tokens sharded, the audio whole on each rank (its attention to the video through
``replicated_queries``); image-to-video too, whose video modulation is per token. TP: heads and hidden units,
split RoPE's per-head tables sliced to the rank's heads."""

from __future__ import annotations

import pytest
from PIL import Image

from omni_core.testing import make_state, run_step_batch

pytestmark = pytest.mark.dist

COMMON = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 3, "max_sequence_length": 64,
          "stg_block": 1}
REQUESTS = [
    {"prompt": "a red fox jumps over a lazy dog", "negative_prompt": "blurry", "seed": 5, **COMMON},  # defaults: 4
    {"prompt": "a cat", "seed": 6, "guidance_scale": 4.0, "audio_guidance_scale": 5.0, "stg_scale": 0.0,
     "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0, **COMMON},  # CFG only: 2
    {"prompt": "a sign that reads OPEN", "seed": 7, "guidance_scale": 1.0, "audio_guidance_scale": 1.0,
     "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0, **COMMON},
]
ADMIT_AT = [0, 0, 1]
CONFIGS = {"cfg2": {"cfg_parallel_size": 2}, "ulysses2": {"ulysses_degree": 2}, "ring2": {"ring_degree": 2},
           "tp2": {"tensor_parallel_size": 2}}


I2V_REQUESTS = [
    {"prompt": "a red fox jumps over a lazy dog", "negative_prompt": "blurry", "seed": 5, **COMMON,
     "images": [Image.new("RGB", (40, 24), (200, 40, 40))]},
    {"prompt": "a cat", "seed": 6, "guidance_scale": 4.0, "stg_scale": 0.0, "audio_stg_scale": 0.0, **COMMON,
     "images": [Image.radial_gradient("L").convert("RGB").resize((48, 40))]},
]
I2V_ADMIT_AT = [0, 1]
I2V_CONFIGS = {"i2v ulysses2": {"ulysses_degree": 2}, "i2v ring2": {"ring_degree": 2}}


def _one_process(pipeline, folder, requests, admit_at):
    import torch

    states = []
    for spec in requests:
        spec = dict(spec)
        prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
        states.append(make_state(pipeline, prompt, negative_prompt=negative, model_path=folder, **spec))
    with torch.inference_mode():
        outs = run_step_batch(pipeline, states, admit_at=admit_at)
    return [o.tensor for o in outs], [o.audio for o in outs]


@pytest.fixture(scope="module")
def parallel(ltx2_dir, i2v_dir):
    from omni_model_ltx2.testing import parallel_outputs

    return {**parallel_outputs(ltx2_dir, CONFIGS, REQUESTS, ADMIT_AT),
            **parallel_outputs(i2v_dir, I2V_CONFIGS, I2V_REQUESTS, I2V_ADMIT_AT)}


@pytest.fixture(scope="module")
def one_process(ltx2_dir, omni_ltx2, i2v_dir, omni_i2v):
    return {"t2v": _one_process(omni_ltx2, ltx2_dir, REQUESTS, ADMIT_AT),
            "i2v": _one_process(omni_i2v, i2v_dir, I2V_REQUESTS, I2V_ADMIT_AT)}


@pytest.mark.parametrize("name", [*CONFIGS, *I2V_CONFIGS])
def test_parallel_equals_one_process(parallel, one_process, name):
    videos, audios, sent = parallel[name]
    ref_videos, ref_audios = one_process["i2v" if name in I2V_CONFIGS else "t2v"]
    assert len(videos) == len(ref_videos)
    for ref, out in zip(ref_videos, videos):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-5
    for ref, out in zip(ref_audios, audios):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-6
    assert sent > 0  # the ranks really split the work
