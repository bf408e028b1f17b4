"""Ulysses-2, Ring-2, CFG-parallel-2 and tensor-parallel-2 (two gloo processes) give what one process gives, by the
spec's ``sp_plan`` / ``tp_plan`` alone. One ``spawn_workers`` job runs every layout in turn (the parallel state set
up, the folder loaded through the real loader, the wave run, the state torn down), so the two processes start once.

Requests: two guided prompts of different lengths in one wave (one with ByT5 glyph text: the condition tokens of the
joint attention differ per row and are masked) and an unguided 12x12x9 request whose 3 x 3 x 3 = 27 video tokens do
not divide by two (the plan pads and strips)."""

from __future__ import annotations

import pytest
import torch

#: one worker under ``pytest -n``: the module's two-rank job runs once for its four cases, not once per worker
pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("hunyuan-video15-parallel")]

LAYOUTS = {"ulysses2": {"ulysses_degree": 2}, "ring2": {"ring_degree": 2}, "cfg2": {"cfg_parallel_size": 2},
           "tp2": {"tensor_parallel_size": 2}}
REQUESTS = [
    ("a red fox jumping over a lazy dog", {"seed": 1, "negative_prompt": "blurry", "guidance_scale": 4.0}),
    ('a neon sign that reads "OPEN"', {"seed": 2, "negative_prompt": "low quality, watermark", "guidance_scale": 3.0}),
]
ODD = ("a cat", {"seed": 3, "guidance_scale": 1.0, "height": 12, "width": 12, "num_frames": 9})
SAMPLING = {"num_inference_steps": 2, "height": 16, "width": 16, "num_frames": 5}


def run_waves(pipeline) -> list[torch.Tensor]:
    """The two waves' final latents and decoded videos, in request order."""
    from omni_core.testing import make_state

    out = []
    for wave in (REQUESTS, [ODD]):
        states = [make_state(pipeline, prompt, **{**SAMPLING, **kw}) for prompt, kw in wave]
        outs = pipeline.forward(states)
        out += [t for s, o in zip(states, outs) for t in (s.latents, o.tensor)]
    return out


def _rank(rank: int, world_size: int, folder: str) -> dict:
    from omni_core.config import OmniDiffusionConfig, ParallelConfig
    from omni_core.distributed import destroy_parallel_state, init_parallel_state
    from omni_core.distributed.parallel_state import communication_stats, reset_communication_stats
    from omni_core.pipelines.loader import load_pipeline, resolve_model

    results = {}
    for name, layout in LAYOUTS.items():
        parallel = ParallelConfig(**layout)
        init_parallel_state(parallel)
        try:
            config = OmniDiffusionConfig(model=folder, parallel_config=parallel, dtype="float32")
            pipeline = load_pipeline(resolve_model(folder), config, torch.device("cpu"), torch.float32)
            reset_communication_stats()
            results[name] = (run_waves(pipeline), communication_stats()["total"])
        finally:
            destroy_parallel_state()
    return results


@pytest.fixture(scope="module")
def one_process(omni_hv):
    return run_waves(omni_hv)


@pytest.fixture(scope="module")
def two_ranks(hv_dir):
    """Both ranks' results of every layout: ``[{layout: (tensors, bytes sent)}, ...]`` (one job, ~20 s: two
    processes importing torch and diffusers dominate it)."""
    from omni_core.distributed import spawn_workers

    return spawn_workers(f"{__file__}:_rank", 2, (hv_dir,), timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layout_equals_one_process(one_process, two_ranks, name):
    assert (one_process[0] - one_process[2]).abs().max() > 1e-2  # the requests really differ
    for rank in two_ranks:
        tensors, sent = rank[name]
        assert sent > 0, f"{name}: no bytes exchanged"
        for ref, got in zip(one_process, tensors):
            assert got.shape == ref.shape
            diff = (got - ref).abs().max().item()
            print(f"{name}: max abs diff {diff:.2e}")
            assert diff <= 1e-5, f"{name}: {diff} from one process"
