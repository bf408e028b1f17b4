"""Builders for tests and for the evaluator's baseline: shapes model folders with random weights.

(Request states and step loops for tests come from the core: :mod:`omni_core.testing.driver`.)"""

from __future__ import annotations

import os

import torch

from omni_model_shapes.train import TrainConfig, build_models, make_scheduler, save_model_folder

TINY_TRANSFORMER = dict(patch_size=4, dim=32, num_layers=2, num_heads=2, mlp_ratio=2.0)
TINY_TEXT_ENCODER = dict(dim=32, num_layers=1, num_heads=2, mlp_ratio=2.0)


def shipped_config(model_path: str | None = None) -> TrainConfig:
    """The training configuration recorded next to the shipped weights (``training.json``), else the default."""
    import json

    from omni_model_shapes.weights import model_path as shipped

    path = os.path.join(model_path or shipped(), "training.json")
    cfg = TrainConfig()
    if os.path.isfile(path):
        with open(path) as f:
            for k, v in json.load(f)["config"].items():
                setattr(cfg, k, v)
    return cfg


def build_random_shapes(folder: str | os.PathLike, cfg: TrainConfig | None = None, seed: int = 0,
                        std: float = 0.1) -> str:
    """A model folder whose weights are all random (normal, ``std``; no zero-initialised layers, so the
    output is not trivially constant). ``cfg`` defaults to a tiny architecture."""
    if cfg is None:
        cfg = TrainConfig(transformer=dict(TINY_TRANSFORMER), text_encoder=dict(TINY_TEXT_ENCODER))
    torch.manual_seed(seed)
    tokenizer, text_encoder, transformer = build_models(cfg)
    with torch.no_grad():
        for module in (text_encoder, transformer):
            for p in module.parameters():
                if p.dim() > 1:
                    p.normal_(0, std)
                else:
                    p.normal_(0, std / 4)
    folder = os.fspath(folder)
    save_model_folder(folder, tokenizer, text_encoder, transformer, make_scheduler())
    return folder

