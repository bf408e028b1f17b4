"""What the engine returns: raw ``DiffusionOutput`` from the runner, post-processed for the caller."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define(eq=False)
class DiffusionOutput:
    """One request's result (``finished``) or an intermediate chunk (a streaming preview).

    Raw outputs from the pipeline carry ``tensor``: images ``[n, 3, H, W]`` or videos
    ``[n, frames, 3, H, W]``, float in ``[0, 1]``. Post-processing fills ``images`` (PIL images; for
    video, one list of PIL frames per output) according to the request's ``output_type``.
    """

    request_id: str
    tensor: Any = None
    images: list | None = None
    #: a small RGB preview ``[3, h, w]`` in [0, 1] for intermediate chunks (streaming)
    preview: Any = None
    finished: bool = True
    step_index: int = 0
    num_steps: int = 0
    #: "completed", "aborted" or "error" when finished
    status: str = "completed"
    error: str | None = None
    metrics: dict = attrs.field(factory=dict)
    #: what a request that asked for a rollout gets back (``omni_core.pipelines.rollout.rollout_output``: per-sample
    #: log-probabilities per chosen step, timesteps, sigmas, optionally the trajectory); None otherwise
    rollout: dict | None = None
    #: a video's sound track, for models that make one (LTX-2): float ``[n, channels, samples]`` in [-1, 1], one
    #: per output, at ``audio_sample_rate`` Hz; ``omni generate`` and ``/v1/videos`` mux it into the MP4
    audio: Any = None
    audio_sample_rate: int | None = None

    @property
    def frames(self) -> list | None:
        """Alias of ``images`` for video outputs."""
        return self.images

    @property
    def aborted(self) -> bool:
        return self.status == "aborted"


#: the name users see from ``Omni.generate``
OmniRequestOutput = DiffusionOutput
