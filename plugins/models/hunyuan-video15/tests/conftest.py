"""Session fixtures: the tiny HunyuanVideo 1.5 text-to-video folder (``hv_dir``), Omni's pipeline from it
(``omni_hv``) and diffusers' own (``diffusers_hv``); the image-to-video folder (``hvi2v_dir``, ``omni_hvi2v``,
``diffusers_hvi2v``); torch at one thread per test (tiny kernels only spin on a shared machine)."""

from __future__ import annotations

import functools
import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_hunyuan_video15.testing import build_tiny_hunyuan_video15

os.environ.setdefault("HF_HUB_OFFLINE", "1")

hv_dir, omni_hv, diffusers_hv = tiny_model_fixtures("hv", build_tiny_hunyuan_video15)
hvi2v_dir, omni_hvi2v, diffusers_hvi2v = tiny_model_fixtures("hvi2v", functools.partial(build_tiny_hunyuan_video15,
                                                                                        i2v=True))


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Each test starts at one torch thread."""
