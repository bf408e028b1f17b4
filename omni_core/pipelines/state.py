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
    #: this request's texts encoded by the window it started in (``TextEncodingWindow``: the wave's batched
    #: encoding, the embedding cache, or the encode stage's), by text key; ``prepare_encode`` reads them
    text_encodings: dict = attrs.field(factory=dict)
    #: per-request state of module hooks, cache backends included (``omni_core.hooks.request_state``), by key
    hook_state: dict = attrs.field(factory=dict)
    #: model-private data
    extra: dict = attrs.field(factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cache_state(self) -> dict:
        """The older name of :attr:`hook_state` (cache backends kept a store of their own; there is one now)."""
        return self.hook_state

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


def remember_flow_step(state: StepState, sample: Any, sigma: Any, velocity: Any) -> None:
    """Keep the inputs of a flow-matching step (references to tensors that exist anyway, no work) so that
    :func:`flow_clean_estimate` can compute the clean image only for a preview somebody streams. Computing it
    every step cost three tensor ops per request and step whether or not anyone looked (issue #14)."""
    state.extra["flow_step"] = (sample, sigma, velocity)


def flow_clean_estimate(state: StepState) -> Any:
    """The current clean estimate ``sample - sigma * velocity`` of the step :func:`remember_flow_step` kept (at the
    last step, the final image up to rounding), in float32; None before the first step."""
    step = state.extra.get("flow_step")
    if step is None:
        return None
    sample, sigma, velocity = step
    return sample.float() - sigma * velocity
