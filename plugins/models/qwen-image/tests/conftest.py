"""Session fixtures: one tiny Qwen-Image folder, diffusers' pipeline and Omni's pipeline loaded from it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("tiny-qwen-image"))


@pytest.fixture(scope="session")
def diffusers_qwen(qwen_dir: str):
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    return load_diffusers_pipeline(qwen_dir)


@pytest.fixture(scope="session")
def omni_qwen(qwen_dir: str):
    """Omni's pipeline through the real path: entry-point discovery, ``resolve_model``, ``load_pipeline``."""
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    config = OmniDiffusionConfig(model=qwen_dir, dtype="float32")
    return load_pipeline(resolve_model(qwen_dir), config, "cpu", torch.float32)


@pytest.fixture(scope="session")
def edit_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image_edit

    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny-qwen-image-edit"))


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


@pytest.fixture(scope="session")
def diffusers_edit(edit_dir: str):
    """diffusers' own ``QwenImageEditPipeline`` from the folder; the processor is handed in because
    transformers cannot load ``Qwen2VLProcessor`` without torchvision (see ``processor.py``)."""
    from diffusers import DiffusionPipeline

    from omni_model_qwen_image.processor import load_processor

    pipe = DiffusionPipeline.from_pretrained(edit_dir, processor=load_processor(edit_dir), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def omni_edit(edit_dir: str):
    """Omni's edit pipeline through the real path: entry point, ``resolve_model``, ``load_pipeline``."""
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    return load_pipeline(resolve_model(edit_dir), OmniDiffusionConfig(model=edit_dir, dtype="float32"), "cpu",
                         torch.float32)


@pytest.fixture(scope="session")
def plus_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image_edit

    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny-qwen-image-edit-plus"), plus=True)


@pytest.fixture(scope="session")
def diffusers_plus(plus_dir: str):
    from diffusers import DiffusionPipeline

    from omni_model_qwen_image.processor import load_processor

    pipe = DiffusionPipeline.from_pretrained(plus_dir, processor=load_processor(plus_dir), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def omni_plus(plus_dir: str):
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    return load_pipeline(resolve_model(plus_dir), OmniDiffusionConfig(model=plus_dir, dtype="float32"), "cpu",
                         torch.float32)
