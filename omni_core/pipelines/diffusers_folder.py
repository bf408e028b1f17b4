"""Helpers for pipelines that load a diffusers-format folder with diffusers/transformers classes.

Shared by the first-party model plugins and available to third-party ones; imports nothing heavy.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omni_core.errors import ConfigError

#: libraries whose component classes a folder may name (anything else would mean remote code)
ALLOWED_LIBRARIES = ("diffusers", "transformers")


def read_json(path: str | None) -> dict | None:
    """The JSON file at ``path``, or None when there is none."""
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_model_index(model_path: str, class_name: str, allowed: tuple[str, ...] = ALLOWED_LIBRARIES) -> dict:
    """The folder's model_index.json, refusing other pipelines and components from other libraries."""
    index = read_json(os.path.join(model_path, "model_index.json"))
    if index is None:
        raise ConfigError(f"{model_path!r} has no model_index.json (a diffusers-format folder is expected)",
                          field="model")
    if index.get("_class_name") != class_name:
        raise ConfigError(f"{model_path!r} holds a {index.get('_class_name')!r}, not a {class_name}", field="model")
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        if value[0] not in allowed:
            raise ConfigError(f"component {name!r} of {model_path!r} comes from library {value[0]!r}; only "
                              f"{', '.join(allowed)} components are loaded (no remote code)", field="model")
    return index


def dtype_kwarg(dtype: Any) -> dict:
    """``dtype=`` for diffusers >= 0.42 (``torch_dtype`` is deprecated there), ``torch_dtype=`` before."""
    import diffusers
    from packaging.version import Version

    return {"dtype" if Version(diffusers.__version__).release >= (0, 42) else "torch_dtype": dtype}
