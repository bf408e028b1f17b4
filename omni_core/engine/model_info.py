"""What the engine tells front ends about the served model, and the progress callback type.

Its own module (below both ``engine.py`` and ``client.py``) so the engine does not import the client interface
that lazily imports the engine (``start_engine``): no import cycle.
"""

from __future__ import annotations

from typing import Callable

import attrs

#: ``on_progress(request_id, step, num_steps)``, called from the engine's thread after every denoising step
ProgressFn = Callable[[str, int, int], None]


@attrs.frozen
class ModelInfo:
    """What a front end needs to know about the served model (fixed for the engine's lifetime)."""

    #: the ``model`` the engine was started with (a short name or a folder)
    model: str
    #: the pipeline's registered name (e.g. ``MyModelPipeline``)
    pipeline: str
    #: the distribution that registered the pipeline
    provider: str
    #: the model folder the engine loaded
    model_path: str
    is_video: bool
    #: ``num_frames - 1`` must be a multiple of this (video models)
    frame_multiple: int
    #: height and width must be multiples of this
    size_multiple: int
    #: the engine streams an intermediate output (a preview) after every denoising step
    streaming: bool
    #: the pipeline's own sampling knobs (``SamplingField`` records from its ``PipelineSpec``): the request fields
    #: the served model takes beyond the core's
    sampling_fields: tuple = ()
    #: the input images a request carries (``omni_core.images.ImageInput``), or None: the model takes none
    image_input: object = None
    #: the sampling field that is the video's frame rate (``PipelineSpec.fps_field``), or None
    fps_field: str | None = None


__all__ = ["ModelInfo", "ProgressFn"]
