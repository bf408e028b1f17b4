"""Session fixtures: tiny FLUX.2 [klein] (CFG) and [dev] (embedded guidance) folders, Omni's and diffusers'
pipelines loaded from each (``klein_dir``, ``omni_klein``, ``diffusers_klein``; ``dev_dir``, ...); torch at one
thread per test (``one_torch_thread``)."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_flux2.testing import build_tiny_flux2_dev, build_tiny_flux2_klein

os.environ.setdefault("HF_HUB_OFFLINE", "1")

klein_dir, omni_klein, diffusers_klein = tiny_model_fixtures("klein", build_tiny_flux2_klein)
dev_dir, omni_dev, diffusers_dev = tiny_model_fixtures("dev", build_tiny_flux2_dev)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """The tiny model's kernels are microseconds long: a second thread only spins on a shared machine."""
