"""A parallel config the model cannot run fails when the engine starts, before any worker process exists,
with an error that names the field and what is allowed."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import types

import pytest

from omni_core import hookimpl
from omni_core.errors import ConfigError
from omni_core.plugins.types import PipelineSpec


def _start(model: str, parallel_config: dict):
    from omni_core import Omni

    return Omni(model, parallel_config=parallel_config, warmup=False)


def test_strategy_the_pipeline_does_not_declare_fails_at_start(qwen_dir, tmp_path, monkeypatch,
                                                                register_omni_plugin):
    """A pipeline registered without "ring" (a QwenImagePipeline subclass) refuses ring_degree=2."""
    from omni_model_qwen_image.pipeline import QwenImagePipeline

    class NoRingQwenImagePipeline(QwenImagePipeline):
        supported_parallel = ("ulysses", "cfg")

    module = types.ModuleType("omni_parallel_test_no_ring")
    module.NoRingQwenImagePipeline = NoRingQwenImagePipeline
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class NoRingPlugin:
        @hookimpl
        def omni_register_pipelines(self):
            return [PipelineSpec(name="NoRingQwenImagePipeline", impl=f"{module.__name__}:NoRingQwenImagePipeline",
                                 supported_parallel=("ulysses", "cfg"))]

    register_omni_plugin(NoRingPlugin(), "model-no-ring")
    with open(os.path.join(qwen_dir, "model_index.json")) as f:
        index = json.load(f)
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "_class_name": "NoRingQwenImagePipeline"}))

    with pytest.raises(ConfigError, match=r"does not support ring parallelism; it supports: cfg, ulysses") as e:
        _start(str(tmp_path), {"ring_degree": 2})
    assert e.value.field == "parallel_config"
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(("model", "what"), [("qwen_dir", "QwenImagePipeline"),
                                             ("wan_dir", r"WanPipeline \(transformer\)")])
def test_ulysses_degree_must_divide_the_heads(model, what, request):
    """Both tiny models have 4 heads: Ulysses 8 cannot split them; the error lists the degrees that can."""
    folder = request.getfixturevalue(model)
    with pytest.raises(ConfigError, match=rf"ulysses_degree=8 is invalid: Ulysses splits the 4 attention heads of "
                                          rf"{what} across ranks, so the degree must divide 4 \(allowed: 1, 2, 4\)"
                       ) as e:
        _start(folder, {"ulysses_degree": 8})
    assert e.value.field == "ulysses_degree"
    assert not multiprocessing.active_children()


def test_bad_degrees_name_the_field(qwen_dir):
    with pytest.raises(ConfigError, match="cfg_parallel_size") as e:
        _start(qwen_dir, {"cfg_parallel_size": 3})
    assert e.value.field == "cfg_parallel_size"
    with pytest.raises(ConfigError, match="ring_degree"):
        _start(qwen_dir, {"ring_degree": 0})
    with pytest.raises(ConfigError, match="unknown field 'ulysses'"):
        _start(qwen_dir, {"ulysses": 2})


def test_shapes_ulysses_degree_must_divide_its_heads():
    """The trained model's head count comes from its folder; a degree that does not divide it is refused
    before any worker starts."""
    from omni_core.pipelines import resolve_model

    with open(os.path.join(resolve_model("shapes").model_path, "transformer", "config.json")) as f:
        heads = json.load(f)["num_heads"]
    with pytest.raises(ConfigError, match=rf"Ulysses splits the {heads} attention heads of ShapesPipeline") as e:
        _start("shapes", {"ulysses_degree": heads + 1, "ring_degree": 1})
    assert e.value.field == "ulysses_degree"
    assert not multiprocessing.active_children()
