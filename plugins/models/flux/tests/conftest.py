"""Session fixtures: tiny FLUX.1-dev and schnell folders, diffusers' pipelines and Omni's loaded from them."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: torch threads of these tests (in-process pipelines and the engines they start, ``cpu_threads``): the tiny
#: model's kernels are microseconds long, so on a shared 2-core machine a second spinning thread costs ~10x
TEST_THREADS = 1


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


def _load_omni(path: str):
    """Omni's pipeline through the real path: entry-point discovery, ``resolve_model``, ``load_pipeline``."""
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    return load_pipeline(resolve_model(path), OmniDiffusionConfig(model=path, dtype="float32"), "cpu", torch.float32)


@pytest.fixture(scope="session")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """FLUX.1-dev layout: ``guidance_embeds=True``."""
    from omni_model_flux.testing import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux-dev"), guidance_embeds=True)


@pytest.fixture(scope="session")
def schnell_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """FLUX.1-schnell layout: ``guidance_embeds=False``."""
    from omni_model_flux.testing import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny-flux-schnell"), guidance_embeds=False)


@pytest.fixture(scope="session")
def diffusers_flux(flux_dir: str):
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    return load_diffusers_pipeline(flux_dir)


@pytest.fixture(scope="session")
def diffusers_schnell(schnell_dir: str):
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    return load_diffusers_pipeline(schnell_dir)


@pytest.fixture(scope="session")
def omni_flux(flux_dir: str):
    return _load_omni(flux_dir)


@pytest.fixture(scope="session")
def omni_schnell(schnell_dir: str):
    return _load_omni(schnell_dir)
