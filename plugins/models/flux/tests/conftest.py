"""Session fixtures: tiny FLUX.1-dev (``guidance_embeds=True``) and schnell folders, Omni's and diffusers'
pipelines loaded from each (``flux_dir``, ``omni_flux``, ``diffusers_flux``; ``schnell_dir``, ...); torch at one
thread per test (``one_torch_thread``)."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_flux.testing import build_tiny_flux

os.environ.setdefault("HF_HUB_OFFLINE", "1")

flux_dir, omni_flux, diffusers_flux = tiny_model_fixtures("flux", build_tiny_flux, guidance_embeds=True)
schnell_dir, omni_schnell, diffusers_schnell = tiny_model_fixtures("schnell", build_tiny_flux, guidance_embeds=False)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """The tiny model's kernels are microseconds long: a second thread only spins on a shared machine."""
