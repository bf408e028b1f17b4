"""Session fixtures: the tiny Qwen-Image 2.1 folder, Omni's and diffusers' pipelines loaded from it (``q21_dir``,
``omni_q21``, ``diffusers_q21``); torch at one thread per test (``one_torch_thread``)."""

from __future__ import annotations

import os

import pytest

from omni_core.testing import tiny_model_fixtures
from omni_model_qwen_image21.testing import build_tiny_qwen_image21, diffusers_reference_kwargs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

q21_dir, omni_q21, diffusers_q21 = tiny_model_fixtures("q21", build_tiny_qwen_image21,
                                                       reference_components=diffusers_reference_kwargs)


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    """The tiny model's kernels are microseconds long: a second thread only spins on a shared machine."""


#: library modules the stage processes import to load this model (beyond the core's preload: torch, diffusers and
#: transformers' top levels), imported once by the fork server instead of by each stage process
STAGE_LIBRARIES = ("diffusers.pipelines.qwenimage21.pipeline_qwenimage21",
                   "diffusers.models.transformers.transformer_qwenimage21",
                   "diffusers.models.autoencoders.autoencoder_kl_qwenimage21",
                   "transformers.models.qwen3_vl.modeling_qwen3_vl", "transformers.models.qwen3_vl.processing_qwen3_vl")


@pytest.fixture(scope="session", autouse=True)
def _fork_server_early():
    """Start Omni's fork server (it imports the libraries once, then forks every stage process) at the start of the
    session, with this model's library modules added to its preload, so its imports overlap the in-process tests
    instead of being waited for by the first test that starts a process (the stages apart: 13-15 s with a cold
    server at load 5-7). Stdlib ``multiprocessing.forkserver``: the preload list is read when the server starts;
    an import that fails there is skipped. Does nothing where Omni does not use a fork server."""
    from multiprocessing import forkserver

    from omni_core.processes import PRELOAD_MODULE, start_method

    if start_method() == "forkserver":
        forkserver.set_forkserver_preload([PRELOAD_MODULE, *STAGE_LIBRARIES])
        forkserver.ensure_running()
