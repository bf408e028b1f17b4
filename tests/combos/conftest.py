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


NEG = "blurry, low quality"


@pytest.fixture(scope="session")
def qwen_states(qwen, qwen_dir: str):
    """``qwen_states(prompts, steps=8, seed=0, negative=NEG)``: a state per prompt for the tiny Qwen-Image (32 x 32,
    CFG on through the negative prompt), request ``i`` seeded ``seed + i``; ``steps`` an int or one per prompt."""
    from omni_core.testing import make_states

    def states(prompts, *, steps=8, seed=0, negative=NEG):
        return make_states(qwen, prompts, seed=seed, negative_prompt=negative, model_path=qwen_dir, height=32,
                           width=32, num_inference_steps=steps, max_sequence_length=64)

    return states


@pytest.fixture(scope="session")
def wan_states(wan22, wan22_dir: str):
    """``wan_states(prompts, steps=8, seed=0)``: a state per prompt for the tiny two-expert Wan 2.2 (16 x 16, five
    frames, guidance 5 with a negative prompt), request ``i`` seeded ``seed + i``."""
    from omni_core.testing import make_states

    def states(prompts, *, steps=8, seed=0):
        return make_states(wan22, prompts, seed=seed, negative_prompt=NEG, model_path=wan22_dir, height=16, width=16,
                           num_frames=5, num_inference_steps=steps, guidance_scale=5.0, max_sequence_length=32)

    return states
