"""The runner's instrumentation through the hook registry (issue #35): an ``instrument``-stage hook on every
declared denoiser counts the calls into it and their time, and ``stats()["timing"]`` carries them next to the
``denoise_step`` figures, through both executors."""

from __future__ import annotations

import pytest

from omni_core import Omni
from omni_core.hooks import hook_names
from omni_core.worker.instrument import INSTRUMENT_HOOK


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_denoiser_calls_and_time_reach_stats(tiny_dit_model, executor):
    with Omni(tiny_dit_model, executor=executor, max_num_seqs=2, warmup=False) as omni:
        outs = omni.generate(["a cat", "a dog"], seed=0, num_inference_steps=3, use_tqdm=False)
        t = omni.stats()["timing"]
    assert all(o.status == "completed" for o in outs)
    # the tiny DiT makes one transformer call per denoise_step (CFG rows batched into it)
    assert t["denoiser_calls"] == t["denoise_calls"] >= 3
    assert 0 < t["denoiser_s"] <= t["denoise_s"]


def test_the_timing_hook_is_outermost_and_sees_reused_calls(tiny_dit_model):
    with Omni(tiny_dit_model, cache_backend="tea_cache", cache_config={"rel_l1_thresh": 10.0},
              cpu_threads=1, warmup=False) as omni:
        (out,) = omni.generate("a cat", seed=0, num_inference_steps=5, use_tqdm=False)
        t = omni.stats()["timing"]
        (spec,) = omni.engine.executor.runner.pipeline.denoisers()
        names = hook_names(spec.module)
    assert names == [INSTRUMENT_HOOK, "tea_cache"]
    assert out.metrics["steps_reused"] > 0  # the cache skipped work, yet every call was counted
    assert t["denoiser_calls"] == t["denoise_calls"] == 5
