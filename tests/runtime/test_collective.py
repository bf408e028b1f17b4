"""The collective call (``engine.collective_rpc``): a runner method on every rank, between waves.

Checked on the ``uni`` executor and on ``mp`` with two ranks (CFG-parallel, gloo), each while requests run in step
mode: the call waits for the waves in flight, every rank answers in rank order, the requests around it complete
with the same images as the same pair without it, a failure names every rank it failed on, and a bad name is refused before
anything pauses.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from omni_core import Omni
from omni_core.errors import CollectiveCallError, ConfigError


def _params(seed: int, steps: int = 6) -> dict:
    return {"height": 32, "width": 32, "num_inference_steps": steps, "seed": seed, "output_type": "pt"}


@pytest.mark.parametrize("executor, extra, ranks", [
    ("uni", {}, 1),
    ("mp", {"parallel_config": {"cfg_parallel_size": 2}, "max_num_seqs": 2}, 2),
])
def test_a_collective_call_reaches_every_rank_between_waves(tiny_model, executor, extra, ranks):
    # a fixed thread count: under a contended CPU the runner's thread policy may change between runs otherwise
    with Omni(tiny_model, executor=executor, warmup=False, step_execution=True, cpu_threads=1, **extra) as omni:
        engine = omni.engine
        alone = [h.result(timeout=120).tensor for h in engine.submit([_request(engine, 1), _request(engine, 2)])]

        stepped = threading.Event()
        handles = engine.submit([_request(engine, 1), _request(engine, 2)], on_progress=lambda *a: stepped.set())
        assert stepped.wait(60)
        described = engine.collective_rpc("describe")
        results = [h.result(timeout=120) for h in handles]

        assert [d["rank"] for d in described] == list(range(ranks))
        # it ran between two steps of theirs: every rank held both mid-denoise
        assert all(d["held_ids"] == sorted(h.request_id for h in handles) for d in described), described
        assert len({d["pid"] for d in described}) == ranks  # each rank ran it in its own process
        if executor == "mp":
            assert os.getpid() not in {d["pid"] for d in described}
        assert all(r.status == "completed" for r in results)
        for got, want in zip(results, alone):
            assert torch.equal(got.tensor, want), "a call between waves changed a request's image"

        with pytest.raises(CollectiveCallError) as failed:
            engine.collective_rpc("release", args=(None,))  # ``None`` is no list of ids: every rank fails
        assert failed.value.ranks == list(range(ranks)) and "TypeError" in str(failed.value)
        with pytest.raises(ConfigError, match="'_forget' is not a public method.*describe"):
            engine.collective_rpc("_forget")
        assert engine.collective_rpc("held_ids") == [set()] * ranks  # the engine lives on after a failed call
        assert omni.stats()["tracked_requests"] == []


def _request(engine, seed: int):
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    return OmniDiffusionRequest(prompt="a red circle", sampling_params=SamplingParams.from_kwargs(**_params(seed)))
