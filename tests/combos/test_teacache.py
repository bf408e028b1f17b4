"""tea_cache on tiny Qwen-Image and Wan 2.2: exactness when it must not skip, per-request decisions in
batches and step batches, separate state per CFG branch and expert, real skipping, metrics, and the calibration
command (config errors: plugins/cache/teacache/tests/test_teacache_config.py)."""

from __future__ import annotations

import contextlib
import json

import attrs
import pytest
import torch

from omni_core.testing import enabled_cache_backend, make_state, run_request_batch, run_step_batch

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]
NEG = "blurry, low quality"


def qwen_states(pipeline, qwen_dir, prompts, *, steps=8, seed=0, negative=NEG):
    """States for the loaded Qwen-Image ``pipeline`` (its class checks the params; no model-plugin import)."""
    return [make_state(pipeline, p, seed=seed + i, negative_prompt=negative, model_path=qwen_dir, height=32, width=32,
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
def tea():
    """``tea(pipeline, **config)``: a fresh enabled ``tea_cache`` backend, disabled after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda pipeline, **config: stack.enter_context(enabled_cache_backend("tea_cache", pipeline, **config))


def patterns(state):
    """``(branch, expert) -> "CRRC..."`` from the request's tea_cache state (one letter per call)."""
    return {k: "".join("C" if c else "R" for c in v.pattern) for k, v in state.cache_state.items()
            if hasattr(v, "pattern")}


# ---------------------------------------------------------------------------------------------- exactness
def test_threshold_zero_and_disable_are_bit_identical(qwen, qwen_dir, tea):
    base = run(qwen, qwen_states(qwen, qwen_dir, PROMPTS[:3]))
    backend = tea(qwen, rel_l1_thresh=0)
    states = qwen_states(qwen, qwen_dir, PROMPTS[:3])
    zero = run(qwen, states, backend)
    assert all(torch.equal(a, b) for a, b in zip(base, zero))
    assert backend.mode_counts["all"] > 0 and backend.mode_counts["slice"] == 0
    assert all(set(p) == {"C"} for s in states for p in patterns(s).values())
    backend.disable(qwen)
    assert all("forward" not in b.__dict__ for b in qwen.transformer.transformer_blocks)
    assert "forward" not in qwen.transformer.__dict__
    assert all(torch.equal(a, b) for a, b in zip(base, run(qwen, qwen_states(qwen, qwen_dir, PROMPTS[:3]))))


def test_engine_threshold_zero_bit_identical(qwen_dir):
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": NEG} for p in PROMPTS[:2]]
    kw = dict(seed=5, height=32, width=32, num_inference_steps=6, use_tqdm=False, output_type="pt")
    outs = {}
    for cache in (None, "tea_cache"):
        extra = {"cache_backend": cache, "cache_config": {"rel_l1_thresh": 0}} if cache else {}
        with Omni(qwen_dir, dtype="float32", warmup=False, max_num_seqs=2, **extra) as o:
            outs[cache] = o.generate(prompts, **kw)
    for a, b in zip(outs[None], outs["tea_cache"]):
        assert torch.equal(a.images[0], b.images[0])
        assert b.metrics["cache_backend"] == "tea_cache"
        assert b.metrics["steps_computed"] == 12 and b.metrics["steps_reused"] == 0


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_engine_batch_of_four_matches_each_alone(qwen_dir, step_execution):
    """``Omni(max_num_seqs=4)`` with tea_cache: every request gets the decisions and image it gets alone."""
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": NEG} for p in PROMPTS]
    kw = dict(seed=11, height=32, width=32, num_inference_steps=8, use_tqdm=False, output_type="pt")
    outs = {}
    for n in (4, 1):
        with Omni(qwen_dir, dtype="float32", warmup=False, max_num_seqs=n, step_execution=step_execution,
                  cache_backend="tea_cache", cache_config={"rel_l1_thresh": 0.45}) as o:
            outs[n] = o.generate(prompts, **kw)
    assert [o.metrics["batch_size"] for o in outs[4]] == [4] * 4
    for batched, alone in zip(outs[4], outs[1]):
        assert batched.metrics["cache_branches"] == alone.metrics["cache_branches"]
        torch.testing.assert_close(batched.images[0], alone.images[0], atol=2e-4, rtol=0)
    assert sum(o.metrics["steps_reused"] for o in outs[4]) > 0


# ---------------------------------------------------------------------------------------------- skipping
def test_skipping_really_happens_and_is_counted(qwen, qwen_dir, tea):
    """Rows through the second block's MLP drop by exactly the reused evaluations; output stays close."""
    rows = []
    hook = qwen.transformer.transformer_blocks[1].img_mlp.register_forward_pre_hook(
        lambda m, a: rows.append(a[0].shape[0]))
    try:
        base = run(qwen, qwen_states(qwen, qwen_dir, PROMPTS[:2], steps=10))
        base_rows = sum(rows)
        rows.clear()
        backend = tea(qwen, rel_l1_thresh=0.6)
        states = qwen_states(qwen, qwen_dir, PROMPTS[:2], steps=10)
        cached = run(qwen, states, backend)
    finally:
        hook.remove()
    metrics = [backend.request_metrics(s) for s in states]
    reused = sum(m["steps_reused"] for m in metrics)
    assert reused > 0
    assert base_rows == 40 and sum(rows) == base_rows - reused
    for m in metrics:
        assert m["steps_computed"] + m["steps_reused"] == 20
        for branch in ("cond/transformer", "uncond/transformer"):
            p = m["cache_branches"][branch]["pattern"]
            assert len(p) == 10 and p[0] == "C" and p[-1] == "C"
    for a, b in zip(base, cached):
        assert (a - b).abs().max() < 0.1


def test_cfg_branches_and_wan22_experts_keep_separate_state(wan22, wan22_dir, tea):
    backend = tea(wan22, rel_l1_thresh=0.45, coefficients=[1.0, 0.0], warmup_steps=1)
    states = wan_states(wan22, wan22_dir, PROMPTS[:2], steps=8)
    run(wan22, states, backend)
    for state in states:
        keys = set(patterns(state))
        assert keys == {("cond", "transformer"), ("uncond", "transformer"),
                        ("cond", "transformer_2"), ("uncond", "transformer_2")}
        p = patterns(state)
        # each expert's first call computes (no previous input of its own); all calls are accounted for
        assert all(v[0] == "C" for v in p.values())
        assert sum(len(v) for v in p.values()) == 16
        assert len(p["cond", "transformer"]) + len(p["cond", "transformer_2"]) == 8
        m = backend.request_metrics(state)
        assert set(m["cache_branches"]) == {"cond/transformer", "uncond/transformer", "cond/transformer_2",
                                            "uncond/transformer_2"}
    assert sum(backend.request_metrics(s)["steps_reused"] for s in states) > 0


# ---------------------------------------------------------------------------------------------- per request
def test_batch_decides_per_request_request_mode(qwen, qwen_dir, tea, monkeypatch):
    """Four prompts batched decide exactly as each alone; rows that compute are sliced from the batch."""
    backend = tea(qwen, rel_l1_thresh=0.45)
    alone, alone_patterns = [], []
    for i in range(4):
        (state,) = qwen_states(qwen, qwen_dir, [PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])
        alone += run(qwen, [state], backend)
        alone_patterns.append(patterns(state))
    states = [qwen_states(qwen, qwen_dir, [PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])[0] for i in range(4)]
    batched = run(qwen, states, backend)
    assert [patterns(s) for s in states] == alone_patterns
    assert len({str(p) for p in alone_patterns}) > 1, "the requests should make different decisions"
    assert backend.mode_counts["slice"] > 0
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    # a model that declares its rows inseparable runs them all and overwrites the reused ones: same results
    backend.disable(qwen)
    specs = qwen.denoisers()
    monkeypatch.setattr(qwen, "denoisers", lambda: [attrs.evolve(s, rows_separable=False) for s in specs])
    backend = tea(qwen, rel_l1_thresh=0.45)
    states = [qwen_states(qwen, qwen_dir, [PROMPTS[i]], seed=i, steps=[8, 9, 10, 11][i])[0] for i in range(4)]
    masked = run(qwen, states, backend)
    assert backend.mode_counts["mask"] > 0
    assert [patterns(s) for s in states] == alone_patterns
    for a, b in zip(alone, masked):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


def test_step_batch_requests_at_different_steps_decide_for_themselves(wan22, wan22_dir, tea):
    backend = tea(wan22, rel_l1_thresh=0.45, coefficients=[1.0, 0.0], warmup_steps=1)
    alone, alone_patterns = [], []
    for i in range(3):
        (state,) = wan_states(wan22, wan22_dir, [PROMPTS[i]], seed=i)
        alone += run(wan22, [state], backend)
        alone_patterns.append(patterns(state))
    states = [wan_states(wan22, wan22_dir, [PROMPTS[i]], seed=i)[0] for i in range(3)]
    stepped = run_steps(wan22, states, backend, admit_at=[0, 1, 3])
    assert [patterns(s) for s in states] == alone_patterns
    assert backend.mode_counts["slice"] > 0
    for a, b in zip(alone, stepped):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


def test_call_without_denoise_call_is_one_request(qwen, qwen_dir, tea):
    """A caller that sets no DenoiseCall (e.g. diffusers' own loop) still gets TeaCache, as one request."""
    backend = tea(qwen, rel_l1_thresh=0.6)
    t = qwen.transformer
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    text = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for step in range(6):
            t(hidden_states=x, encoder_hidden_states=text, timestep=torch.full([2], 1 - step / 10),
              img_shapes=[[(1, 2, 2)]] * 2, return_dict=False)
    (tea_state,) = backend._fallback.values()
    assert len(tea_state.pattern) == 6 and tea_state.pattern[0] and not all(tea_state.pattern)


# ---------------------------------------------------------------------------------------------- calibration
def test_calibrate_command_fits_coefficients(qwen_dir, tmp_path, capsys):
    from omni_core.cli.main import main

    out = tmp_path / "coeffs.json"
    code = main(["cache", "calibrate", "--model", qwen_dir, "--prompts", "2", "--steps", "6", "--height", "32",
                 "--width", "32", "--dtype", "float32", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert len(result["coefficients"]) == 5 and result["denoiser"] == "QwenImageTransformer2DModel"
    # 2 prompts x 2 branches x 5 step pairs
    assert result["num_pairs"] == 20
    assert set(result["per_branch"]) == {"cond/transformer", "uncond/transformer"}
    assert "coefficients: [" in capsys.readouterr().out
