"""cache_dit on tiny Qwen-Image and Wan 2.2: exactness at threshold 0 and after disable, a cache-dit context
per request / CFG branch / expert (batches and step batches decide as each request alone), real skipping,
SCM and TaylorSeer per request, metrics, a config that does not fit the model (other config errors:
plugins/cache/cache-dit/tests/test_cache_dit_config.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from omni_core.errors import ConfigError
from omni_core.testing import output_tensors

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]


@pytest.fixture
def dit(enable_cache):
    """``dit(pipeline, **config)``: a fresh enabled ``cache_dit`` backend, disabled after the test."""
    return functools.partial(enable_cache, "cache_dit")


def cache_dit_backend():
    """The ``cache_dit`` backend class, reached by component name (no plugin import)."""
    from omni_core.plugins.manager import get_plugin_manager

    return get_plugin_manager().load_component("cache", "cache_dit")


def dit_states(state):
    """The request's cache-dit contexts (the backend's per-(branch, expert) records carry ``context``)."""
    return {k: v for k, v in state.cache_state.items() if hasattr(v, "context") and hasattr(v, "calls")}


def cached_steps(backend, state):
    return {k: v["cached_steps"] for k, v in backend.request_metrics(state)["cache_branches"].items()}


# ---------------------------------------------------------------------------------------------- config vs model
def test_compute_blocks_must_fit_the_model(qwen):
    with pytest.raises(ConfigError, match="Fn_compute_blocks=2 .* 2 blocks: Fn must be < 2"):
        cache_dit_backend()({"Fn_compute_blocks": 2}).enable(qwen)
    assert "forward" not in qwen.transformer.__dict__


# ---------------------------------------------------------------------------------------------- skipping
def test_skipping_really_happens_and_is_counted(qwen, qwen_dir, dit, qwen_states):
    """The middle block's MLP runs only on computed steps; the first (Fn) block always runs."""
    calls = {0: 0, 1: 0}
    hooks = [qwen.transformer.transformer_blocks[i].img_mlp.register_forward_pre_hook(
        lambda m, a, i=i: calls.__setitem__(i, calls[i] + a[0].shape[0])) for i in (0, 1)]
    try:
        backend = dit(qwen, residual_diff_threshold=0.6, max_warmup_steps=2, max_continuous_cached_steps=-1)
        states = qwen_states(PROMPTS[:2], steps=10)
        output_tensors(qwen, states, backend)
    finally:
        for h in hooks:
            h.remove()
    metrics = [backend.request_metrics(s) for s in states]
    reused = sum(m["steps_reused"] for m in metrics)
    assert reused > 0
    assert calls[0] == 40 and calls[1] == 40 - reused
    for m in metrics:
        assert set(m["cache_branches"]) == {"cond/transformer", "uncond/transformer"}
        assert m["steps_computed"] + m["steps_reused"] == 20
        assert all(min(b["cached_steps"]) >= 2 for b in m["cache_branches"].values() if b["cached_steps"])


# ---------------------------------------------------------------------------------------------- per request
def test_batch_decides_per_request_and_matches_alone(qwen, qwen_dir, dit, qwen_states):
    backend = dit(qwen, residual_diff_threshold=0.5, max_warmup_steps=2)
    alone, alone_steps = [], []
    for i in range(4):
        (state,) = qwen_states([PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])
        alone += output_tensors(qwen, [state], backend)
        alone_steps.append(cached_steps(backend, state))
    assert len({str(s) for s in alone_steps}) > 1, "the requests should make different decisions"
    for runner in (lambda st: output_tensors(qwen, st, backend), lambda st: output_tensors(qwen, st, backend, [0, 1, 1, 3])):
        states = [qwen_states([PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])[0] for i in range(4)]
        batched = runner(states)
        assert [cached_steps(backend, s) for s in states] == alone_steps
        for a, b in zip(alone, batched):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert backend.split_calls > 0


def test_cfg_branches_and_wan22_experts_have_their_own_contexts(wan22, wan22_dir, dit, wan_states):
    backend = dit(wan22, residual_diff_threshold=0.8, max_warmup_steps=1, max_continuous_cached_steps=-1)
    states = wan_states(PROMPTS[:2], steps=8)
    output_tensors(wan22, states, backend)
    contexts = set()
    for state in states:
        dits = dit_states(state)
        assert set(dits) == {("cond", "transformer"), ("uncond", "transformer"),
                             ("cond", "transformer_2"), ("uncond", "transformer_2")}
        assert sum(d.calls for d in dits.values()) == 16
        contexts |= {id(d.context) for d in dits.values()}
        assert all(d.context.cache_config.num_inference_steps == 8 for d in dits.values())
    assert len(contexts) == 8
    assert sum(backend.request_metrics(s)["steps_reused"] for s in states) > 0


def test_scm_mask_and_taylorseer_per_request(qwen, qwen_dir, dit, qwen_states):
    """Each request's SCM mask is sized to its own step count (requests of 10 and 16 steps in one batch)."""
    backend = dit(qwen, residual_diff_threshold=0.3, max_warmup_steps=2, scm_steps_mask_policy="fast",
                  scm_steps_policy="static", enable_taylorseer=True, max_continuous_cached_steps=-1)
    states = qwen_states(PROMPTS[:2], steps=[10, 16])
    outs = output_tensors(qwen, states, backend)
    for state, n in zip(states, (10, 16)):
        ctx = dit_states(state)["cond", "transformer"]
        assert ctx.context.calibrator is not None
        mask = ctx.context.cache_config.steps_computation_mask
        assert len(mask) == n
        cached = set(backend.request_metrics(state)["cache_branches"]["cond/transformer"]["cached_steps"])
        assert cached and cached <= {i for i, m in enumerate(mask) if m == 0}
    assert all(torch.isfinite(o).all() for o in outs)
