"""Session fixtures: the tiny family folders (built once per session, on first use) and torch at one thread."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def family(family_root: str):
    """``family(name)`` -> the folder of that tiny family (``omni_model_diffusers.testing.FAMILIES``)."""
    from omni_model_diffusers.testing import build_family

    return lambda name: build_family(name, family_root)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """The tiny models' kernels are microseconds long: a second thread only spins on a shared machine. The engines
    run with cpu_threads=1 too, so Omni and the reference call sum in the same order."""
