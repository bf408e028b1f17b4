"""The shapes pipeline's classifier-free guidance formula on fixed predictions, and its loader's refusal of
pickled weights and of a model_index.json that is not a JSON object."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from omni_core.errors import ConfigError
from omni_model_shapes.pipeline import ShapesPipeline
from omni_core.testing.driver import make_state
from omni_model_shapes.weights import model_path

PROMPT = "a red circle in the top left"


def test_cfg_combines_fixed_predictions_as_uncond_plus_scale_times_difference(shapes_pipeline, monkeypatch):
    """With the denoiser's outputs replaced by known tensors, each guided state gets exactly
    ``vu + g * (vc - vu)`` with its own ``g``; an unguided state gets ``vc`` and no unconditional call."""
    p = shapes_pipeline
    scales = [5.0, 1.0, 2.5]  # guided, unguided, guided with another scale
    states = [p.prepare_encode(make_state(p, PROMPT, seed=i, guidance_scale=g, num_inference_steps=3))
              for i, g in enumerate(scales)]
    g = torch.Generator().manual_seed(0)
    fixed = {(id(s), b): torch.randn(s.latents.shape, generator=g) for s in states for b in ("cond", "uncond")}
    seen = []

    def denoiser(segments):
        seen.extend((states.index(s), b) for s, b in segments)
        return [fixed[(id(s), b)].clone() for s, b in segments]

    monkeypatch.setattr(p, "_run", denoiser)
    preds = p.denoise_step(states)
    assert sorted(seen) == [(0, "cond"), (0, "uncond"), (1, "cond"), (2, "cond"), (2, "uncond")]
    for s, scale, pred in zip(states, scales, preds):
        vc, vu = fixed[(id(s), "cond")], fixed[(id(s), "uncond")]
        expected = vu + scale * (vc - vu) if scale > 1.0 else vc
        torch.testing.assert_close(pred, expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- loading
@pytest.fixture
def shapes_copy(tmp_path) -> str:
    folder = tmp_path / "shapes"
    shutil.copytree(model_path(), folder, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return str(folder)


class _RunsCodeWhenUnpickled:
    """Unpickling this writes a marker file: the probe shows whether a loader ever unpickles the weights."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_pickle_weights_are_refused_before_unpickling(shapes_copy, tmp_path, monkeypatch, component):
    marker = str(tmp_path / "unpickled.txt")
    weights = os.path.join(shapes_copy, component, "diffusion_pytorch_model.safetensors")
    os.remove(weights)
    pickle_path = os.path.join(shapes_copy, component, "diffusion_pytorch_model.bin")
    torch.save({"weight": _RunsCodeWhenUnpickled(marker)}, pickle_path)

    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    with pytest.raises(ConfigError, match=r"diffusion_pytorch_model\.bin.*pickle.*safetensors") as info:
        ShapesPipeline.load(shapes_copy)
    assert pickle_path in str(info.value) and info.value.field == "model"
    assert loads == [] and not os.path.exists(marker)

    # the probe is a real one: unpickling the file does run its code
    monkeypatch.undo()
    torch.load(pickle_path, weights_only=False)
    assert open(marker).read() == "unpickled"


def test_pickle_next_to_safetensors_is_ignored(shapes_copy):
    """A stray .bin beside the safetensors weights does not block loading (the safetensors file is used)."""
    torch.save({"weight": torch.zeros(1)}, os.path.join(shapes_copy, "transformer", "diffusion_pytorch_model.bin"))
    p = ShapesPipeline.load(shapes_copy)
    assert p.transformer.config.num_heads > 0


@pytest.mark.parametrize("content, what", [("{not json", "not valid JSON"), ("[1, 2]", "JSON list, not an object")])
def test_model_index_that_is_not_a_json_object_names_the_file(shapes_copy, content, what):
    index = os.path.join(shapes_copy, "model_index.json")
    with open(index, "w") as f:
        f.write(content)
    with pytest.raises(ConfigError, match=what) as info:
        ShapesPipeline.load(shapes_copy)
    assert index in str(info.value)
    with open(os.path.join(shapes_copy, "transformer", "config.json"), "w") as f:
        f.write("{")
    with pytest.raises(ConfigError, match="config.json"):
        ShapesPipeline.check_parallel_config(None, shapes_copy)
