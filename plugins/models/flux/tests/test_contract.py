"""FluxPipeline passes the core's pipeline contract on the tiny dev folder (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestFluxPipelineContract(PipelineContract):
    model_fixture = "flux_dir"
    sampling = {"num_inference_steps": 2, "height": 16, "width": 16, "max_sequence_length": 32}
    #: batching changes float summation order only (the parity tests hold batched latents to 5e-5 of
    #: diffusers' single-prompt run)
    batch_atol = 1e-4
    abort_steps = 20
    engine_kwargs = {"warmup": False, "cpu_threads": 1}  # as the one_torch_thread fixture
