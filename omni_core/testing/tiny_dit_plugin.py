"""Plugin module registering the test-only tiny DiT (``OmniTinyDiTPipeline``, model name ``tiny-dit``).

The ``tiny_dit_model`` fixture installs it for the test session as a real entry point (a ``.dist-info`` folder
on ``sys.path`` and ``PYTHONPATH``), so every plugin manager -- including fresh ones that fixtures create, and
those of spawned workers and ``omni`` subprocesses -- finds it like any installed plugin.

Where the ``omni-attention-sdpa`` plugin is not installed (a cache plugin tested alone), it also registers the
portable ``TESTING_REFERENCE`` kernel from :mod:`omni_core.testing.reference_backend`, which the platform's default
then picks from its record, so the model's attention runs with only the core installed. Imports nothing heavy.
"""

from __future__ import annotations

import importlib.util

from omni_core import hookimpl
from omni_core.plugins.types import AttentionBackendSpec, PipelineSpec
from omni_core.sampling_fields import SamplingField

#: the tiny DiT's own sampling knob, declared as a third-party model declares one (no core edit): on the record
#: below and on ``TinyDiTPipeline.sampling_fields``. The transformer takes one scale per call, hence splits_batch.
CONTEXT_SCALE = SamplingField(name="context_scale", type="float", default=1.0, min=0.0, max=4.0, splits_batch=True,
                              help="tiny DiT: scale of the text context its blocks attend to")
SAMPLING_FIELDS = (CONTEXT_SCALE,)

#: the distribution name of the session-installed entry point
DIST_NAME = "omni-testing-tiny-dit"
#: the stand-in attention kernel's name (registered only where omni-attention-sdpa is not installed)
REFERENCE_BACKEND = "TESTING_REFERENCE"
ENTRY_POINT = "testing-tiny-dit"


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="OmniTinyDiTPipeline", impl="omni_core.testing.tiny_dit:TinyDiTPipeline", model_names=("tiny-dit",),
        default_model_path="omni_core.testing.tiny_dit_plugin:default_model_path", requires=("torch", "diffusers"),
        supported_parallel=("ulysses", "ring", "cfg"),
        description="test-only tiny DiT (random weights, 16x16 RGB) from omni_core.testing",
        sampling_fields=SAMPLING_FIELDS)]


def _sdpa_plugin_installed() -> bool:
    try:
        return importlib.util.find_spec("omni_attention_sdpa") is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (as a test does)
        return False


@hookimpl
def omni_register_attention_backends():
    if _sdpa_plugin_installed():
        return []
    return [AttentionBackendSpec(name=REFERENCE_BACKEND, impl="omni_core.testing.reference_backend:ReferenceBackend",
                                 requires=("torch",), portable=True, default_priority=-1,
                                 description="test-only stand-in for omni-attention-sdpa (torch SDPA, masks)")]


def default_model_path() -> str:
    """The session's tiny DiT folder (set by the fixture in ``OMNI_TINY_DIT_PATH``)."""
    import os

    return os.environ.get("OMNI_TINY_DIT_PATH", "")
