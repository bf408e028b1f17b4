"""Session fixtures: one tiny Z-Image folder, Omni's and diffusers' pipelines loaded from it (``zimage_dir``,
``omni_zimage``, ``diffusers_zimage``); torch at one thread per test (``one_torch_thread``)."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_z_image.testing import build_tiny_z_image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

zimage_dir, omni_zimage, diffusers_zimage = tiny_model_fixtures("zimage", build_tiny_z_image)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """The tiny model's ops are far too small to gain from a second thread; on a shared machine two threads per
    op wait on each other (measured 5-10x slower under load); results do not depend on it."""
