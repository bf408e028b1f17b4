"""A model whose folder decides its size rules and default size overrides two class methods, and the base check,
``super()`` and the start-up warm-up follow the folder (author gap 7)."""

from __future__ import annotations

import pytest

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines.base import OmniPipeline


class _FolderSized(OmniPipeline):
    """Multiples and default size read from the folder (here: the path names them)."""

    @classmethod
    def size_multiples(cls, model_path=None):
        return (32, 32, 4) if model_path == "/big-vae" else (8, 8, 1)

    @classmethod
    def default_size(cls, model_path=None):
        return (1024, 768) if model_path == "/big-vae" else (256, 256)

    @classmethod
    def check_sampling_params(cls, params, model_path=None):
        return super().check_sampling_params(params, model_path)  # nothing of its own: the base follows the folder


def test_the_base_check_follows_the_folder():
    params = _FolderSized.check_sampling_params(SamplingParams(), "/big-vae")
    assert (params.height, params.width) == (1024, 768)
    assert _FolderSized.check_sampling_params(SamplingParams(height=40, width=48), "/small").height == 40
    with pytest.raises(ConfigError) as err:
        _FolderSized.check_sampling_params(SamplingParams(height=40, width=64), "/big-vae")
    assert err.value.field == "height" and "multiple of 32" in str(err.value)


def test_the_warm_up_takes_the_folders_smallest_shape():
    from omni_core.engine.warmup import warmup_params

    params = warmup_params(_FolderSized, "/big-vae")
    assert (params.height, params.width) == (32, 32)
