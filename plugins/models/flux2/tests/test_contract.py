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
    #: ``test_engine_options.py`` checks the decode stage apart against the in-line engine the LoRA, offload and
    #: int8 checks share (one spawned process instead of two engines and two stage processes: ~10 s here)
    test_stages_apart_equal_in_line = None


class TestDevContract(TestKleinContract):
    model_fixture = "dev_dir"
    #: (stages apart: one code path for both models, the same decode and diffusers' ``encode_prompt``; [klein]'s)
