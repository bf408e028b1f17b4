"""Session fixtures of the cache x model tests: tiny Qwen-Image and Wan 2.2 folders, loaded once through Omni's real
loader and shared by the tea_cache and cache_dit tests (each test enables its backend and disables it after)."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("combo-qwen"), num_layers=2)


@pytest.fixture(scope="session")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("combo-wan22"), two_experts=True)


@pytest.fixture(scope="session")
def qwen(qwen_dir: str):
    return load_model(qwen_dir)


@pytest.fixture(scope="session")
def wan22(wan22_dir: str):
    return load_model(wan22_dir)
