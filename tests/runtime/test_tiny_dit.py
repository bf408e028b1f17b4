"""The tiny DiT of ``omni_core.testing``: a real model folder, registered for the session, that runs with only the
core and one cache plugin (what a cache plugin's own test run has)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ONLY_CORE_AND_TEACACHE = r'''
import json, sys
sys.modules["omni_attention_sdpa"] = None      # as if omni-attention-sdpa were not installed
from omni_core import Omni
from omni_core.plugins import get_plugin_manager

pm = get_plugin_manager()
with Omni(sys.argv[1], cache_backend="tea_cache", warmup=False) as omni:
    (out,) = omni.generate("a red square", seed=3, num_inference_steps=6, use_tqdm=False)
from omni_core.platforms import current_platform
default = current_platform.default_attention_backend(64, None)
print(json.dumps({"attention": [default, pm.get_component("attention", default).provider],
                  "pipelines": sorted(pm.components("pipeline")), "status": out.status,
                  "reused": out.metrics.get("steps_reused")}))
'''


def test_folder_loads_through_the_real_loader_by_path_and_by_name(tiny_dit_model):
    from omni_core.pipelines import resolve_model
    from omni_core.pipelines.denoiser import denoisers_of
    from omni_core.testing.tiny_dit import TinyDiTPipeline

    with open(os.path.join(tiny_dit_model, "model_index.json")) as f:
        assert json.load(f)["_class_name"] == "OmniTinyDiTPipeline"
    assert resolve_model("tiny-dit").model_path == os.path.abspath(tiny_dit_model)
    resolved = resolve_model(tiny_dit_model)
    assert resolved.pipeline_cls() is TinyDiTPipeline
    weights = [f for _, _, fs in os.walk(tiny_dit_model) for f in fs if f.endswith(".safetensors")]
    assert len(weights) == 2
    from omni_core.testing._model import load_model

    (spec,) = denoisers_of(load_model(tiny_dit_model))
    spec.check_block_signature()
    assert spec.sp_plan is not None and spec.num_heads == 2 and spec.defaults_for("tea_cache")


def test_runs_with_only_the_core_and_one_cache_plugin(tiny_dit_model):
    pytest.importorskip("omni_cache_teacache")
    env = {**os.environ, "OMNI_PLUGINS": "cache-teacache,testing-tiny-dit", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", ONLY_CORE_AND_TEACACHE, tiny_dit_model], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the platform's default is the stand-in (from its record), since omni-attention-sdpa is absent
    assert result["attention"] == ["TESTING_REFERENCE", "omni-testing-tiny-dit"]
    assert result["pipelines"] == ["OmniTinyDiTPipeline"]  # no model plugin
    assert result["status"] == "completed" and result["reused"] > 0
