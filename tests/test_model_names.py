"""Short model names: ``default_model_path`` as a ``"module:attr"`` function or a plain absolute folder path,
and clear errors for a relative path or a folder that is not there."""

from __future__ import annotations

import pytest

from omni_core import hookimpl
from omni_core.errors import ConfigError
from omni_core.pipelines import resolve_model
from omni_core.plugins.types import PipelineSpec


def _plugin(**spec):
    class Plugin:
        @hookimpl
        def omni_register_pipelines(self):
            return [PipelineSpec(name="TinyNamedPipeline", impl="omni_test_pipeline.pipeline:TinyTestPipeline",
                                 model_names=("tiny",), **spec)]
    return Plugin()


@pytest.fixture
def model_dir(tmp_path):
    return str(tmp_path)


def test_plain_absolute_path_resolves(register_omni_plugin, model_dir):
    register_omni_plugin(_plugin(default_model_path=model_dir), "tiny-named")
    resolved = resolve_model("tiny")
    assert resolved.model_path == model_dir and resolved.spec.name == "TinyNamedPipeline"


def test_function_reference_resolves(register_omni_plugin):
    """``"module:attr"`` names a no-argument function returning the folder (tempfile.gettempdir is one)."""
    import tempfile

    register_omni_plugin(_plugin(default_model_path="tempfile:gettempdir"), "tiny-named")
    assert resolve_model("tiny").model_path == tempfile.gettempdir()


def test_relative_path_is_refused_with_the_allowed_forms():
    with pytest.raises(ValueError, match="default_model_path must be a 'module:attr' string naming a function that "
                                         "returns the model folder, or an absolute folder path; got 'weights/tiny'"):
        PipelineSpec(name="P", impl="m:P", default_model_path="weights/tiny")


def test_missing_folder_names_the_model_and_the_path(register_omni_plugin, tmp_path):
    gone = str(tmp_path / "not-there")
    register_omni_plugin(_plugin(default_model_path=gone), "tiny-named")
    with pytest.raises(ConfigError, match=f"model name 'tiny' .* points to '{gone}', which is not a folder") as err:
        resolve_model("tiny")
    assert err.value.field == "model"
