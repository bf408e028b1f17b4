"""QwenImage21Pipeline passes the core's pipeline contract on the tiny folder (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples, the
declared DenoiserSpec, Omni attention in every block, the stages apart equal in line)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestQwenImage21PipelineContract(PipelineContract):
    model_fixture = "q21_dir"
    sampling = {"num_inference_steps": 2, "height": 32, "width": 32}
    #: batching pads the prefixes to one length and changes float summation order only (the parity tests hold
    #: batched latents to 5e-5 of diffusers' single-prompt run)
    batch_atol = 1e-4
    abort_steps = 20
