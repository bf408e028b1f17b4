"""``ExecutorContract``: what every executor owes the engine, as a pytest class to subclass.

    from omni_core.testing.executor_contract import ExecutorContract

    class TestMyExecutorContract(ExecutorContract):
        executor = "my-executor"           # the executor's component name
        options = {"my_executor_hosts": 1}  # more ``Omni(...)`` options, if it needs any

The model defaults to the tiny DiT of :mod:`omni_core.testing.tiny_dit` (fixture ``tiny_dit_model``), so an
executor plugin's tests need no model plugin. Checked through the engine, as users run it: in both modes the
outputs equal the in-process ``uni`` executor's for the same seeds (a batch, and requests joining a step wave
late); a running request's abort stops it early; a collective call reaches every rank in rank order and
nothing is held once requests end; ``close`` leaves none of the executor's processes; and where the model runs
in processes of its own, killing one fails every caller within seconds naming the engine dead, and admission
refuses after. The suite skips when the executor is not installed.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, ClassVar

import pytest

from omni_core.testing._model import contract_model
from omni_core.testing.waiting import abort_after_steps, wait_for

__all__ = ["ExecutorContract"]

PROMPTS = ("a red circle", "a small blue square on a white background", "green")


class ExecutorContract:
    #: the executor's component name
    executor: ClassVar[str] = ""
    #: more ``Omni(...)`` options of every engine the suite builds (e.g. ``{"ray_address": ...}``)
    options: ClassVar[dict[str, Any]] = {}
    model: ClassVar[str | None] = None
    model_fixture: ClassVar[str | None] = "tiny_dit_model"
    sampling: ClassVar[dict[str, Any]] = {"height": 32, "width": 32, "num_inference_steps": 4, "output_type": "pt"}
    #: how close an output must be to ``uni``'s (another process may order float sums differently)
    atol: ClassVar[float] = 1e-5

    # ------------------------------------------------------------------ fixtures
    @pytest.fixture(scope="class")
    @classmethod
    def contract_model_path(cls, request: pytest.FixtureRequest) -> str:
        from omni_core.plugins import get_plugin_manager

        if not cls.executor:
            raise pytest.UsageError(f"{cls.__name__}: set `executor` to the executor's component name")
        if cls.executor not in get_plugin_manager().components("executor"):
            pytest.skip(f"executor {cls.executor!r} is not installed")
        return contract_model(cls, request)

    @classmethod
    def _omni(cls, model: str, executor: str | None = None, **kwargs: Any) -> Any:
        from omni_core import Omni

        options = dict(cls.options) if executor is None else {}
        kwargs.setdefault("limits", {"max_steps": 1000})  # the abort check's long request
        return Omni(model, executor=executor or cls.executor, warmup=False, **{**options, **kwargs})

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, contract_model_path: str) -> list[Any]:
        """``uni``'s outputs for the suite's prompts (request mode, one batch)."""
        with cls._omni(contract_model_path, "uni", max_num_seqs=4) as omni:
            return [o.tensor for o in cls._batch(omni)]

    @pytest.fixture(scope="class")
    @classmethod
    def step_engine(cls, contract_model_path: str) -> Any:
        with cls._omni(contract_model_path, step_execution=True, max_num_seqs=4) as omni:
            yield omni

    @pytest.fixture(scope="class")
    @classmethod
    def request_engine(cls, contract_model_path: str) -> Any:
        with cls._omni(contract_model_path, max_num_seqs=4) as omni:
            yield omni

    @classmethod
    def _requests(cls, seeds: Any = None, **overrides: Any) -> list[Any]:
        from omni_core.config import SamplingParams
        from omni_core.request import OmniDiffusionRequest

        seeds = range(len(PROMPTS)) if seeds is None else seeds
        return [OmniDiffusionRequest(prompt=PROMPTS[i % len(PROMPTS)], sampling_params=SamplingParams.from_kwargs(
            **{**cls.sampling, "seed": 100 + i, **overrides})) for i in seeds]

    @classmethod
    def _batch(cls, omni: Any) -> list[Any]:
        outs = [h.result(timeout=120) for h in omni.engine.submit(cls._requests())]
        assert all(o.status == "completed" for o in outs), [o.error for o in outs]
        return outs

    def _close_to(self, got: Any, want: Any) -> bool:
        import torch

        return got.shape == want.shape and torch.allclose(got, want, atol=self.atol, rtol=0)

    # ------------------------------------------------------------------ checks
    def test_a_batch_equals_the_in_process_executors(self, request_engine: Any, step_engine: Any,
                                                      reference: list[Any]) -> None:
        for omni in (request_engine, step_engine):
            got = [o.tensor for o in self._batch(omni)]
            assert all(self._close_to(g, w) for g, w in zip(got, reference)), (
                f"{self.executor} ({omni.engine.execution_mode.value}) gives other images than uni for the same seeds")

    def test_requests_joining_a_step_wave_late_equal_the_batch(self, step_engine: Any, reference: list[Any]) -> None:
        engine, handles = step_engine.engine, []
        for request in self._requests():  # each arrives while the ones before it are denoising
            handles += engine.submit([request])
            time.sleep(0.02)
        got = [h.result(timeout=120).tensor for h in handles]
        assert all(self._close_to(g, w) for g, w in zip(got, reference))

    @pytest.mark.parametrize("mode", ["request", "step"])
    def test_an_abort_stops_a_running_request(self, request_engine: Any, step_engine: Any, mode: str) -> None:
        """A running request's abort reaches the model and stops it far short of its 1000 steps, within seconds.
        (Which step it lands on is not read here: workers report progress in batches, ``PROGRESS_INTERVAL_S``, so
        the step a listener saw lags the one running; the engine's own tests pin it to one step.)"""
        omni = step_engine if mode == "step" else request_engine
        (request,) = self._requests([0], num_inference_steps=1000)
        handle, at_abort = abort_after_steps(omni.engine, request, steps=2)
        aborted = time.monotonic()
        out = handle.result(timeout=60)
        assert out.status == "aborted", out.error
        assert time.monotonic() - aborted < 10.0
        assert at_abort <= out.metrics["steps_run"] < 1000, f"aborted at step {at_abort}, ran {out.metrics['steps_run']}"

    def test_a_collective_call_reaches_every_rank_and_nothing_is_held_after(self, step_engine: Any) -> None:
        engine = step_engine.engine
        self._batch(step_engine)
        described = engine.collective_rpc("describe")
        world = engine.config.world_size
        assert [d["rank"] for d in described] == list(range(world))
        assert engine.collective_rpc("held_ids") == [set()] * world
        assert step_engine.stats()["tracked_requests"] == []

    def test_a_dead_model_process_fails_every_caller_and_close_leaves_no_process(
            self, contract_model_path: str) -> None:
        """Where the model runs outside this process: kill one (SIGKILL) while requests run; every caller gets
        an error within 15 s, the engine says it is dead, admission refuses, and ``close`` leaves no process. In
        process (``uni``-like): ``close`` twice is safe."""
        from omni_core.errors import EngineDeadError
        from omni_core.testing.processes import alive

        omni = self._omni(contract_model_path, step_execution=True)
        try:
            pids = [d["pid"] for d in omni.engine.collective_rpc("describe")]
            own = [pid for pid in pids if pid != os.getpid()]
            if own:
                handles = omni.engine.submit(self._requests(num_inference_steps=200))
                wait_for(lambda: omni.stats()["denoise_steps"] > 0, "a step", timeout=60)
                os.kill(own[-1], signal.SIGKILL)
                start = time.monotonic()
                outs = [h.result(timeout=15) for h in handles]
                assert time.monotonic() - start < 15
                assert all(o.status == "error" and "dead" in o.error for o in outs), [o.error for o in outs]
                assert omni.engine.is_dead and "dead" in omni.engine.dead_reason
                with pytest.raises(EngineDeadError):
                    omni.engine.submit(self._requests([0]))
        finally:
            omni.close()
        omni.close()
        wait_for(lambda: not any(alive(pid) for pid in own), f"the executor's processes {own} to exit", timeout=20)
