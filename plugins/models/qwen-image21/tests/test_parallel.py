"""Ulysses-2, Ring-2, CFG-2 and TP-2 over two gloo processes on tiny Qwen-Image 2.1 equal one process, by the
DenoiserSpec's ``sp_plan`` / ``tp_plan`` and the base class's CFG exchange alone: the target tokens and their
per-row rotary tables sharded, each row's prefix keys/values the joint text every rank keeps whole (a CFG pair
whose prefixes differ in length, so the prefix mask is per row; a request joining the running wave with its own
prefix), the output gathered; under TP each rank computes its heads' prefix with its own split projections. The
tiny transformer has 4 heads (2 divides them). All four configs run in ONE two-process group
(``testing.parallel_outputs``: the pipeline loaded through the real load plan per config), against the same
requests run by the session's one-process pipeline."""

from __future__ import annotations

import pytest

from omni_core.testing import make_state, run_step_batch

pytestmark = pytest.mark.dist

#: 32x64 pixels are 2 x 4 = 8 target tokens; 64x64 are 16
REQUESTS = [
    {"prompt": "a red fox jumps over a lazy dog in the snow", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
     "height": 32, "width": 64, "seed": 5, "num_inference_steps": 3},
    {"prompt": "a cat", "negative_prompt": "low quality, watermark, jpeg artifacts", "true_cfg_scale": 3.0,
     "height": 32, "width": 64, "seed": 6, "num_inference_steps": 3},
    {"prompt": "an astronaut rides a horse on the moon", "height": 64, "width": 64, "seed": 7,
     "num_inference_steps": 3},
]
ADMIT_AT = [0, 0, 1]
CONFIGS = {"ulysses2": {"ulysses_degree": 2}, "ring2": {"ring_degree": 2}, "cfg2": {"cfg_parallel_size": 2},
           "tp2": {"tensor_parallel_size": 2}}


@pytest.fixture(scope="module")
def parallel(q21_dir):
    from omni_model_qwen_image21.testing import parallel_outputs

    return parallel_outputs(q21_dir, CONFIGS, REQUESTS, ADMIT_AT)


@pytest.fixture(scope="module")
def one_process(q21_dir, omni_q21):
    states = []
    for spec in REQUESTS:
        spec = dict(spec)
        prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
        states.append(make_state(omni_q21, prompt, negative_prompt=negative, model_path=q21_dir, **spec))
    return [o.tensor for o in run_step_batch(omni_q21, states, admit_at=ADMIT_AT)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parallel_equals_one_process(parallel, one_process, name):
    outs, sent = parallel[name]
    for ref, out in zip(one_process, outs):
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-5
    assert sent > 0  # the ranks really split the work
