"""Ulysses-2, Ring-2 and CFG-2 (two gloo processes, ``executor="mp"``) on tiny Z-Image equal one process, by the
DenoiserSpec's ``sp_plan`` alone: every main block's unified [image, text] sequence, rotary table and key-padding
mask sharded on the token dim, the final layer's output gathered (a CFG pair with texts of different lengths, so
the mask is sharded too, one of them renormalized, and a request without CFG at another size). CFG parallel:
the base class's branch exchange, and the renormalization on the rank that ran only the uncond rows."""

from __future__ import annotations

import os

import pytest

from omni_core.config import SamplingParams
from omni_core.request import OmniDiffusionRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.dist

PROMPTS = ["a red fox jumps over a lazy dog in the snow", "a cat", "an astronaut rides a horse on the moon"]


@pytest.fixture(scope="module")
def zi_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_z_image.testing import build_tiny_z_image

    return build_tiny_z_image(tmp_path_factory.mktemp("parallel-z-image"), num_heads=4)  # TP-2 divides its MLP


#: tiny Z-Image: VAE factor 2 and 2x2 patches, so 24x40 has 6 x 10 = 60 image tokens (64 after the transformer's
#: own padding) and each row's unified sequence also holds its text (padded to 32s); texts of different lengths
#: make the per-row key-padding mask
SP_REQUESTS = [
    {"prompt": PROMPTS[0], "negative_prompt": "blurry", "guidance_scale": 3.0, "height": 24, "width": 40,
     "cfg_normalization": 1.0},
    {"prompt": PROMPTS[1], "negative_prompt": "low quality, watermark, jpeg artifacts, noise, grain, ugly",
     "guidance_scale": 3.0, "height": 24, "width": 40},
    {"prompt": PROMPTS[2], "guidance_scale": 0.0, "height": 32, "width": 32},
]


def engine_run(folder: str, parallel_config: dict | None = None, **engine) -> list:
    """Submit every request of ``SP_REQUESTS`` to one engine at once; their final outputs, in order."""
    from omni_core import Omni

    # one torch thread per model process: tiny ops, and the uni engine would otherwise set this process's count
    with Omni(folder, dtype="float32", warmup=False, max_num_seqs=4, parallel_config=parallel_config or {},
              cpu_threads=1, **engine) as omni:
        streams = []
        for spec in SP_REQUESTS:
            spec = dict(spec)
            prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
            params = SamplingParams(output_type="pt", seed=5, num_inference_steps=2, max_sequence_length=64, **spec)
            streams += omni.engine.submit([OmniDiffusionRequest(prompt=prompt, negative_prompt=negative,
                                                                sampling_params=params)])
        outs = []
        for stream in streams:
            while not (out := stream.get(timeout=300)).finished:
                pass
            outs.append(out)
    assert not [o.error for o in outs if o.status == "error"]
    return outs


@pytest.fixture(scope="module")
def one_process(zi_dir):
    return engine_run(zi_dir)


@pytest.mark.parametrize("parallel_config,engine", [({"ulysses_degree": 2}, {}),
                                                    ({"ring_degree": 2}, {"step_execution": True}),
                                                    # tensor parallel (issue #39): main layers and both refiners
                                                    ({"tensor_parallel_size": 2}, {}),
                                                    # a third engine start (~45 s here): -m "not slow" skips it
                                                    pytest.param({"cfg_parallel_size": 2}, {}, marks=pytest.mark.slow)],
                         ids=["ulysses2", "ring2", "tp2", "cfg2"])
def test_sequence_parallel_equals_one_process(zi_dir, one_process, parallel_config, engine):
    outs = engine_run(zi_dir, parallel_config, executor="mp", **engine)
    for i, (ref, out) in enumerate(zip(one_process, outs)):
        diff = (out.images[0] - ref.images[0]).abs().max().item()
        assert diff <= 1e-5, f"{parallel_config}: max abs diff {diff:.2e}"
        print(f"{parallel_config}: max abs diff {diff:.2e}")
        # SP ranks split every wave's tokens; cfg ranks exchange only the guided requests' branches
        assert out.metrics["communication_bytes"] > 0 or ("cfg_parallel_size" in parallel_config and i == 2)
