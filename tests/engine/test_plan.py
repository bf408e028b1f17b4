"""``plan_engine``: every start-up check of a config happens in the plan, before any thread or worker starts, and
the plan names what the engine will run; the engine runs a finished plan and validates a request once.
Runs the test-only ``TinyTestPipeline`` (``omni-test-pipeline``)."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import types

import pytest

from omni_core.config import OmniDiffusionConfig
from omni_core.errors import ConfigError


def engine_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("omni-")}


def test_the_plan_names_the_chosen_classes_and_the_engine_runs_it(tiny_model):
    from omni_core.engine import DiffusionEngine, plan_engine
    from omni_core.executor.uni import UniProcExecutor
    from omni_core.sched import StepScheduler

    plan = plan_engine(OmniDiffusionConfig.from_kwargs(model=tiny_model, step_execution=True, max_num_seqs=3,
                                                       executor="uni", warmup=False))
    assert plan.scheduler_cls is StepScheduler and plan.executor_cls is UniProcExecutor
    assert plan.capacity == 3 and plan.mode.mode.value == "step_batch"
    summary = plan.summary()
    assert summary["scheduler"] == "omni_core.sched.step_scheduler:StepScheduler"
    assert summary["executor"] == "omni_core.executor.uni:UniProcExecutor"
    assert summary["pipeline"] == "TinyTestPipeline" and summary["mode"] == "step_batch"
    engine = DiffusionEngine(plan)
    try:
        assert engine.plan is plan and type(engine.scheduler) is StepScheduler and engine.limits is plan.limits
        assert engine.model_info.pipeline == "TinyTestPipeline"
    finally:
        engine.close()


def test_a_bad_config_is_refused_by_the_plan_before_any_thread_or_worker_starts(tiny_model):
    from omni_core.engine import plan_engine

    threads, children = engine_threads(), set(multiprocessing.active_children())
    config = OmniDiffusionConfig.from_kwargs(model=tiny_model, parallel_config={"ulysses_degree": 2}, warmup=False)
    with pytest.raises(ConfigError, match="does not support ulysses") as err:
        plan_engine(config)
    assert err.value.field == "parallel_config"
    assert engine_threads() == threads and set(multiprocessing.active_children()) == children


class NotAScheduler:
    """A scheduler plugin's class that does not declare the interface the engine calls."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity


def test_a_scheduler_that_does_not_declare_the_interface_is_refused_by_name(tiny_model, register_omni_plugin):
    from omni_core import hookimpl
    from omni_core.engine import plan_engine
    from omni_core.plugins.types import SchedulerSpec

    module = types.ModuleType("omni_sched_undeclared_plugin")
    module.NotAScheduler = NotAScheduler

    @hookimpl
    def omni_register_schedulers():
        return [SchedulerSpec(name="undeclared", impl="omni_sched_undeclared_plugin:NotAScheduler")]

    module.omni_register_schedulers = omni_register_schedulers
    sys.modules[module.__name__] = module
    try:
        register_omni_plugin(module, "omni-scheduler-undeclared")
        threads = engine_threads()
        with pytest.raises(ConfigError, match="'undeclared'.*SchedulerInterface") as err:
            plan_engine(OmniDiffusionConfig.from_kwargs(model=tiny_model, scheduler="undeclared", warmup=False))
        assert err.value.field == "scheduler" and engine_threads() == threads
    finally:
        sys.modules.pop(module.__name__, None)


def test_a_prepared_request_is_validated_once(edit_model):
    """``prepare_request`` checks the input images and converts them to tensors; ``submit`` of that same request
    does not check them again (the pipeline's check has no second-pass guard any more), while a request whose
    params were replaced after preparing is checked again."""
    from PIL import Image

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    params = SamplingParams.from_kwargs(num_inference_steps=1, seed=0, height=16, width=16)
    with Omni(edit_model, warmup=False) as omni:
        request = omni.engine.prepare_request(OmniDiffusionRequest(
            prompt="x", sampling_params=params, images=[Image.new("RGB", (16, 16), (200, 0, 0))]))
        (handle,) = omni.engine.submit([request])
        assert handle.result(timeout=60).status == "completed"
        again = omni.engine.prepare_request(OmniDiffusionRequest(
            prompt="x", sampling_params=params, images=[Image.new("RGB", (16, 16), (0, 0, 200))]))
        again.sampling_params = again.sampling_params.replace(height=15)  # changed after preparing: checked again
        with pytest.raises(ConfigError) as err:
            omni.engine.submit([again])
        assert err.value.field == "height"
