"""The pipeline half of the stage contract (``encode_workers`` / ``decode_workers``): which components each stage
of a pipeline needs, whether a config may run its stages apart, and how one side of the split is loaded
(config-only stand-ins for what the other side holds). The loader and the plan read it; the process half (the
decode payload, the stage processes) is :mod:`omni_core.worker.stage_contract` and :mod:`omni_core.worker.stages`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omni_core.errors import ConfigError
from omni_core.utils.diffusers_folder import library_module


DECODE = "decode"


ENCODE = "encode"


#: the model process's side of a split: everything but the stages that run apart
DENOISE = "denoise"


STAGES = (ENCODE, DECODE)


def stages_apart(config: Any) -> tuple[str, ...]:
    """The stages ``config`` runs in processes of their own (``<stage>_workers``), in pipeline order."""
    return tuple(s for s in STAGES if getattr(config, f"{s}_workers", 0))


def stage_device(config: Any, stage: str) -> str:
    """Where a stage's process runs (``<stage>_device``): "auto" (the model's first device), "cpu", or a device
    index of the platform."""
    where = str(getattr(config, f"{stage}_device", None) or "auto")
    return where.rpartition(":")[2] if ":" in where else where  # "cuda:1" -> "1": the platform's device 1


# ---------------------------------------------------------------------------------------------- the contract
def declared_stages(pipeline_cls: type, model_path: str | None) -> dict[str, tuple[str, ...]]:
    """``{stage: component names}`` the pipeline declares (``stage_components``, a dict, or a classmethod
    ``stage_components_for(model_path)``); empty where it declares none."""
    derive = getattr(pipeline_cls, "stage_components_for", None)
    found = derive(model_path) if callable(derive) else getattr(pipeline_cls, "stage_components", None)
    return {k: tuple(v) for k, v in dict(found or {}).items()}


def check_stage_config(config: Any, pipeline_cls: type, model_path: str | None) -> None:
    """Refuse, by field, a stage split that cannot run: before any process starts."""
    apart = stages_apart(config)
    for stage in STAGES:
        if stage not in apart and stage_device(config, stage) != "auto":
            raise ConfigError(f"{stage}_device={stage_device(config, stage)!r} places the {stage} stage's own "
                              f"process; set {stage}_workers=1 too (or leave {stage}_device 'auto')",
                              field=f"{stage}_device")
    for stage in apart:
        why = _why_not(stage, config, pipeline_cls, model_path)
        if why is not None:
            n = getattr(config, f"{stage}_workers")
            raise ConfigError(f"{stage}_workers={n} cannot run here: {why}. Use {stage}_workers=0",
                              field=f"{stage}_workers")


def _why_not(stage: str, config: Any, pipeline_cls: type, model_path: str | None) -> str | None:
    name = pipeline_cls.__name__
    if stage not in declared_stages(pipeline_cls, model_path):
        return (f"pipeline {name} declares no {stage} components (stage_components[{stage!r}]), so its {stage} "
                f"cannot be loaded apart")
    if stage == ENCODE:
        from omni_core.pipelines.text_window import declares_text_keys

        if not declares_text_keys(pipeline_cls):
            return (f"pipeline {name} has no text keys to encode apart (TextEncodingWindow's text_keys / "
                    f"encode_prompts, or an encoded_prompts window of its own)")
        if getattr(config, "loras", None):
            return "LoRA adapters (loras) may carry text-encoder weights, which the encode process does not load"
        quantized = tuple(getattr(config, "quantize_components", ()) or ())
        if (getattr(config, "quantization", None) not in (None, "none")
                and any(c.startswith("text_encoder") for c in quantized)):
            return "quantize_components names a text encoder, which the encode process loads unquantized"
    # offload with a stage apart, and model ranks with the decode apart, are pairs of features refused as data
    # (omni_core.combinations.REFUSED: encode_apart / decode_apart), checked before this
    return None


def folder_stage_components(model_path: str | None, takes_images: bool = False) -> dict[str, tuple[str, ...]]:
    """``{stage: components}`` of a diffusers folder, from its model_index.json: the ``vae*`` components decode,
    the ``text_encoder*`` / ``tokenizer*`` ones encode; a pipeline that ``takes_images`` keeps its VAE on the denoise
    side too (``"denoise"``: it VAE-encodes them). What every pipeline over a diffusers folder declares."""
    from omni_core.pipelines.diffusers_folder import read_model_index

    index = (read_model_index(model_path) if model_path else None) or {}
    names = [k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None]
    stages = {DECODE: tuple(n for n in names if n.startswith("vae")),
              ENCODE: tuple(n for n in names if n.startswith(("text_encoder", "tokenizer")))}
    if takes_images:
        stages[DENOISE] = stages[DECODE]
    return stages


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
    obj.__dict__.update(_init_attributes(klass, config))
    return obj


def _init_attributes(klass: Any, config: dict) -> dict[str, Any]:
    """The plain values (numbers, strings, tuples) that ``klass.__init__`` sets outside its config -- LTX-2's VAEs
    derive ``spatial_compression_ratio`` / ``temporal_compression_ratio``, which its pipeline reads on every side of
    the split -- from an instance built on the meta device (no weight is allocated); {} if it cannot be built
    there."""
    import torch

    try:
        with torch.device("meta"):
            real = klass.from_config(config)
    except Exception:  # noqa: BLE001 - a class that insists on real tensors in __init__: its config is all we have
        return {}
    plain = (bool, int, float, str, tuple, type(None))
    return {k: v for k, v in vars(real).items() if not k.startswith("_") and k != "training" and isinstance(v, plain)}


def diffusers_stage_kwargs(model_path: str, stage: str, components: dict[str, tuple[str, ...]], dtype: Any,
                           apart: tuple[str, ...] = (DECODE,)) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of a diffusers folder for one side of the split: ``"denoise"`` loads
    everything but the components of the stages ``apart``, ``"encode"`` / ``"decode"`` only that stage's.

    What is not loaded: a diffusers model (a denoiser, a VAE) becomes a config-only stand-in, since pipelines read
    their config at construction (Wan: the expert's in_channels, the VAE's scale factors); another library's model
    (a text encoder) is left out (None); what holds no weights (scheduler, tokenizer) loads as usual."""
    import importlib

    import torch

    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    names = {k: tuple(v) for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and len(v) == 2
             and v[0] is not None}
    if stage == DENOISE:  # what the denoise side needs as well ("denoise": an image model's VAE) stays
        skip = {n for s in apart for n in components.get(s, ())} - set(components.get(DENOISE, ()))
    else:
        skip = set(names) - set(components.get(stage, ()))
    kwargs: dict[str, Any] = {}
    for name in sorted(skip & set(names)):
        library, class_name = names[name]
        module = library_module(library)
        klass = getattr(importlib.import_module(module), class_name, None) if module else None
        if not (isinstance(klass, type) and issubclass(klass, torch.nn.Module)):
            continue
        kwargs[name] = (config_only_component(model_path, name, module, class_name, dtype)
                        if module.startswith("diffusers") and hasattr(klass, "load_config") else None)
    return kwargs


def drop_stage_components(pipeline: Any, names: Any) -> list[str]:
    """Set the model components ``names`` of a pipeline loaded whole to None (the model process of a pipeline
    without ``stage_load_kwargs``, e.g. ``shapes``: its text encoder lives in the encode process). Returns the
    names dropped."""
    import torch

    dropped = []
    for name in names:
        if isinstance(getattr(pipeline, name, None), torch.nn.Module):
            setattr(pipeline, name, None)
            dropped.append(name)
    return dropped


__all__ = ["DECODE", "DENOISE", "ENCODE", "STAGES", "check_stage_config", "config_only_component", "declared_stages",
           "diffusers_stage_kwargs", "drop_stage_components", "folder_stage_components", "stage_device",
           "stages_apart"]
