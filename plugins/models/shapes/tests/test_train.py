"""Training: deterministic from the seed, writes a folder the pipeline loads (tiny config, a few iterations)."""

from __future__ import annotations

import json
import os

import torch

from omni_model_shapes.testing import TINY_TEXT_ENCODER, TINY_TRANSFORMER
from omni_model_shapes.train import TrainConfig, main, train


def tiny(**kw) -> TrainConfig:
    return TrainConfig(iterations=3, batch_size=4, warmup=1, threads=1, log_every=1,
                       transformer=dict(TINY_TRANSFORMER), text_encoder=dict(TINY_TEXT_ENCODER), **kw)


def test_same_seed_same_weights_other_seed_other_weights():
    logs = []
    a = train(tiny(seed=0), log=logs.append)[2].state_dict()
    b = train(tiny(seed=0), log=lambda m: None)[2].state_dict()
    c = train(tiny(seed=1), log=lambda m: None)[2].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert any("loss" in line for line in logs)


def test_trained_folder_loads_and_generates(tmp_path):
    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline, resolve_model

    out = tmp_path / "model"
    train(tiny(), out=str(out), log=lambda m: None)
    with open(out / "model_index.json") as f:
        assert json.load(f)["_class_name"] == "ShapesPipeline"
    assert json.load(open(out / "training.json"))["config"]["iterations"] == 3
    pipe = load_pipeline(resolve_model(str(out)), OmniDiffusionConfig(model=str(out)), "cpu", torch.float32)
    from omni_core.testing.driver import make_state

    img = pipe.forward([make_state(pipe, "a red circle in the top left", seed=0, num_inference_steps=2)])[0]
    assert img.tensor.shape == (1, 3, 32, 32)


def test_cli_writes_the_folder(tmp_path):
    arch = json.dumps({"transformer": TINY_TRANSFORMER, "text_encoder": TINY_TEXT_ENCODER, "warmup": 1})
    assert main(["--seed", "3", "--out", str(tmp_path / "m"), "--iterations", "2", "--batch-size", "2",
                 "--config", arch]) == 0
    assert os.path.isfile(tmp_path / "m" / "transformer" / "diffusion_pytorch_model.safetensors")
