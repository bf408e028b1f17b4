"""PixArtSigmaPipeline passes the core's pipeline contract on the tiny folder (request = step mode, alone =
batched = staggered, abort within a step, bad params refused first, one preview per step, size multiples,
attention through Omni layers chosen by role, the stages apart equal in line)."""

from omni_core.testing import PipelineContract


class TestPixArtContract(PipelineContract):
    model_fixture = "pixart_dir"
    sampling = {"num_inference_steps": 2, "height": 16, "width": 16, "max_sequence_length": 64}
    #: diffusers' Linear layers take another CPU kernel for a batch than for one row: alone vs batched measured
    #: 2.4e-7 here (a request alone equals diffusers bit for bit: test_parity.py)
    batch_atol = 1e-5
    abort_steps = 20
    engine_kwargs = {"warmup": False, "cpu_threads": 1}  # one thread, as the one_torch_thread fixture
