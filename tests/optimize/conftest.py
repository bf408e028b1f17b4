"""Session fixtures of the memory/speed option tests: one tiny Qwen-Image folder and helpers that load a
pipeline with options through the real loader and run it (request path, float32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.pipelines import StepState, load_pipeline, resolve_model
from omni_core.request import OmniDiffusionRequest


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("tiny-qwen-image-optimize"))


@pytest.fixture(scope="session")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Wan 2.2 folder: two experts (``transformer`` and ``transformer_2``)."""
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan22-optimize"), two_experts=True)


#: the Qwen-Image requests every option is compared on: two prompts of different lengths, one batch
QWEN_PROMPTS = ["a red fox in the snow", "a cat"]
QWEN_SEEDS = [1, 2]
QWEN_SIZE = dict(height=32, width=32, num_inference_steps=2)


@pytest.fixture(scope="session")
def qwen_plain(qwen_dir):
    """``(pipeline, images, states)`` of the plain float32 tiny Qwen-Image on the shared requests."""
    pipe = load(qwen_dir)
    images, states = run(pipe, QWEN_PROMPTS, QWEN_SEEDS, **QWEN_SIZE)
    return pipe, images, states


def run_qwen(pipeline):
    """Images of ``pipeline`` on the shared Qwen-Image requests."""
    return run(pipeline, QWEN_PROMPTS, QWEN_SEEDS, **QWEN_SIZE)


def load(model: str, **options):
    """The pipeline of ``model`` loaded by ``load_pipeline`` with engine options ``options`` (float32, CPU)."""
    config = OmniDiffusionConfig(model=model, dtype="float32", **options)
    return load_pipeline(resolve_model(model), config, "cpu", torch.float32)


def run(pipeline, prompts: list[str], seeds: list[int], **params) -> tuple[torch.Tensor, list]:
    """Images ``[N, 3, H, W]`` for ``prompts`` in one ``forward`` batch, and the states (final latents)."""
    model_path = getattr(pipeline, "omni_model_path", None)
    states = []
    for prompt, seed in zip(prompts, seeds):
        sp = type(pipeline).check_sampling_params(SamplingParams(seed=seed, output_type="pt", **params), model_path)
        states.append(StepState(request=OmniDiffusionRequest(prompt=prompt, sampling_params=sp),
                                generator=torch.Generator("cpu").manual_seed(seed)))
    with torch.inference_mode():
        outs = pipeline.forward(states)
    return torch.cat([o.tensor for o in outs]), states


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [0, 1]."""
    mse = torch.mean((a.float() - b.float()) ** 2).item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)
