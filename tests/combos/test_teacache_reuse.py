"""tea_cache's ``max_consecutive_reuse`` through ``Omni("shapes")``: with a threshold so high that every step
could be reused, no branch of any output reuses more than ``k`` steps in a row, a smaller ``k`` computes more
steps, and without the option the same threshold reuses far longer runs (so the option is what bounds them)."""

from __future__ import annotations

import re

import pytest

PROMPTS = ["a red circle in the top left", "a blue square in the center"]
STEPS = 20


def generate(step_execution: bool, **config):
    from omni_core import Omni

    with Omni("shapes", warmup=False, max_num_seqs=2, step_execution=step_execution, cache_backend="tea_cache",
              cache_config={"rel_l1_thresh": 1e6, **config}) as omni:
        return omni.generate(PROMPTS, seed=3, num_inference_steps=STEPS, use_tqdm=False, output_type="pt")


def longest_reuse_run(outputs) -> int:
    runs = [len(r) for o in outputs for b in o.metrics["cache_branches"].values()
            for r in re.findall("R+", b["pattern"])]
    return max(runs, default=0)


def computed(outputs) -> int:
    return sum(o.metrics["steps_computed"] for o in outputs)


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_max_consecutive_reuse_bounds_every_run_of_reused_steps(step_execution):
    unbounded = generate(step_execution)
    by_k = {k: generate(step_execution, max_consecutive_reuse=k) for k in (1, 3)}
    for outputs in (unbounded, *by_k.values()):
        for o in outputs:  # both CFG branches, every step accounted for
            assert set(o.metrics["cache_branches"]) == {"cond/transformer", "uncond/transformer"}
            assert all(len(b["pattern"]) == STEPS for b in o.metrics["cache_branches"].values())
    # without the option a threshold this high reuses everything between the warm-up and the last step
    assert longest_reuse_run(unbounded) >= STEPS - 3
    for k, outputs in by_k.items():
        assert longest_reuse_run(outputs) == k, (k, [o.metrics["cache_branches"] for o in outputs])
    assert computed(by_k[1]) > computed(by_k[3]) > computed(unbounded)
    # k = 1 alternates: at most one reused step between two computed ones
    for o in by_k[1]:
        for b in o.metrics["cache_branches"].values():
            assert "RR" not in b["pattern"] and b["pattern"].startswith("C") and b["pattern"].endswith("C")
