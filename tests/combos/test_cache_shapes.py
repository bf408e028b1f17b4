"""Both cache plugins on the shipped ``shapes`` model through ``Omni("shapes")`` (a DiT neither cache knows,
cached by its ``DenoiserSpec`` alone): threshold 0 is bit-identical to no cache, and (the model being
batch-invariant) a batch of 4 different prompts gives every request *exactly* the image it gets alone, in both
execution modes; tea_cache's default settings skip most evaluations and stay close."""

from __future__ import annotations

import math

import pytest
import torch

PROMPTS = ["a red circle in the top left", "a small blue square in the center", "a green cross in the bottom right",
           "a large yellow triangle in the top right"]
KW = dict(seed=7, num_inference_steps=30, use_tqdm=False, output_type="pt")
#: backend -> (its config with threshold 0, a config that skips steps on this model)
BACKENDS = {"cache_dit": ({"residual_diff_threshold": 0}, {"residual_diff_threshold": 0.24, "max_warmup_steps": 4}),
            "tea_cache": ({"rel_l1_thresh": 0}, {})}


def generate(n: int, backend: str, step_execution: bool = False, steps: int = 30, **config):
    from omni_core import Omni

    with Omni("shapes", warmup=False, max_num_seqs=n, step_execution=step_execution, cache_backend=backend,
              cache_config=config) as omni:
        return omni.generate(PROMPTS, **{**KW, "num_inference_steps": steps})


@pytest.fixture(scope="module")
def uncached():
    return generate(4, "none")


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_zero_is_bit_identical(uncached, backend):
    zero = generate(4, backend, **BACKENDS[backend][0])
    for a, b in zip(uncached, zero):
        assert torch.equal(a.images[0], b.images[0])
        assert b.metrics["steps_reused"] == 0 and b.metrics["steps_computed"] == 60


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_four_is_exactly_each_alone(backend, step_execution):
    config = BACKENDS[backend][1]
    batched = generate(4, backend, step_execution, **config)
    alone = generate(1, backend, step_execution, **config)
    assert [o.metrics["batch_size"] for o in batched] == [4] * 4
    patterns = set()
    for b, a in zip(batched, alone):
        assert b.metrics["cache_branches"] == a.metrics["cache_branches"]
        assert torch.equal(b.images[0], a.images[0])
        patterns.add(str(b.metrics["cache_branches"]))
    if backend == "tea_cache":
        assert len(patterns) > 1, "the four requests should not all make the same decisions"
    assert sum(o.metrics["steps_reused"] for o in batched) > 0


def test_tea_cache_default_settings_skip_most_evaluations_and_stay_close():
    """At the 50 steps the default threshold is tuned for: > 1.9x fewer evaluations, mean PSNR > 30 dB."""
    base = generate(4, "none", steps=50)
    default = generate(4, "tea_cache", steps=50)
    psnrs, computed, total = [], 0, 0
    for a, b in zip(base, default):
        assert set(b.metrics["cache_branches"]) == {"cond/transformer", "uncond/transformer"}
        computed += b.metrics["steps_computed"]
        total += b.metrics["steps_computed"] + b.metrics["steps_reused"]
        psnrs.append(-10 * math.log10(float(((a.images[0] - b.images[0]) ** 2).mean())))
    assert total == 400 and total / computed > 1.9
    assert sum(psnrs) / len(psnrs) > 30 and min(psnrs) > 22, psnrs
