"""Session fixtures: the shipped ``shapes`` pipeline (loaded through the real loader) and a random tiny one."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Each test starts at ``OMNI_TEST_THREADS`` threads (default 1). An in-process engine sets the test process's
    torch threads to its own budget (2 on a 2-core machine); with an omni-core whose pytest plugin does not reset
    them per test, the tests after the contract's engines ran their tiny kernels on a spinning OpenMP team of two
    (the evaluator's checks 168 + 51 s against 8 + 5 s at one thread, on a busy 2-core machine)."""


def _load(model: str):
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    return load_pipeline(resolve_model(model), OmniDiffusionConfig(model=model, dtype="float32"), "cpu",
                         torch.float32)


@pytest.fixture(scope="session")
def shapes_pipeline():
    """The shipped, trained model, resolved by its name ``shapes``."""
    return _load("shapes")


@pytest.fixture(scope="session")
def random_shapes_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model of the shipped architecture with random weights (the evaluator's near-chance baseline)."""
    from omni_model_shapes.testing import build_random_shapes, shipped_config

    return build_random_shapes(tmp_path_factory.mktemp("random-shapes"), shipped_config(), seed=1)


@pytest.fixture(scope="session")
def random_shapes(random_shapes_dir: str):
    return _load(random_shapes_dir)
