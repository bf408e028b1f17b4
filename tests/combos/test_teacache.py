"""tea_cache on tiny Qwen-Image and Wan 2.2: per-request decisions in step batches, separate state per CFG branch
and expert, real skipping, metrics, and the calibration command. (Threshold 0 and a batch of four through the
engine: test_cache_qwen_image.py; sliced and masked rows: the plugin's test_teacache_tiny.py; config errors:
plugins/cache/teacache/tests/test_teacache_config.py.)"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from omni_core.testing import output_tensors

PROMPTS = ["a red fox jumps over a lazy dog", "a cat", "an astronaut rides a horse on the moon", "two ships"]


@pytest.fixture
def tea(enable_cache):
    """``tea(pipeline, **config)``: a fresh enabled ``tea_cache`` backend, disabled after the test."""
    return functools.partial(enable_cache, "tea_cache")


def patterns(state):
    """``(branch, expert) -> "CRRC..."`` from the request's tea_cache state (one letter per call)."""
    return {k: "".join("C" if c else "R" for c in v.pattern) for k, v in state.cache_state.items()
            if hasattr(v, "pattern")}


# ---------------------------------------------------------------------------------------------- skipping
def test_skipping_really_happens_and_is_counted(qwen, qwen_dir, tea, qwen_states):
    """Rows through the second block's MLP drop by exactly the reused evaluations; output stays close."""
    rows = []
    hook = qwen.transformer.transformer_blocks[1].img_mlp.register_forward_pre_hook(
        lambda m, a: rows.append(a[0].shape[0]))
    try:
        base = output_tensors(qwen, qwen_states(PROMPTS[:2], steps=10))
        base_rows = sum(rows)
        rows.clear()
        backend = tea(qwen, rel_l1_thresh=0.6)
        states = qwen_states(PROMPTS[:2], steps=10)
        cached = output_tensors(qwen, states, backend)
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


def test_cfg_branches_and_wan22_experts_keep_separate_state(wan22, wan22_dir, tea, wan_states):
    backend = tea(wan22, rel_l1_thresh=0.45, coefficients=[1.0, 0.0], warmup_steps=1)
    states = wan_states(PROMPTS[:2], steps=8)
    output_tensors(wan22, states, backend)
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
def test_step_batch_requests_at_different_steps_decide_for_themselves(wan22, wan22_dir, tea, wan_states):
    backend = tea(wan22, rel_l1_thresh=0.45, coefficients=[1.0, 0.0], warmup_steps=1)
    alone, alone_patterns = [], []
    for i in range(3):
        (state,) = wan_states([PROMPTS[i]], seed=i)
        alone += output_tensors(wan22, [state], backend)
        alone_patterns.append(patterns(state))
    states = [wan_states([PROMPTS[i]], seed=i)[0] for i in range(3)]
    stepped = output_tensors(wan22, states, backend, admit_at=[0, 1, 3])
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
    from omni_core.hooks import standalone_state

    (tea_state,) = [v for v in standalone_state().values() if hasattr(v, "pattern")]
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
