"""Session fixtures: the tiny LTX-2 folder, Omni's and diffusers' pipelines from it (``ltx2_dir``, ``omni_ltx2``,
``diffusers_ltx2``; ``i2v_dir``, ... for image-to-video); ``ltx2_engines``: started ``Omni`` engines on the tiny
folder shared by the session (one per distinct engine keywords); torch at ``OMNI_TEST_THREADS`` (default 1) per
test: tiny models' kernels are microseconds long, a second thread only spins on the shared machine."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_ltx2.testing import build_tiny_ltx2, build_tiny_ltx2_i2v

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ltx2_dir, omni_ltx2, diffusers_ltx2 = tiny_model_fixtures("ltx2", build_tiny_ltx2)
i2v_dir, omni_i2v, diffusers_i2v = tiny_model_fixtures("i2v", build_tiny_ltx2_i2v)

#: what every shared engine is started with (the contract's and the CLI's engines agree on these)
ENGINE_DEFAULTS = {"warmup": False, "cpu_threads": 1, "step_execution": False}


@pytest.fixture(scope="session")
def ltx2_engines(ltx2_dir):
    """``engine(**kwargs)``: ``Omni(ltx2_dir, **ENGINE_DEFAULTS, **kwargs)``, started once per distinct keywords and
    kept for the session (starting one is the expensive part of an end-to-end test); closed at the end."""
    from omni_core import Omni

    engines: dict = {}

    def engine(**kwargs):
        kwargs = {**ENGINE_DEFAULTS, **kwargs}
        key = tuple(sorted(kwargs.items()))
        if key not in engines:
            engines[key] = Omni(ltx2_dir, **kwargs)
        return engines[key]

    yield engine
    for omni in engines.values():
        omni.close()


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """Each test starts at ``OMNI_TEST_THREADS`` threads."""
