"""Both cache plugins on tiny Qwen-Image: at threshold 0 a batch is bit-identical to no cache and disabling restores
the model; through ``Omni(max_num_seqs=4)``, in both execution modes, every request of a batch of four (different
prompts, CFG on) gets the cache decisions and the image it gets alone, and the cache really skips. (The same on
the ``shapes`` model, exactly: ``test_cache_shapes.py``; per-backend details: ``test_cache_dit.py``,
``test_teacache.py``.)"""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]
NEG = "blurry, low quality"
#: backend -> a config that skips some of 8 steps on the tiny Qwen-Image
BACKENDS = {"cache_dit": {"residual_diff_threshold": 0.5, "max_warmup_steps": 2},
            "tea_cache": {"rel_l1_thresh": 0.45}}
#: backend -> its config that must never reuse a step
OFF = {"cache_dit": {"residual_diff_threshold": 0}, "tea_cache": {"rel_l1_thresh": 0}}


def decisions(output) -> dict:
    """Per CFG branch: what was computed and reused, and which steps (cache_dit's residual diffs are floats that
    batching may change in the last bits, so they are left out)."""
    return {branch: {k: v for k, v in m.items() if k != "residual_diffs"}
            for branch, m in output.metrics["cache_branches"].items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_zero_and_disable_are_bit_identical(qwen, qwen_states, enable_cache, backend):
    from omni_core.testing import output_tensors

    base = output_tensors(qwen, qwen_states(PROMPTS[:3]))
    cache = enable_cache(backend, qwen, **OFF[backend])
    states = qwen_states(PROMPTS[:3])
    zero = output_tensors(qwen, states, cache)
    assert all(torch.equal(a, b) for a, b in zip(base, zero))
    assert [(m["steps_computed"], m["steps_reused"]) for m in map(cache.request_metrics, states)] == [(16, 0)] * 3
    cache.disable(qwen)
    patched = [m for m in (qwen.transformer, *qwen.transformer.transformer_blocks) if "forward" in m.__dict__]
    assert not patched, f"{backend} left {len(patched)} patched forward(s) after disable"
    assert all(torch.equal(a, b) for a, b in zip(base, output_tensors(qwen, qwen_states(PROMPTS[:3]))))


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_batch_of_four_matches_each_alone(qwen_dir, backend, step_execution):
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": NEG} for p in PROMPTS]
    kw = dict(seed=11, height=32, width=32, num_inference_steps=8, use_tqdm=False, output_type="pt")
    outs = {}
    for n in (4, 1):
        with Omni(qwen_dir, dtype="float32", warmup=False, max_num_seqs=n, step_execution=step_execution,
                  cache_backend=backend, cache_config=BACKENDS[backend]) as o:
            outs[n] = o.generate(prompts, **kw)
    assert [o.metrics["batch_size"] for o in outs[4]] == [4] * 4
    for batched, alone in zip(outs[4], outs[1]):
        assert batched.metrics["cache_backend"] == backend
        assert set(decisions(batched)) == {"cond/transformer", "uncond/transformer"}
        assert decisions(batched) == decisions(alone)
        torch.testing.assert_close(batched.images[0], alone.images[0], atol=2e-4, rtol=0)
    assert sum(o.metrics["steps_reused"] for o in outs[4]) > 0
