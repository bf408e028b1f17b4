"""tea_cache on the shipped ``shapes`` model through ``Omni("shapes")``: the default settings skip, threshold 0 is
bit-identical to no cache, and (the model being batch-invariant) a batch of 4 different prompts gives every
request *exactly* the image it gets alone, in both execution modes."""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["a red circle in the top left", "a small blue square in the center", "a green cross in the bottom right",
           "a large yellow triangle in the top right"]
KW = dict(seed=7, num_inference_steps=30, use_tqdm=False, output_type="pt")


def generate(n: int, step_execution: bool = False, backend: str = "tea_cache", steps: int = 30, **config):
    from omni_core import Omni

    with Omni("shapes", warmup=False, max_num_seqs=n, step_execution=step_execution, cache_backend=backend,
              cache_config=config) as omni:
        return omni.generate(PROMPTS, **{**KW, "num_inference_steps": steps})


def test_threshold_zero_is_bit_identical():
    base = generate(4, backend="none")
    zero = generate(4, rel_l1_thresh=0)
    for a, b in zip(base, zero):
        assert torch.equal(a.images[0], b.images[0])
        assert b.metrics["steps_reused"] == 0 and b.metrics["steps_computed"] == 60


def test_default_settings_skip_most_evaluations_and_stay_close():
    """At the 50 steps the default threshold is tuned for: > 1.9x fewer evaluations, mean PSNR > 30 dB."""
    import math

    base = generate(4, backend="none", steps=50)
    default = generate(4, steps=50)
    psnrs, computed, total = [], 0, 0
    for a, b in zip(base, default):
        assert set(b.metrics["cache_branches"]) == {"cond/transformer", "uncond/transformer"}
        computed += b.metrics["steps_computed"]
        total += b.metrics["steps_computed"] + b.metrics["steps_reused"]
        psnrs.append(-10 * math.log10(float(((a.images[0] - b.images[0]) ** 2).mean())))
    assert total == 400 and total / computed > 1.9
    assert sum(psnrs) / len(psnrs) > 30 and min(psnrs) > 22, psnrs


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_batch_of_four_is_exactly_each_alone(step_execution):
    batched = generate(4, step_execution)
    alone = generate(1, step_execution)
    assert [o.metrics["batch_size"] for o in batched] == [4] * 4
    patterns = set()
    for b, a in zip(batched, alone):
        assert b.metrics["cache_branches"] == a.metrics["cache_branches"]
        assert torch.equal(b.images[0], a.images[0])
        patterns.add(str(b.metrics["cache_branches"]))
    assert len(patterns) > 1, "the four requests should not all make the same decisions"
