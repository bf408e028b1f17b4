"""Checking a request on its way in, once: the model's sampling rules, the request limits, input images, the
LoRA it names, and a seed when it has none.

``Omni.generate`` checks (``prepare_request``) before it builds the engine's view of a request and the engine's
``submit`` must not check again: the checker remembers what it gave each request (the very params and image list)
and checks again only what the caller replaced since.
"""

from __future__ import annotations

import secrets
import weakref
from typing import Any

from omni_core.request import OmniDiffusionRequest, check_prompt


class RequestChecker:
    """The checks of one engine's plan (its pipeline class, limits, config)."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        #: requests :meth:`prepare` checked, with the params and images it gave them
        self._prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prepare(self, request: OmniDiffusionRequest, images: bool = True) -> OmniDiffusionRequest:
        """Validate and complete ``request`` (model defaults, a seed); ``images``: check and convert its images."""
        plan = self.plan
        cls, model_path = plan.pipeline_cls, plan.resolved.model_path
        check_prompt(request.prompt, request.negative_prompt)
        params = cls.check_sampling_params(request.sampling_params, model_path)
        plan.limits.check(params, request.prompt, request.negative_prompt, model=cls.__name__)
        if images:
            cls.check_images(request, plan.limits)
        if params.lora is not None:  # the adapter exists, is a LoRA for this model, within max_lora_rank
            from omni_core.lora import check_request_lora

            check_request_lora(params, plan.config, cls, model_path)
        if params.seed is None:
            params = params.replace(seed=secrets.randbits(63))
        request.sampling_params = params
        self._prepared[request] = (params, request.images)
        return request

    def checked(self, request: OmniDiffusionRequest) -> OmniDiffusionRequest:
        """``request`` validated once: what :meth:`prepare` checked and the caller left as it was is not checked
        again."""
        params, images = self._prepared.get(request, (None, None))
        if params is request.sampling_params and images is request.images:
            return request
        return self.prepare(request, images=images is not request.images)  # images: checked and converted once


__all__ = ["RequestChecker"]
