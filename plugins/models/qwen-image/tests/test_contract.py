"""QwenImagePipeline passes the core's pipeline contract on the tiny folder (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestQwenImagePipelineContract(PipelineContract):
    model_fixture = "qwen_dir"
    sampling = {"num_inference_steps": 2, "height": 32, "width": 32}
    stages_check = False  # the stages apart: tests/runtime/test_stages.py (both modes, more requests)
    #: batching pads prompts to one length and changes float summation order only (the parity tests hold
    #: batched latents to 5e-5 of diffusers' single-prompt run)
    batch_atol = 1e-4
    abort_steps = 20
