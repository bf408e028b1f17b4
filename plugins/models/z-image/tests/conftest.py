"""Session fixtures: one tiny Z-Image folder, diffusers' pipeline and Omni's pipeline loaded from it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # the tiny model's ops are far too small to gain from a second thread, and on a shared machine two
    # threads per op wait on each other (measured 5-10x slower under load); results do not depend on it
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def zimage_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_z_image.testing import build_tiny_z_image

    return build_tiny_z_image(tmp_path_factory.mktemp("tiny-z-image"))


@pytest.fixture(scope="session")
def diffusers_zimage(zimage_dir: str):
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    return load_diffusers_pipeline(zimage_dir)


@pytest.fixture(scope="session")
def omni_zimage(zimage_dir: str):
    """Omni's pipeline through the real path: entry-point discovery, ``resolve_model``, ``load_pipeline``."""
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    config = OmniDiffusionConfig(model=zimage_dir, dtype="float32")
    return load_pipeline(resolve_model(zimage_dir), config, "cpu", torch.float32)
