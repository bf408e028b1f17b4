"""The most one request may ask for (``limits``), checked before any work starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import attrs

from omni_core.config.bounds import MAX_FRAMES, MAX_INFERENCE_STEPS, MAX_OUTPUTS_PER_PROMPT, MAX_SIDE
from omni_core.config.validators import _FromKwargs, coerce_record, int_field
from omni_core.errors import ConfigError

if TYPE_CHECKING:
    from omni_core.config.sampling import SamplingParams


#: RequestLimits field -> (what it bounds, the SamplingParams field an error names, ``omni serve`` flag)
LIMIT_FIELDS = {
    "max_pixels": ("height x width of one output", "size", "--max-pixels"),
    "max_frames": ("num_frames", "num_frames", "--max-frames"),
    "max_steps": ("num_inference_steps", "num_inference_steps", "--max-steps"),
    "max_outputs": ("num_outputs_per_prompt (the server's n)", "num_outputs_per_prompt", "--max-outputs"),
    "max_prompt_chars": ("characters of the prompt and of the negative prompt, each", "prompt", "--max-prompt-chars"),
    "max_image_pixels": ("height x width of each input image (edit and image-to-video models)", "image",
                         "--max-image-pixels"),
}


@attrs.frozen
class RequestLimits(_FromKwargs):
    """The most one request may ask for, so no single request can hold the engine for long.

    ``None`` means "the model's default" (``OmniPipeline.request_limits``); the engine checks every request
    against the resolved limits before any work starts. ``SamplingParams``' own bounds still apply.
    """

    max_pixels: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_SIDE * MAX_SIDE,
                                                                          optional=True))
    max_frames: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_FRAMES, optional=True))
    max_steps: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_INFERENCE_STEPS,
                                                                         optional=True))
    max_outputs: int | None = attrs.field(default=None, validator=int_field(min=1, max=MAX_OUTPUTS_PER_PROMPT,
                                                                           optional=True))
    max_prompt_chars: int | None = attrs.field(default=None, validator=int_field(min=1, optional=True))
    max_image_pixels: int | None = attrs.field(default=None, validator=int_field(min=1, optional=True))

    @classmethod
    def coerce(cls, value: Any) -> RequestLimits:
        return coerce_record(cls, value, field="limits",
                             error="limits must be a dict such as {{'max_steps': 200}} or RequestLimits, got "
                                   "{value!r}; fields: " + ", ".join(LIMIT_FIELDS))

    def resolved(self, defaults: Mapping[str, int]) -> RequestLimits:
        """These limits with every ``None`` replaced by ``defaults`` (which must cover every field)."""
        return attrs.evolve(self, **{name: defaults[name] for name in LIMIT_FIELDS if getattr(self, name) is None})

    def check(self, params: SamplingParams, prompt: str | None = None, negative_prompt: str | None = None,
              *, model: str = "the model") -> None:
        """Refuse a request (complete params) that asks for more than a limit, naming the field and the limit."""
        def refuse(name: str, what: str, field: str | None = None) -> None:
            limit = getattr(self, name)
            raise ConfigError(f"{what} exceeds {name}={limit} for {model}; raise it with "
                              f"limits={{{name!r}: ...}} (omni serve {LIMIT_FIELDS[name][2]})",
                              field=field or LIMIT_FIELDS[name][1])

        if self.max_pixels is not None and params.height is not None and params.width is not None:
            pixels = params.height * params.width
            if pixels > self.max_pixels:
                refuse("max_pixels", f"height x width = {params.height}x{params.width} = {pixels} pixels")
        checks = (("max_frames", "num_frames"), ("max_steps", "num_inference_steps"),
                  ("max_outputs", "num_outputs_per_prompt"))
        for name, field in checks:
            value = getattr(params, field)
            if getattr(self, name) is not None and value is not None and value > getattr(self, name):
                refuse(name, f"{field}={value}")
        for text, field in ((prompt, "prompt"), (negative_prompt, "negative_prompt")):
            if self.max_prompt_chars is not None and text is not None and len(text) > self.max_prompt_chars:
                refuse("max_prompt_chars", f"{field} of {len(text)} characters", field)
