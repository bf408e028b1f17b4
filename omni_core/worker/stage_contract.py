"""The stage contract (``decode_workers``; :mod:`omni_core.worker.stages` runs the decode process): what each
stage of a pipeline needs, how one side of the split is loaded, and the payload a finished request carries to
the decode stage. Apart from the process machinery so the loader and the runner import it without a cycle."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import attrs

from omni_core.errors import ConfigError

DECODE = "decode"
ENCODE = "encode"
STAGES = (ENCODE, DECODE)


# ---------------------------------------------------------------------------------------------- the contract
def declared_stages(pipeline_cls: type, model_path: str | None) -> dict[str, tuple[str, ...]]:
    """``{stage: component names}`` the pipeline declares (``stage_components``, a dict, or a classmethod
    ``stage_components_for(model_path)``); empty where it declares none."""
    derive = getattr(pipeline_cls, "stage_components_for", None)
    found = derive(model_path) if callable(derive) else getattr(pipeline_cls, "stage_components", None)
    return {k: tuple(v) for k, v in dict(found or {}).items()}


def check_stage_config(config: Any, pipeline_cls: type, model_path: str | None) -> None:
    """Refuse, by field, a ``decode_workers`` that cannot run: before any process starts."""
    if not getattr(config, "decode_workers", 0):
        return
    why = None
    if DECODE not in declared_stages(pipeline_cls, model_path):
        why = (f"pipeline {pipeline_cls.__name__} declares no decode components (stage_components['decode']), so "
               f"its decode cannot be loaded apart")
    elif getattr(pipeline_cls, "image_input", None) is not None:
        why = (f"pipeline {pipeline_cls.__name__} takes input images, which its denoise side encodes with the VAE "
               f"(not split yet)")
    elif config.world_size != 1:
        why = ("several model ranks decode together (the parallel VAE decode splits the VAE across them); a "
               "decode process apart is built for one model process")
    elif getattr(config, "offload", None) not in (None, "none"):
        why = ("offload moves the whole pipeline's components in turn on the model's device; with the decode "
               "apart there is nothing of the VAE left to offload, and its own process would hold it whole")
    elif getattr(config, "executor", None) not in (None, "uni", "mp"):
        why = f"executor {config.executor!r} may run the model on another host; the decode process runs on this one"
    if why is not None:
        raise ConfigError(f"decode_workers={config.decode_workers} cannot run here: {why}. Use decode_workers=0",
                          field="decode_workers")


def config_only_component(model_path: str, name: str, library: str, class_name: str, dtype: Any) -> Any:
    """A stand-in for component ``name`` that holds its folder config and no weights: an instance of a subclass
    of the real class (so diffusers' loader accepts it and the pipeline derives ``vae_scale_factor`` and the
    like from it), with one empty buffer for its dtype and device; config entries read as attributes, as the
    real module sets them in ``__init__`` (``temperal_downsample``)."""
    import importlib

    import torch
    from diffusers.configuration_utils import FrozenDict

    klass = getattr(importlib.import_module(library), class_name)
    config = klass.load_config(model_path, subfolder=name)

    def __getattr__(self: Any, attr: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, attr)
        except AttributeError:
            values = self.__dict__.get("_internal_dict") or {}
            if attr in values:
                return values[attr]
            raise

    stand_in = type(class_name, (klass,), {"__getattr__": __getattr__, "__module__": klass.__module__,
                                           "__qualname__": class_name, "omni_config_only": True})
    obj = stand_in.__new__(stand_in)
    torch.nn.Module.__init__(obj)
    obj.register_to_config(**klass.extract_init_dict(config)[0])
    obj._internal_dict = FrozenDict({**obj._internal_dict, **{k: v for k, v in config.items() if k.startswith("_")}})
    obj.register_buffer("omni_config_only_dtype", torch.empty(0, dtype=dtype))
    return obj


def diffusers_stage_kwargs(model_path: str, stage: str, components: dict[str, tuple[str, ...]], dtype: Any
                           ) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of a diffusers folder for one side of the split: ``"denoise"``
    loads everything but the decode components (config-only stand-ins), ``"decode"`` only them."""
    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    names = {k: tuple(v) for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2
             and v[0] is not None}
    decode = set(components.get(DECODE, ()))
    if stage != DECODE:
        return {n: config_only_component(model_path, n, *names[n], dtype) for n in decode if n in names}
    # the decode side: the other weights stay unread. A diffusers model (a denoiser) becomes a config-only
    # stand-in, since pipelines read their config at construction (Wan: the expert's in_channels); another
    # library's model (a text encoder) is left out; what holds no weights (scheduler, tokenizer) loads as usual
    import importlib

    import torch

    kwargs: dict[str, Any] = {}
    for name, (library, class_name) in names.items():
        if name in decode:
            continue
        klass = getattr(importlib.import_module(library), class_name, None)
        if not (isinstance(klass, type) and issubclass(klass, torch.nn.Module)):
            continue
        kwargs[name] = (config_only_component(model_path, name, library, class_name, dtype)
                        if library == "diffusers" and hasattr(klass, "load_config") else None)
    return kwargs


def model_bytes_of_stage(pipeline: Any) -> dict[str, int]:
    """``stats()["model_bytes"]`` of a split process: its components less the config-only stand-ins."""
    from omni_core.optimize.components import components_of, module_bytes

    return {name: module_bytes(m) for name, m in components_of(pipeline).items()
            if not getattr(m, "omni_config_only", False)}


# ---------------------------------------------------------------------------------------------- the payload
def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@attrs.define
class DecodePayload:
    """What the decode stage needs of a finished request: its final latents, request and plain state fields.
    Rides in ``DiffusionOutput.tensor`` from the model process to the engine (pending decode); ``group`` and
    ``group_size`` keep the requests one ``post_decode_batch`` call decoded together in line together."""

    request: Any
    latents: Any
    step_index: int
    num_steps: int
    extra: dict
    group: str = ""
    group_size: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @classmethod
    def of(cls, state: Any, group: str, group_size: int) -> DecodePayload:
        latents = state.latents.detach().to("cpu") if state.latents is not None else None
        return cls(request=state.request, latents=latents, step_index=state.step_index, num_steps=state.num_steps,
                   extra={k: v for k, v in state.extra.items() if _plain(v)}, group=group, group_size=group_size)

    def state(self, device: Any) -> Any:
        from omni_core.pipelines.state import StepState

        latents = self.latents.to(device) if self.latents is not None else None
        return StepState(request=self.request, latents=latents, step_index=self.step_index,
                         num_steps=self.num_steps, extra=dict(self.extra))


_groups = itertools.count()


def defer_decode(pipeline: Any) -> None:
    """Make ``pipeline``'s decode hand back payloads (both execution modes go through ``post_decode_batch``)."""
    from omni_core.outputs import DiffusionOutput

    def post_decode_batch(states: list) -> list:
        group = f"{os.getpid()}-{next(_groups)}"
        return [DiffusionOutput(request_id=s.request_id, tensor=DecodePayload.of(s, group, len(states)),
                                finished=True, step_index=s.step_index, num_steps=s.num_steps) for s in states]

    pipeline.post_decode_batch = post_decode_batch
    pipeline.post_decode = lambda state: post_decode_batch([state])[0]


def pending_decode(out: Any) -> bool:
    return isinstance(getattr(out, "tensor", None), DecodePayload)


__all__ = ["DECODE", "ENCODE", "STAGES", "DecodePayload", "check_stage_config", "config_only_component",
           "declared_stages", "defer_decode", "diffusers_stage_kwargs", "model_bytes_of_stage", "pending_decode"]
