"""What a diffusers pipeline's call accepts, read from its signature and the folder (engine process, no weights).

The engine checks a request before any work, so the diffusers backend turns the call's signature into rules: which
parameters a request may set (``extra_args``, by name and type), which pipelines it cannot serve (inputs a request
cannot carry, audio, no prompt), and which folders it will not load (remote code, classes the installed libraries
lack, pickled weights).
"""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from typing import Any

from omni_core.errors import ConfigError
from omni_core.utils.diffusers_folder import check_model_index, read_model_index

#: call parameters Omni sets itself (from the request's core fields, or as the runner needs them)
OWN_PARAMETERS = frozenset({
    "self", "prompt", "negative_prompt", "height", "width", "num_inference_steps", "guidance_scale", "num_frames",
    "generator", "output_type", "return_dict", "callback_on_step_end", "callback_on_step_end_tensor_inputs",
    "callback", "callback_steps", "image", "num_images_per_prompt", "num_videos_per_prompt", "max_sequence_length",
    "latents", "kwargs"})
#: the scalar kinds a request may set through ``extra_args`` (lists and tensors are not request fields)
SCALARS = {bool: "bool", int: "int", float: "float", str: "str"}


def scalar_kind(parameter: inspect.Parameter) -> str | None:
    """``bool``/``int``/``float``/``str`` when a request may set this call parameter, else None: from its default,
    or from its annotation when the default is None (``Optional[float]``)."""
    default = parameter.default
    if type(default) in SCALARS:
        return SCALARS[type(default)]
    if default is not None:
        return None
    annotation = parameter.annotation
    if isinstance(annotation, str):
        text = annotation.replace("typing.", "").replace(" ", "")
        for kind in ("float", "int", "bool", "str"):
            if text in (kind, f"Optional[{kind}]", f"{kind}|None", f"None|{kind}"):
                return kind
        return None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Optional[float], float | None
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return SCALARS.get(annotation) if isinstance(annotation, type) else None


def check_value(kind: str, value: Any) -> bool:
    """``kind`` "null": a parameter whose default is a list or dict (e.g. Sana's ``complex_human_instruction``),
    which a request may only turn off (None); None is also accepted for every scalar (the pipeline's default)."""
    if value is None:
        return True
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def pipeline_class(model_path: str) -> type:
    """The diffusers class the folder names, after refusing what Omni will not load (components from other
    libraries, i.e. remote code; pickled weights; a class or component class the installed libraries lack)."""
    import diffusers

    index = read_model_index(model_path) or {}
    name = index.get("_class_name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{model_path!r}: model_index.json names no pipeline class (_class_name)", field="model")
    if "custom_pipeline" in index:
        raise ConfigError(f"{model_path!r} asks for a custom pipeline ({index['custom_pipeline']!r}): remote code is "
                          f"never run; use a folder of a pipeline diffusers ships", field="model")
    check_model_index(model_path, name)
    cls = getattr(diffusers, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise ConfigError(f"{model_path!r} needs pipeline class {name!r}, which diffusers {diffusers.__version__} "
                          f"does not have: upgrade diffusers (pip install -U diffusers), or install the model plugin "
                          f"that provides {name}", field="model")
    for component, value in index.items():
        if component.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        library, class_name = value[0], value[1]
        if getattr(importlib.import_module(library), class_name, None) is None:
            version = getattr(importlib.import_module(library), "__version__", "?")
            raise ConfigError(f"component {component!r} of {model_path!r} is a {library} {class_name}, which "
                              f"{library} {version} does not have: upgrade it (pip install -U {library})",
                              field="model")
    return cls


#: call inputs a request cannot carry (beyond the prompt, one input ``image`` and the scalar options): a pipeline
#: that needs one is refused by name rather than failing at its first request
INPUTS_NOT_CARRIED = {"mask_image": "a mask image", "control_image": "a control image",
                      "control_video": "a control video", "image_embeds": "image embeddings (a prior's output)"}
#: an input ``video`` is optional in some text-to-video pipelines (Cosmos 3); these names say it is the input
VIDEO_INPUT_NAMES = ("VideoToVideo", "VideoToWorld", "V2V")
#: call parameters that mark an audio pipeline (Omni serves images and videos)
AUDIO_MARKS = ("audio_length_in_s", "num_waveforms_per_prompt", "audio_end_in_s")


def call_refusal(cls: type) -> str | None:
    """Why the diffusers backend cannot serve pipelines of class ``cls`` (from its call's signature), or None."""
    parameters = inspect.signature(cls.__call__).parameters
    if "prompt" not in parameters:
        return f"{cls.__name__} takes no prompt: the diffusers backend serves text-conditioned pipelines"
    if any(mark in parameters for mark in AUDIO_MARKS):
        return f"{cls.__name__} makes audio: Omni serves images and videos"
    needed = [f"{what} ({name})" for name, what in INPUTS_NOT_CARRIED.items() if name in parameters
              and not (name == "image_embeds" and "image" in parameters)]  # computed from the image when absent
    if "video" in parameters and any(part in cls.__name__ for part in VIDEO_INPUT_NAMES):
        needed.append("an input video (video)")
    if needed:
        return f"{cls.__name__} takes {', '.join(needed)}, which a request cannot carry yet"
    return None


def class_refusal(class_name: str) -> str | None:
    """The record's ``class_refusal``: :func:`call_refusal` of diffusers' class of that name."""
    import diffusers

    try:
        cls = getattr(diffusers, class_name)
    except Exception as exc:  # noqa: BLE001 - a class whose optional dependencies are missing here
        return f"cannot be imported here: {type(exc).__name__}: {exc}"
    if not (inspect.isclass(cls) and issubclass(cls, diffusers.DiffusionPipeline)):
        return "not a DiffusionPipeline"
    return call_refusal(cls)


__all__ = ["OWN_PARAMETERS", "call_refusal", "check_value", "class_refusal", "pipeline_class", "scalar_kind"]
