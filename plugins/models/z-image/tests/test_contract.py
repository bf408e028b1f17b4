"""ZImagePipeline passes the core's pipeline contract on the tiny folder (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestZImagePipelineContract(PipelineContract):
    model_fixture = "zimage_dir"
    sampling = {"num_inference_steps": 2, "height": 32, "width": 32, "guidance_scale": 3.0,
                "max_sequence_length": 128}
    #: batching pads the unified sequences to one length and changes float summation order only (the parity
    #: tests hold batched latents to 5e-5 of diffusers' single-prompt run)
    batch_atol = 1e-4
    abort_steps = 20
    #: one torch thread: the tiny model's ops gain nothing from two (see conftest)
    engine_kwargs = {"warmup": False, "cpu_threads": 1}
