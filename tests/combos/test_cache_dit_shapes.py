"""cache_dit on the shipped ``shapes`` model through ``Omni("shapes")`` (a DiT cache-dit does not know, cached by
its ``DenoiserSpec`` alone): threshold 0 is bit-identical, and a batch of 4 different prompts gives every request
exactly the image it gets alone, in both execution modes."""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["a red circle in the top left", "a small blue square in the center", "a green cross in the bottom right",
           "a large yellow triangle in the top right"]
KW = dict(seed=7, num_inference_steps=30, use_tqdm=False, output_type="pt")
CONFIG = {"residual_diff_threshold": 0.24, "max_warmup_steps": 4}


def generate(n: int, step_execution: bool = False, backend: str = "cache_dit", **config):
    from omni_core import Omni

    with Omni("shapes", warmup=False, max_num_seqs=n, step_execution=step_execution, cache_backend=backend,
              cache_config=config) as omni:
        return omni.generate(PROMPTS, **KW)


def test_threshold_zero_is_bit_identical():
    base = generate(4, backend="none")
    zero = generate(4, residual_diff_threshold=0)
    for a, b in zip(base, zero):
        assert torch.equal(a.images[0], b.images[0])
        assert b.metrics["steps_computed"] == 60 and b.metrics["steps_reused"] == 0


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_batch_of_four_is_exactly_each_alone(step_execution):
    batched = generate(4, step_execution, **CONFIG)
    alone = generate(1, step_execution, **CONFIG)
    assert [o.metrics["batch_size"] for o in batched] == [4] * 4
    for b, a in zip(batched, alone):
        assert b.metrics["cache_branches"] == a.metrics["cache_branches"]
        assert torch.equal(b.images[0], a.images[0])
    assert sum(o.metrics["steps_reused"] for o in batched) > 0
