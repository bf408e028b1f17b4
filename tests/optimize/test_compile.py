"""``compile=True``: regional torch.compile of the denoiser's blocks with dynamic shapes. Same images as eager
(within 1e-4), and after at most one recompile at the first change of batch size and one at the first change
of resolution, a step wave going 1 -> 3 -> 2 -> 4 requests does not recompile (torch's own counters)."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.entrypoints.omni import Omni
from omni_core.request import OmniDiffusionRequest

from .conftest import load, run

PROMPTS = ["a red circle in the top left", "a blue square in the center", "a green triangle in the bottom right",
           "a yellow cross in the top right"]


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def wave(omni, n: int, seed0: int = 0, size: int = 32) -> list[torch.Tensor]:
    """``n`` requests submitted together (one step wave of ``n``); their images."""
    reqs = [OmniDiffusionRequest(prompt=PROMPTS[i], sampling_params=SamplingParams(
        seed=seed0 + i, num_inference_steps=2, output_type="pt", height=size, width=size)) for i in range(n)]
    handles = omni.engine.submit(reqs)
    images = []
    for h in handles:
        out = h.result()
        assert out.status == "completed", out.error
        images.append(out.images[0])
    return images


def test_step_waves_do_not_recompile_and_match_eager():
    torch._dynamo.reset()
    with Omni("shapes", compile=True, step_execution=True, max_num_seqs=4, executor="uni") as omni:
        assert omni.engine.executor.runner.pipeline.omni_optimizations["compile"] == "regional"
        after_warmup = unique_graphs()
        assert after_warmup >= 1  # the start-up warm-up compiled
        counts, compiled = [], {}
        for n in (1, 3, 2, 4):
            compiled[n] = wave(omni, n)
            counts.append(unique_graphs())
        wave(omni, 2, size=48)  # a second resolution
        wave(omni, 3, size=64)
        counts.append(unique_graphs())
        assert omni.engine.executor.runner.pipeline.omni_compile.failed is None
    new = [b - a for a, b in zip([after_warmup, *counts], counts)]
    assert sum(new) <= 2, f"graphs added per wave (1, 3, 2, 4, two resolutions): {new}"
    assert new[2] == 0 and new[3] == 0, f"waves of 2 and 4 recompiled: {new}"
    with Omni("shapes", step_execution=True, max_num_seqs=4, executor="uni", warmup=False) as omni:
        eager = wave(omni, 4)
    for a, b in zip(compiled[4], eager):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_compile_failure_falls_back_to_eager_with_the_reason(monkeypatch, caplog):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    monkeypatch.setattr(inductor_config, "force_disable_caches", True)
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/g++",))  # a broken C++ toolchain
    pipe = load("shapes", compile=True)
    with caplog.at_level(logging.WARNING, logger="omni_core.optimize"):
        got, _ = run(pipe, PROMPTS[:1], [7], num_inference_steps=1)
    assert pipe.omni_compile.failed and "running them eagerly" in caplog.text
    monkeypatch.undo()
    ref, _ = run(load("shapes"), PROMPTS[:1], [7], num_inference_steps=1)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
