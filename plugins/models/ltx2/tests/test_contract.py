"""LTX2Pipeline passes the core's pipeline contract on the tiny folder (request = step mode, alone = batched =
staggered, abort within a step, bad params refused first, one preview per step, size multiples, stages apart
equal in line, attention through Omni layers by role, declared fields)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestLTX2PipelineContract(PipelineContract):
    model_fixture = "ltx2_dir"
    sampling = {"num_inference_steps": 2, "height": 32, "width": 32, "num_frames": 9,
                "max_sequence_length": 64}
    #: batching changes float summation order only (the parity tests hold batched latents to 5e-5 of diffusers)
    batch_atol = 1e-4
    abort_steps = 20
