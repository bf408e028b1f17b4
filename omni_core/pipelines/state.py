"""Per-request state that lives across denoising steps (the step-wise protocol's unit of work)."""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.request import OmniDiffusionRequest


@attrs.define(eq=False)
class StepState:
    """Everything one request carries between steps.

    The pipeline owns every field's contents; the runner only reads ``step_index``/``num_steps`` and
    passes the state back. Each request has its own noise ``scheduler`` instance, so requests at
    different steps can share one ``denoise_step`` call.
    """

    request: OmniDiffusionRequest
    #: seeded ``torch.Generator`` of this request (``seed`` from its sampling params)
    generator: Any = None
    latents: Any = None
    timesteps: Any = None
    step_index: int = 0
    num_steps: int = 0
    #: this request's own noise-scheduler instance (e.g. a FlowMatchEulerDiscreteScheduler)
    scheduler: Any = None
    prompt_embeds: Any = None
    prompt_mask: Any = None
    negative_prompt_embeds: Any = None
    negative_prompt_mask: Any = None
    #: per-request state of the cache backend (keyed by branch/expert)
    cache_state: dict = attrs.field(factory=dict)
    #: model-private data
    extra: dict = attrs.field(factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps
