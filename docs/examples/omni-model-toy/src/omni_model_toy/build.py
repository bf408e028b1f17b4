"""Write a toy model folder (diffusers layout, random weights in safetensors) and find the default one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def build(path: str | os.PathLike, seed: int = 0) -> str:
    """Save random-weight components (seeded, so every build is the same) into the folder ``path``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from omni_model_toy.model import ToyDiT, ToyTextEncoder

    path = Path(path)
    torch.manual_seed(seed)
    ToyDiT().save_pretrained(path / "transformer", safe_serialization=True)
    ToyTextEncoder().save_pretrained(path / "text_encoder", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(path / "scheduler")
    index = {"_class_name": "ToyPipeline", "transformer": ["omni_model_toy.model", "ToyDiT"],
             "text_encoder": ["omni_model_toy.model", "ToyTextEncoder"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return str(path)


def default_model_path() -> str:
    """The folder behind ``Omni("toy")``: built once under ``$OMNI_TOY_HOME`` (default ``~/.cache/omni-model-toy``).
    Built in a temporary folder and renamed, so concurrent first uses never see half a folder."""
    home = Path(os.environ.get("OMNI_TOY_HOME") or Path.home() / ".cache" / "omni-model-toy")
    target = home / "v1"
    if not (target / "model_index.json").exists():
        home.mkdir(parents=True, exist_ok=True)
        tmp = build(tempfile.mkdtemp(dir=home))
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            pass
    return str(target)
