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


def start_models(model: Any, models: Any, residency: Any, config: dict) -> tuple[Any, dict[str, Any]]:
    """What ``Omni`` and ``AsyncOmni`` serve: one model (``model`` and its engine options), or several
    (``models``: a list of names / ``NAME=MODEL`` / entry dicts, or a mapping name -> model or entry, sharing
    ``config`` as common engine options, within ``residency``: ``omni_core.config.fleet``). Returns the fleet (None
    for one model) and name -> engine client, the first being the default."""
    from omni_core.engine.client import start_engine, start_fleet

    if models is None:
        if residency is not None:
            raise ConfigError("residency applies to several models: give models=[...]", field="residency")
        engine = start_engine(build_config(model, config))
        return None, {model: engine}
    if model is not None:
        raise ConfigError("give one model, or several as models=[...], not both", field="models")
    from omni_core.config.fleet import FleetConfig

    fleet = start_fleet(FleetConfig.from_specs(models, residency, common=config))
    return fleet, fleet.members()


def engine_for(engines: Mapping[str, Any], model: str | None) -> Any:
    """The engine client of the model a call names (None: the first); an unknown name names the served ones."""
    if model is None:
        return next(iter(engines.values()))
    try:
        return engines[model]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown model {model!r}; served: {', '.join(engines)}", field="model") from None


def build_sampling_params(sampling_params: Any, kwargs: Mapping[str, Any]) -> SamplingParams:
    if sampling_params is None:
        return SamplingParams.from_kwargs(**kwargs)
    if isinstance(sampling_params, Mapping):
        return SamplingParams.from_kwargs(**{**sampling_params, **kwargs})
    if isinstance(sampling_params, SamplingParams):
        return sampling_params.replace(**kwargs) if kwargs else sampling_params
    raise ConfigError(f"sampling_params must be SamplingParams, a dict or None, got {type(sampling_params).__name__}",
                      field="sampling_params")


def build_sampling_params_list(sampling_params: Any, kwargs: Mapping[str, Any], num_prompts: int
                                ) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: ``sampling_params`` is one for all (SamplingParams, a dict or None), or,
    as in vLLM, a list or tuple of those with one entry per prompt. Keyword arguments apply to every prompt."""
    if not isinstance(sampling_params, (list, tuple)):
        return [build_sampling_params(sampling_params, kwargs)] * num_prompts
    if len(sampling_params) != num_prompts:
        raise ConfigError(f"sampling_params is a list of {len(sampling_params)}, but there "
                          f"{'is 1 prompt' if num_prompts == 1 else f'are {num_prompts} prompts'}: give one "
                          f"SamplingParams (or dict) per prompt, or a single one for all", field="sampling_params")
    out = []
    for i, params in enumerate(sampling_params):
        if isinstance(params, (list, tuple)):
            raise ConfigError(f"sampling_params[{i}] is a {type(params).__name__}; each entry must be "
                              f"SamplingParams, a dict or None", field="sampling_params")
        try:
            out.append(build_sampling_params(params, kwargs))
        except ConfigError as exc:
            if exc.field != "sampling_params":
                raise
            raise ConfigError(f"sampling_params[{i}]: {exc}", field="sampling_params") from None
    return out


def as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("prompts must be a string, a dict with 'prompt' (and 'negative_prompt'), or a non-empty "
                          "list of those", field="prompts")
    return list(prompts)


def build_requests(prompts: Any, params: SamplingParams | list[SamplingParams], request_id: str | None = None
                   ) -> list[OmniDiffusionRequest]:
    """Requests for ``prompts``; ``params`` is one SamplingParams for all, or a list with one per prompt."""
    prompts = as_prompt_list(prompts)
    if request_id is not None and len(prompts) > 1:
        raise ConfigError("request_id can only be given for a single prompt", field="request_id")
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ConfigError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts; give one per prompt",
                          field="sampling_params")
    return [OmniDiffusionRequest.from_prompt(p, sp, request_id) for p, sp in zip(prompts, per_prompt)]
