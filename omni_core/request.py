"""The request the engine schedules: one prompt (and negative prompt) with its sampling parameters."""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def check_prompt(prompt: Any, negative_prompt: Any = None) -> None:
    """Refuse a prompt that is not a string or is empty / whitespace only (the engine and the server both
    call this, so the Python API and HTTP refuse the same prompts with the same words). An empty negative
    prompt is fine: it means "unconditional"."""
    if not isinstance(prompt, str):
        raise ConfigError(f"prompt must be a string or a dict with 'prompt', got {type(prompt).__name__}",
                          field="prompt")
    if not prompt.strip():
        raise ConfigError(f"prompt must not be empty or whitespace only, got {prompt!r}", field="prompt")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise ConfigError(f"negative_prompt must be a string, got {type(negative_prompt).__name__}",
                          field="negative_prompt")


def preview_steps(count: int, num_steps: int) -> frozenset[int]:
    """The steps (1-based) after which ``count`` previews are taken: spread evenly over the ``num_steps`` steps, the
    final image coming after the last step. Fewer when there are fewer steps than previews (OpenAI's documentation
    allows the final image before every partial image)."""
    if count <= 0 or num_steps <= 0:
        return frozenset()
    if num_steps <= count:
        return frozenset(range(1, num_steps + (1 if num_steps == 1 else 0)))
    return frozenset(min(num_steps - 1, max(1, int((i + 1) * num_steps / (count + 1) + 0.5))) for i in range(count))


@attrs.define(eq=False)
class OmniDiffusionRequest:
    """One generation request. ``sampling_params`` is complete (model defaults filled in) once pre-processed."""

    prompt: str
    sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    negative_prompt: str | None = None
    request_id: str = attrs.field(factory=new_request_id)
    arrival_time: float = attrs.field(factory=time.monotonic)
    #: free-form data from pre-processing, passed to the pipeline (e.g. an input image)
    extra: dict = attrs.field(factory=dict)
    #: with a streaming engine, whether this request's caller reads its per-step previews; False skips the
    #: preview work and the intermediate outputs (a non-streamed HTTP request still gets progress callbacks)
    stream_previews: bool = True
    #: how many previews to compute, spread over the steps (:func:`preview_steps`: OpenAI's ``partial_images``);
    #: None: one after every step. A preview costs a projection of the step's clean estimate, so the runner
    #: computes only the ones somebody reads
    preview_count: int | None = None
    #: input images (edit and image-to-video models): PIL images as given, then (once the engine has checked
    #: them, ``omni_core.images``) RGB ``uint8`` tensors ``[3, H, W]``, which is what a pipeline receives
    images: list = attrs.field(factory=list)
    #: what besides the sampling params decides batch compatibility (the pipeline's, set by the engine)
    batch_extra: tuple = ()
    #: the text encodings the encode stage computed (``encode_workers``), by the pipeline's text key: the model
    #: process reads them instead of running a text encoder (``omni_core.worker.stages``). None: encoded there
    text_encodings: dict | None = None

    def wants_preview(self, step_index: int, num_steps: int) -> bool:
        """Whether the preview after step ``step_index`` (1-based) of ``num_steps`` is read (streaming aside)."""
        return self.preview_count is None or step_index in preview_steps(self.preview_count, num_steps)

    @property
    def seed(self) -> int:
        seed = self.sampling_params.seed
        assert seed is not None, "the engine assigns a seed to every request before scheduling it"
        return seed

    @classmethod
    def from_prompt(cls, prompt: Any, sampling_params: SamplingParams, request_id: str | None = None
                    ) -> OmniDiffusionRequest:
        """A prompt is a string or a dict with ``prompt`` and optionally ``negative_prompt`` and ``image`` (a PIL
        image or a list of them; vLLM-Omni's ``{"multi_modal_data": {"image": ...}}`` spelling works too)."""
        from omni_core.images import as_image_list

        negative, images = None, []
        if isinstance(prompt, dict):
            unknown = set(prompt) - PROMPT_KEYS
            if unknown:
                raise ConfigError(f"prompt dict has unknown keys {sorted(unknown)}; allowed: "
                                  f"{', '.join(sorted(PROMPT_KEYS))}", field="prompt")
            negative = prompt.get("negative_prompt")
            images = as_image_list(prompt.get("image"))
            mm = prompt.get("multi_modal_data")
            if mm is not None:
                if not isinstance(mm, dict) or set(mm) - {"image"}:
                    raise ConfigError(f"multi_modal_data must be a dict with 'image' (the only modality a diffusion "
                                      f"model takes here), got {mm!r:.80}", field="multi_modal_data")
                if images and mm.get("image") is not None:
                    raise ConfigError("give the input images once: 'image' or multi_modal_data['image'], not both",
                                      field="image")
                images = images or as_image_list(mm.get("image"), field="multi_modal_data.image")
            prompt = prompt.get("prompt")
        check_prompt(prompt, negative)
        kwargs = {"request_id": request_id} if request_id else {}
        return cls(prompt=prompt, negative_prompt=negative, sampling_params=sampling_params, images=images, **kwargs)


#: keys a prompt dict may have
PROMPT_KEYS = frozenset({"prompt", "negative_prompt", "image", "multi_modal_data"})
