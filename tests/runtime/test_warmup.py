"""Start-up warm-up: one step at the smallest valid shape; a failure names the model, the shape, the failing
source line and how to skip the warm-up."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest

from omni_core import Omni
from omni_core.errors import OmniError


def test_warmup_runs_one_step_at_the_smallest_valid_shape(tiny_model):
    with Omni(tiny_model) as omni:  # warm-up on (the default)
        engine = omni.engine
        params = engine.warmup_params()
        assert (params.height, params.width, params.num_inference_steps) == (8, 8, 1)  # size_multiple 8
        assert engine.stats()["requests_completed"] == 1  # the warm-up request ran and finished
        log = list(engine.executor.runner.pipeline.denoise_log)
        assert len(log) == 1 and len(log[0]) == 1 and log[0][0][0].startswith("warmup-")
        assert engine.stats()["tracked_requests"] == []


@pytest.fixture(scope="module")
def failing_warmup_model(tiny_model, tmp_path_factory):
    """TinyTestPipeline's weights under ``FailingWarmupPipeline``, whose declared warm-up fails at step 0."""
    path = tmp_path_factory.mktemp("failing-warmup")
    shutil.copy(f"{tiny_model}/denoiser.pt", path / "denoiser.pt")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "FailingWarmupPipeline"}))
    return str(path)


def raise_line() -> str:
    """``pipeline.py:LINE`` of the ``raise`` in the test pipeline's ``denoise_step``."""
    from omni_test_pipeline.pipeline import TinyTestPipeline

    lines, start = inspect.getsourcelines(TinyTestPipeline.denoise_step)
    offset = next(i for i, line in enumerate(lines) if "raise RuntimeError" in line)
    return f"pipeline.py:{start + offset} in denoise_step"


@pytest.mark.parametrize("executor", ["uni", pytest.param("mp", marks=pytest.mark.dist)])
def test_a_failing_warmup_names_model_shape_frame_and_the_way_out(failing_warmup_model, executor):
    with pytest.raises(OmniError) as info:
        Omni(failing_warmup_model, executor=executor)
    msg = str(info.value)
    assert "'FailingWarmupPipeline'" in msg  # the model
    assert "height=8 width=8 steps=1" in msg  # the shape it ran
    assert "injected failure at step 0" in msg  # the error itself
    assert raise_line() in msg  # the failing source frame, even from a worker process
    assert "warmup=False" in msg and "--no-warmup" in msg  # how to skip it
    with Omni(failing_warmup_model, executor=executor, warmup=False) as omni:  # and skipping it works
        assert omni.generate("x", use_tqdm=False)[0].status == "completed"
