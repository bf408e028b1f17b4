"""Make LoRA adapter files for a model folder with peft, as a user's trainer would (tests and bench/lora.py).

peft's ``add_adapter`` on the folder's denoiser, B drawn at random (peft initialises it to zero: no effect), and
the pipeline class's own ``save_lora_weights``: the file is in diffusers' naming, what diffusers' trainers
write. Imports torch, diffusers and peft.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

#: attention projections every diffusers DiT has
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def make_lora(model_path: str, out_dir: str, *, rank: int = 4, alpha: float | None = None, seed: int = 0,
              std: float = 0.3, targets: Sequence[str] = ATTENTION_TARGETS, component: str = "transformer") -> str:
    """Write a random rank-``rank`` adapter for ``model_path``'s ``component`` into ``out_dir``; returns the
    ``.safetensors`` file. ``std`` is the spread of B (so the adapter visibly changes the output)."""
    import diffusers
    import torch
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    with open(os.path.join(model_path, "model_index.json")) as f:
        index = json.load(f)
    model_cls = getattr(diffusers, index[component][1])
    model = model_cls.from_pretrained(model_path, subfolder=component, use_safetensors=True)
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank,
                                 target_modules=list(targets), init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    layers = get_peft_model_state_dict(model)
    pipe_cls = getattr(diffusers, index["_class_name"])
    os.makedirs(out_dir, exist_ok=True)
    meta = model.peft_config["default"].to_dict()  # keeps lora_alpha (else diffusers reads alpha = rank)
    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}
    if hasattr(pipe_cls, "save_lora_weights"):
        pipe_cls.save_lora_weights(out_dir, **{f"{component}_lora_layers": layers,
                                               f"{component}_lora_adapter_metadata": meta})
    else:  # a family diffusers has no pipeline loader for (HunyuanVideo 1.5): the model's own file
        model.save_lora_adapter(out_dir, weight_name="pytorch_lora_weights.safetensors")
    return os.path.join(out_dir, "pytorch_lora_weights.safetensors")
