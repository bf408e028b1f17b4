"""Session fixtures: one tiny PixArt-Sigma folder, and this plugin's and diffusers' pipelines loaded from it
(``pixart_dir``, ``omni_pixart``, ``diffusers_pixart``); torch at one thread per test."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_pixart.testing import build_tiny_pixart

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pixart_dir, omni_pixart, diffusers_pixart = tiny_model_fixtures("pixart", build_tiny_pixart)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Tiny models' kernels are microseconds long: a second thread only spins on a shared machine."""
