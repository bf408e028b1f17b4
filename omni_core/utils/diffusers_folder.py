"""Helpers for pipelines that load a diffusers-format folder with diffusers/transformers classes.

Shared by the first-party model plugins and available to third-party ones; imports nothing heavy.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omni_core.errors import ConfigError

#: libraries whose component classes a folder may name (besides diffusers' own pipeline modules: see
#: :func:`library_module`; anything else would mean remote code)
ALLOWED_LIBRARIES = ("diffusers", "transformers")


def library_module(library: Any, allowed: tuple[str, ...] = ALLOWED_LIBRARIES) -> str | None:
    """The module a ``model_index.json`` library name loads its class from, as diffusers' loader resolves it: an
    allowed library as named; a diffusers pipeline's own subpackage as ``diffusers.pipelines.<name>`` (diffusers
    records a class defined there by the subpackage's name: LTX-2's ``connectors`` and ``vocoder`` say ``"ltx2"``);
    None for anything else (remote code). Looks at the installed diffusers' files, importing nothing."""
    import importlib.util

    if library in allowed:
        return library
    if not isinstance(library, str) or not library.isidentifier() or "diffusers" not in allowed:
        return None
    spec = importlib.util.find_spec("diffusers")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(root, "pipelines", library, "__init__.py")):
            return f"diffusers.pipelines.{library}"
    return None


def read_json(path: str | None) -> dict | None:
    """The JSON object in the file at ``path``, or None when there is no file.

    A file that is not JSON, or holds something other than an object, is a ConfigError naming the file:
    a raw ``JSONDecodeError`` (or an ``AttributeError`` later, on ``.get``) would not say which file is bad.
    """
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path!r} is not valid JSON ({exc}); a diffusers folder's JSON files hold one object",
                          field="model") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{path!r} holds a JSON {type(value).__name__}, not an object; a diffusers folder's "
                          f"JSON files hold one object", field="model")
    return value


def read_model_index(model_path: str) -> dict | None:
    """The folder's ``model_index.json`` as a dict, None without one; ConfigError naming the file if it is
    not a JSON object."""
    return read_json(os.path.join(model_path, "model_index.json"))


def check_model_index(model_path: str, class_name: str, allowed: tuple[str, ...] = ALLOWED_LIBRARIES) -> dict:
    """The folder's model_index.json, refusing other pipelines and components from other libraries."""
    index = read_model_index(model_path)
    if index is None:
        raise ConfigError(f"{model_path!r} has no model_index.json (a diffusers-format folder is expected)",
                          field="model")
    if index.get("_class_name") != class_name:
        raise ConfigError(f"{model_path!r} holds a {index.get('_class_name')!r}, not a {class_name}", field="model")
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        if library_module(value[0], allowed) is None:
            raise ConfigError(f"component {name!r} of {model_path!r} comes from library {value[0]!r}; only "
                              f"{', '.join(allowed)} components (and diffusers' own pipeline modules) are loaded "
                              f"(no remote code)", field="model")
    refuse_pickled_weights(model_path, [n for n, v in index.items() if not n.startswith("_") and isinstance(v, list)])
    return index


#: file endings of pickle-based checkpoints (torch.save, PyTorch Lightning, plain pickle)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def refuse_pickled_weights(model_path: str, components: Any) -> None:
    """Refuse component folders whose weights are only pickles, before any loader opens them.

    Unpickling runs whatever code the file names, so Omni loads weights from safetensors only; a folder with
    both keeps working (the loaders are told ``use_safetensors=True``). Checked here, by file name, so a
    hostile file is never read at all.
    """
    for name in components:
        folder = os.path.join(model_path, name)
        if not os.path.isdir(folder):
            continue
        files = sorted(os.listdir(folder))
        pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
        if pickles and not any(f.endswith(".safetensors") for f in files):
            raise ConfigError(
                f"{os.path.join(folder, pickles[0])!r} is a pickle checkpoint and component {name!r} has no "
                f".safetensors weights; Omni loads weights only from safetensors (unpickling can run arbitrary "
                f"code). Convert it, e.g. save_pretrained(..., safe_serialization=True)", field="model")


def dtype_kwarg(dtype: Any) -> dict:
    """``dtype=`` for diffusers >= 0.42 (``torch_dtype`` is deprecated there), ``torch_dtype=`` before."""
    import diffusers
    from packaging.version import Version

    return {"dtype" if Version(diffusers.__version__).release >= (0, 42) else "torch_dtype": dtype}


def load_diffusers_pipeline(model_path: str) -> Any:
    """diffusers' own pipeline from a folder (safetensors only, progress bar off): the reference that parity
    tests compare an Omni pipeline built on the same folder with."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_path, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


__all__ = ["ALLOWED_LIBRARIES", "PICKLE_SUFFIXES", "check_model_index", "library_module", "dtype_kwarg", "load_diffusers_pipeline",
           "read_json", "read_model_index", "refuse_pickled_weights"]
