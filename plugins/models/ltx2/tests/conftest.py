"""Session fixtures: the tiny LTX-2 folder, Omni's and diffusers' pipelines from it (``ltx2_dir``, ``omni_ltx2``,
``diffusers_ltx2``; ``i2v_dir``, ... for image-to-video); torch at ``OMNI_TEST_THREADS`` (default 1) per test: tiny models' kernels are microseconds
long, a second thread only spins on the shared machine."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_ltx2.testing import build_tiny_ltx2, build_tiny_ltx2_i2v

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ltx2_dir, omni_ltx2, diffusers_ltx2 = tiny_model_fixtures("ltx2", build_tiny_ltx2)
i2v_dir, omni_i2v, diffusers_i2v = tiny_model_fixtures("i2v", build_tiny_ltx2_i2v)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Each test starts at ``OMNI_TEST_THREADS`` threads."""
