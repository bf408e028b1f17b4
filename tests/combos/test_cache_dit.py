"""cache_dit on tiny Qwen-Image and Wan 2.2: exactness at threshold 0 and after disable, a cache-dit context
per request / CFG branch / expert (batches and step batches decide as each request alone), real skipping,
SCM and TaylorSeer per request, metrics, a config that does not fit the model (other config errors:
plugins/cache/cache-dit/tests/test_cache_dit_config.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from omni_core.errors import ConfigError
from omni_core.testing import enabled_cache_backend, make_state, run_request_batch, run_step_batch

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]
NEG = "blurry, low quality"


def qwen_states(pipeline, qwen_dir, prompts, *, steps=8, seed=0):
    """States for the loaded Qwen-Image ``pipeline`` (its class checks the params; no model-plugin import)."""
    return [make_state(pipeline, p, seed=seed + i, negative_prompt=NEG, model_path=qwen_dir, height=32, width=32,
                       num_inference_steps=steps if isinstance(steps, int) else steps[i], max_sequence_length=64)
            for i, p in enumerate(prompts)]


def wan_states(pipeline, wan_dir, prompts, *, steps=8, seed=0):
    return [make_state(pipeline, p, seed=seed + i, negative_prompt=NEG, model_path=wan_dir, height=16, width=16,
                       num_frames=5, num_inference_steps=steps, guidance_scale=5.0, max_sequence_length=32)
            for i, p in enumerate(prompts)]


def run(pipeline, states, backend=None):
    with torch.inference_mode():
        return [o.tensor for o in run_request_batch(pipeline, states, cache_backend=backend)]


def run_steps(pipeline, states, backend, admit_at):
    """STEP_BATCH as the runner drives it: state i joins at global step admit_at[i]."""
    with torch.inference_mode():
        return [o.tensor for o in run_step_batch(pipeline, states, admit_at, cache_backend=backend)]


@pytest.fixture
def dit():
    """``dit(pipeline, **config)``: a fresh enabled ``cache_dit`` backend, disabled after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda pipeline, **config: stack.enter_context(enabled_cache_backend("cache_dit", pipeline, **config))


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


# ---------------------------------------------------------------------------------------------- exactness
def test_threshold_zero_and_disable_are_bit_identical(qwen, qwen_dir, dit):
    base = run(qwen, qwen_states(qwen, qwen_dir, PROMPTS[:3]))
    backend = dit(qwen, residual_diff_threshold=0)
    states = qwen_states(qwen, qwen_dir, PROMPTS[:3])
    zero = run(qwen, states, backend)
    assert all(torch.equal(a, b) for a, b in zip(base, zero))
    assert [backend.request_metrics(s)["steps_computed"] for s in states] == [16] * 3
    backend.disable(qwen)
    assert "forward" not in qwen.transformer.__dict__
    assert all(torch.equal(a, b) for a, b in zip(base, run(qwen, qwen_states(qwen, qwen_dir, PROMPTS[:3]))))


# ---------------------------------------------------------------------------------------------- skipping
def test_skipping_really_happens_and_is_counted(qwen, qwen_dir, dit):
    """The middle block's MLP runs only on computed steps; the first (Fn) block always runs."""
    calls = {0: 0, 1: 0}
    hooks = [qwen.transformer.transformer_blocks[i].img_mlp.register_forward_pre_hook(
        lambda m, a, i=i: calls.__setitem__(i, calls[i] + a[0].shape[0])) for i in (0, 1)]
    try:
        backend = dit(qwen, residual_diff_threshold=0.6, max_warmup_steps=2, max_continuous_cached_steps=-1)
        states = qwen_states(qwen, qwen_dir, PROMPTS[:2], steps=10)
        run(qwen, states, backend)
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
def test_batch_decides_per_request_and_matches_alone(qwen, qwen_dir, dit):
    backend = dit(qwen, residual_diff_threshold=0.5, max_warmup_steps=2)
    alone, alone_steps = [], []
    for i in range(4):
        (state,) = qwen_states(qwen, qwen_dir, [PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])
        alone += run(qwen, [state], backend)
        alone_steps.append(cached_steps(backend, state))
    assert len({str(s) for s in alone_steps}) > 1, "the requests should make different decisions"
    for runner in (lambda st: run(qwen, st, backend), lambda st: run_steps(qwen, st, backend, [0, 1, 1, 3])):
        states = [qwen_states(qwen, qwen_dir, [PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])[0] for i in range(4)]
        batched = runner(states)
        assert [cached_steps(backend, s) for s in states] == alone_steps
        for a, b in zip(alone, batched):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert backend.split_calls > 0


def test_cfg_branches_and_wan22_experts_have_their_own_contexts(wan22, wan22_dir, dit):
    backend = dit(wan22, residual_diff_threshold=0.8, max_warmup_steps=1, max_continuous_cached_steps=-1)
    states = wan_states(wan22, wan22_dir, PROMPTS[:2], steps=8)
    run(wan22, states, backend)
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


def test_scm_mask_and_taylorseer_per_request(qwen, qwen_dir, dit):
    """Each request's SCM mask is sized to its own step count (requests of 10 and 16 steps in one batch)."""
    backend = dit(qwen, residual_diff_threshold=0.3, max_warmup_steps=2, scm_steps_mask_policy="fast",
                  scm_steps_policy="static", enable_taylorseer=True, max_continuous_cached_steps=-1)
    states = qwen_states(qwen, qwen_dir, PROMPTS[:2], steps=[10, 16])
    outs = run(qwen, states, backend)
    for state, n in zip(states, (10, 16)):
        ctx = dit_states(state)["cond", "transformer"]
        assert ctx.context.calibrator is not None
        mask = ctx.context.cache_config.steps_computation_mask
        assert len(mask) == n
        cached = set(backend.request_metrics(state)["cache_branches"]["cond/transformer"]["cached_steps"])
        assert cached and cached <= {i for i, m in enumerate(mask) if m == 0}
    assert all(torch.isfinite(o).all() for o in outs)


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_engine_batch_of_four_matches_each_alone(qwen_dir, step_execution):
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": NEG} for p in PROMPTS]
    kw = dict(seed=11, height=32, width=32, num_inference_steps=8, use_tqdm=False, output_type="pt")
    outs = {}
    for n in (4, 1):
        with Omni(qwen_dir, dtype="float32", warmup=False, max_num_seqs=n, step_execution=step_execution,
                  cache_backend="cache_dit", cache_config={"residual_diff_threshold": 0.5,
                                                           "max_warmup_steps": 2}) as o:
            outs[n] = o.generate(prompts, **kw)
    assert [o.metrics["batch_size"] for o in outs[4]] == [4] * 4
    for batched, alone in zip(outs[4], outs[1]):
        assert batched.metrics["cache_backend"] == "cache_dit"
        for branch in ("cond/transformer", "uncond/transformer"):
            assert (batched.metrics["cache_branches"][branch]["cached_steps"]
                    == alone.metrics["cache_branches"][branch]["cached_steps"])
        torch.testing.assert_close(batched.images[0], alone.images[0], atol=2e-4, rtol=0)
    assert sum(o.metrics["steps_reused"] for o in outs[4]) > 0
