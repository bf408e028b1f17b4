"""Session fixtures: tiny Qwen-Image, Qwen-Image-Edit and Edit Plus folders, Omni's and diffusers' pipelines
loaded from each (``qwen_dir``, ``omni_qwen``, ``diffusers_qwen``; ``edit_*``; ``plus_*``), and the edit tests'
input image; torch at one thread per test (``one_torch_thread``)."""

from __future__ import annotations

import functools
import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_qwen_image.testing import build_tiny_qwen_image, build_tiny_qwen_image_edit

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _processor(path: str) -> dict:
    """diffusers' edit pipelines get the processor handed in: transformers cannot load ``Qwen2VLProcessor``
    without torchvision (see ``processor.py``)."""
    from omni_model_qwen_image.processor import load_processor

    return {"processor": load_processor(path)}


qwen_dir, omni_qwen, diffusers_qwen = tiny_model_fixtures("qwen", build_tiny_qwen_image)
edit_dir, omni_edit, diffusers_edit = tiny_model_fixtures("edit", build_tiny_qwen_image_edit,
                                                          reference_components=_processor)
plus_dir, omni_plus, diffusers_plus = tiny_model_fixtures("plus", functools.partial(build_tiny_qwen_image_edit,
                                                                                    plus=True),
                                                          reference_components=_processor)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """The tiny model's kernels are microseconds long: a second thread only spins on a shared machine."""


@pytest.fixture(scope="session")
def edit_image():
    """The input image every edit test uses: 64x48, a red-to-blue gradient with a white square and some noise
    (diffusers resizes it to 1184x896)."""
    import numpy as np
    from PIL import Image

    x = np.linspace(0, 1, 64)[None, :, None]
    rgb = np.concatenate([np.broadcast_to(1 - x, (48, 64, 1)), np.full((48, 64, 1), 0.2),
                          np.broadcast_to(x, (48, 64, 1))], axis=2)
    rgb[10:30, 20:44] = 1.0
    rgb = rgb + 0.05 * np.random.RandomState(0).randn(48, 64, 3)
    return Image.fromarray((rgb.clip(0, 1) * 255).astype(np.uint8))
