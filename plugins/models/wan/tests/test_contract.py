"""WanPipeline passes the core's pipeline contract on the tiny Wan 2.1 folder (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestWanPipelineContract(PipelineContract):
    model_fixture = "wan21_dir"
    sampling = {"num_inference_steps": 2, "height": 16, "width": 16, "num_frames": 5}
    stages_check = False  # the stages apart: tests/runtime/test_stages.py (both modes, more requests)
    #: batching changes float summation order only (the parity tests hold batched latents to 5e-5 of diffusers)
    batch_atol = 1e-4
    abort_steps = 20
    fields_model_fixture = "wan22_dir"  # guidance_scale_2 needs the two-expert folder
