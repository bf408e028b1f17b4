"""HunyuanVideo15Pipeline passes the core's pipeline contract on the tiny text-to-video folder (request = step
mode, alone = batched = staggered, abort within a step, bad params refused first, one preview per step, size
multiples, declared specs and attention roles; stages apart: test_engine_options.py)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract


class TestHunyuanVideo15Contract(PipelineContract):
    model_fixture = "hv_dir"
    sampling = {"num_inference_steps": 2, "height": 16, "width": 16, "num_frames": 5}
    #: batching changes float summation order only (parity holds batched latents to 5e-5 of diffusers)
    batch_atol = 1e-4
    abort_steps = 20
    engine_kwargs = {"warmup": False, "cpu_threads": 1}
    #: checked in ``test_engine_options.py`` against the in-line engine the offload and int8 checks share (one engine
    #: start fewer; the same check: the stage processes' videos bit for bit, no text encoder or VAE in the model
    #: process)
    test_stages_apart_equal_in_line = None
