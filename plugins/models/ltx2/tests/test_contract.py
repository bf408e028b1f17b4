"""LTX2Pipeline passes the core's pipeline contract on the tiny folder (request = step mode, alone = batched =
staggered, abort within a step, bad params refused first, one preview per step, size multiples, stages apart
equal in line, attention through Omni layers by role, declared fields).

The contract's engines are the session's shared ones (``ltx2_engines``: one per distinct keywords, so request
mode, step mode and streaming are three engine starts for the whole folder, the CLI test's engine among them);
only the stages-apart engine (encode and decode processes of their own) is started and closed here."""

from __future__ import annotations

import contextlib

import pytest

from omni_core.testing.pipeline_contract import PipelineContract

#: engine keywords the shared engines take; anything else (the stages' workers) starts an engine of its own
SHARED = {"warmup", "cpu_threads", "step_execution", "streaming_output"}


class TestLTX2PipelineContract(PipelineContract):
    model_fixture = "ltx2_dir"
    sampling = {"num_inference_steps": 2, "height": 32, "width": 32, "num_frames": 9,
                "max_sequence_length": 64}
    #: batching changes float summation order only (the parity tests hold batched latents to 5e-5 of diffusers)
    batch_atol = 1e-4
    abort_steps = 20
    engine_kwargs = {"warmup": False, "cpu_threads": 1}  # as the one_torch_thread fixture and ltx2_engines
    _engines = None

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _shared_engines(cls, ltx2_engines):
        cls._engines = staticmethod(ltx2_engines)
        yield
        cls._engines = None

    @pytest.fixture(scope="class")
    @classmethod
    def contract_pipeline(cls, omni_ltx2):
        """The session's pipeline (the parity tests' too) rather than a second load."""
        return omni_ltx2

    def _omni(self, model, **kwargs):
        kwargs = {**self.engine_kwargs, **kwargs}
        if self._engines is not None and set(kwargs) <= SHARED:
            return contextlib.nullcontext(self._engines(**kwargs))  # kept open for the session
        return super()._omni(model, **kwargs)
