"""Argument handling shared by ``Omni`` and ``AsyncOmni``."""

from __future__ import annotations

from typing import Any, Mapping

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.errors import ConfigError
from omni_core.request import OmniDiffusionRequest


def build_config(model: str, config: Any) -> OmniDiffusionConfig:
    if not isinstance(model, str):
        raise ConfigError(f"model must be a model name or a folder path (str), got {type(model).__name__}",
                          field="model")
    return OmniDiffusionConfig.from_kwargs(model=model, **config)


def build_sampling_params(sampling_params: Any, kwargs: Mapping[str, Any]) -> SamplingParams:
    if sampling_params is None:
        return SamplingParams.from_kwargs(**kwargs)
    if isinstance(sampling_params, Mapping):
        return SamplingParams.from_kwargs(**{**sampling_params, **kwargs})
    if isinstance(sampling_params, SamplingParams):
        return sampling_params.replace(**kwargs) if kwargs else sampling_params
    raise ConfigError(f"sampling_params must be SamplingParams, a dict or None, got {type(sampling_params).__name__}",
                      field="sampling_params")


def build_requests(prompts: Any, params: SamplingParams, request_id: str | None = None) -> list[OmniDiffusionRequest]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("prompts must be a string, a dict with 'prompt' (and 'negative_prompt'), or a non-empty "
                          "list of those", field="prompts")
    if request_id is not None and len(prompts) > 1:
        raise ConfigError("request_id can only be given for a single prompt", field="request_id")
    return [OmniDiffusionRequest.from_prompt(p, params, request_id) for p in prompts]
