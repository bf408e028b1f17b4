"""CFG-2 over two gloo processes on the tiny LTX-2 equals one process, video and audio: the guidance branches of a
wave (cond, uncond, STG, modality for diffusers' defaults; cond and uncond for a CFG-only request; cond alone for
an unguided one, on both ranks) spread over the cfg ranks by ``LTX2Pipeline._branches_over_ranks``, loaded
through the real load plan, in step mode with a request joining the running wave."""

from __future__ import annotations

import pytest

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
CONFIGS = {"cfg2": {"cfg_parallel_size": 2}}


@pytest.fixture(scope="module")
def parallel(ltx2_dir):
    from omni_model_ltx2.testing import parallel_outputs

    return parallel_outputs(ltx2_dir, CONFIGS, REQUESTS, ADMIT_AT)


@pytest.fixture(scope="module")
def one_process(ltx2_dir, omni_ltx2):
    import torch

    states = []
    for spec in REQUESTS:
        spec = dict(spec)
        prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
        states.append(make_state(omni_ltx2, prompt, negative_prompt=negative, model_path=ltx2_dir, **spec))
    with torch.inference_mode():
        outs = run_step_batch(omni_ltx2, states, admit_at=ADMIT_AT)
    return [o.tensor for o in outs], [o.audio for o in outs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parallel_equals_one_process(parallel, one_process, name):
    videos, audios, sent = parallel[name]
    for ref, out in zip(one_process[0], videos):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-5
    for ref, out in zip(one_process[1], audios):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-6
    assert sent > 0  # the ranks really split the work
