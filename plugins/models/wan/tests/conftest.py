"""Session fixtures: tiny Wan 2.1 and Wan 2.2 (two experts) folders, diffusers' and Omni's pipelines from them."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: torch threads for these tests (``OMNI_TEST_THREADS``, default 1): on the shared 2-core CI machine two OpenMP
#: threads of tiny ops spin against the other jobs (a tiny I2V generation: 0.44 s with 1 thread, 10.7 s with 2
#: at load average 7); parity compares both sides in the same process, so the count does not matter to it
TEST_THREADS = int(os.environ.get("OMNI_TEST_THREADS", "1"))


@pytest.fixture(autouse=True)
def _test_threads():
    """Each test starts at ``TEST_THREADS`` (an in-process engine sets its own count when it starts)."""
    import torch

    if torch.get_num_threads() != TEST_THREADS:
        torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def wan21_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan21"))


@pytest.fixture(scope="session")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan22"), two_experts=True)


def _load_both(path: str):
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model
    from omni_core.pipelines.diffusers_folder import load_diffusers_pipeline

    config = OmniDiffusionConfig(model=path, dtype="float32")
    return load_diffusers_pipeline(path), load_pipeline(resolve_model(path), config, "cpu", torch.float32)


@pytest.fixture(scope="session")
def wan21(wan21_dir: str):
    """(diffusers pipeline, Omni pipeline) for the Wan 2.1 folder."""
    return _load_both(wan21_dir)


@pytest.fixture(scope="session")
def wan22(wan22_dir: str):
    """(diffusers pipeline, Omni pipeline) for the two-expert Wan 2.2 folder."""
    return _load_both(wan22_dir)


@pytest.fixture(scope="session")
def i2v21_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wan 2.1 I2V layout: CLIP image encoder + processor, one 36-channel transformer with ``image_dim``."""
    from omni_model_wan.testing import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny-wan21-i2v"))


@pytest.fixture(scope="session")
def i2v22_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wan 2.2 I2V-A14B layout: two 36-channel experts, ``boundary_ratio``, no image encoder."""
    from omni_model_wan.testing import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny-wan22-i2v"), wan22=True)


@pytest.fixture(scope="session")
def ti2v_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wan 2.2 TI2V-5B layout: ``expand_timesteps`` (condition as the first latent frame, per-token timesteps)."""
    from omni_model_wan.testing import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny-ti2v"), expand_timesteps=True)


@pytest.fixture(scope="session")
def i2v21(i2v21_dir: str):
    return _load_both(i2v21_dir)


@pytest.fixture(scope="session")
def i2v22(i2v22_dir: str):
    return _load_both(i2v22_dir)


@pytest.fixture(scope="session")
def ti2v(ti2v_dir: str):
    return _load_both(ti2v_dir)
