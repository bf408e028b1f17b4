"""Session fixtures for the LoRA tests: tiny Qwen-Image and Wan folders, adapters made for them with peft, and
the Omni engines (started once, closed at the end of the session)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Qwen-Image's joint attention has text-side projections too
QWEN_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("lora-qwen"))


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("lora-wan"))


@pytest.fixture(scope="session")
def qwen_loras(qwen_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """a: rank 4; b: rank 8 with alpha 4; c: rank 4 (another seed); big: rank 16 (above the engines' limit)."""
    from omni_core.lora.testing import make_lora

    root = tmp_path_factory.mktemp("qwen-loras")
    specs = {"a": dict(rank=4, seed=1), "b": dict(rank=8, alpha=4, seed=2), "c": dict(rank=4, seed=3),
             "big": dict(rank=16, seed=4)}
    return {k: make_lora(qwen_dir, str(root / k), targets=QWEN_TARGETS, std=0.5, **v) for k, v in specs.items()}


@pytest.fixture(scope="session")
def wan_loras(wan_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from omni_core.lora.testing import make_lora

    root = tmp_path_factory.mktemp("wan-loras")
    return {"a": make_lora(wan_dir, str(root / "a"), rank=4, seed=1, std=0.5),
            "b": make_lora(wan_dir, str(root / "b"), rank=8, alpha=4, seed=2, std=0.5)}


def _omni(model: str, **kwargs):
    from omni_core import Omni

    return Omni(model, dtype="float32", max_lora_rank=8, **kwargs)


@pytest.fixture(scope="session")
def qwen_omni(qwen_dir, qwen_loras):
    """Request mode, three requests per wave, ``a`` preloaded by name (``b`` and ``c`` are used by path)."""
    with _omni(qwen_dir, max_num_seqs=3, loras={"a": qwen_loras["a"]}) as omni:
        yield omni


@pytest.fixture(scope="session")
def qwen_step_omni(qwen_dir, qwen_loras):
    """Step mode, three requests per wave, an LRU of two adapters."""
    with _omni(qwen_dir, max_num_seqs=3, step_execution=True, max_loras=2, loras={"a": qwen_loras["a"]}) as omni:
        yield omni


@pytest.fixture(scope="session")
def wan_omni(wan_dir, wan_loras):
    with _omni(wan_dir, max_num_seqs=3, loras={"a": wan_loras["a"]}) as omni:
        yield omni
