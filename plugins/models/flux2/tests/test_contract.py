"""Both FLUX.2 pipelines pass the core's pipeline contract on the tiny folders (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples, the
declared DenoiserSpec: block signature, batch args, heads, SP plan paths, TeaCache's signal rows)."""

from __future__ import annotations

from omni_core.testing.pipeline_contract import PipelineContract

SAMPLING = {"num_inference_steps": 2, "height": 16, "width": 16, "max_sequence_length": 64}


class TestKleinContract(PipelineContract):
    model_fixture = "klein_dir"
    sampling = SAMPLING
    #: batching changes float summation order only (the parity tests hold batched latents to 5e-5 of diffusers')
    batch_atol = 1e-4
    abort_steps = 20
    engine_kwargs = {"warmup": False, "cpu_threads": 1}


class TestDevContract(TestKleinContract):
    model_fixture = "dev_dir"
    #: the stage split is one code path for both models (the same decode, diffusers' ``encode_prompt`` either way)
    #: and spawns two processes (~10 s here): [klein] checks it
    test_stages_apart_equal_in_line = None
