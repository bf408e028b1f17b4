"""tea_cache on the core's tiny DiT (``omni_core.testing``'s ``tiny_dit_model``), with only this plugin installed:
exactness when it must not skip, per-request decisions in request batches and step waves, real skipping, metrics,
``max_consecutive_reuse``, shipped defaults, and the calibration command. The model reaches the backend through
its ``DenoiserSpec`` alone."""

from __future__ import annotations

import functools
import json
import re
import shutil

import attrs
import pytest
import torch

from omni_core.testing.cache_contract import CacheBackendContract
from omni_core.testing import load_model
from omni_core.testing.driver import make_states, output_tensors, run_step_batch

PROMPTS = ["a red square", "a blue circle on the left", "two green dots"]
#: a threshold at which the tiny model reuses some steps and computes others
THRESH = 0.02


class TestTeaCacheContract(CacheBackendContract):
    """The contract every cache backend owes its users, on the tiny DiT."""

    cache_backend = "tea_cache"
    cache_config = {"rel_l1_thresh": THRESH}
    off_config = {"rel_l1_thresh": 0}
    sampling = {"num_inference_steps": 8}
    metric_keys = ("cache_backend", "steps_computed", "steps_reused", "cache_branches")


@pytest.fixture
def tea(enable_cache):
    """``tea(pipeline, **config)``: a fresh enabled ``tea_cache`` backend, disabled after the test."""
    return functools.partial(enable_cache, "tea_cache")


def states(pipeline, steps=(8, 10, 12), seed=0):
    """A request per step count, prompts in turn, CFG on (empty negative prompt)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(steps))]
    return make_states(pipeline, prompts, seed=seed, negative_prompt="", num_inference_steps=list(steps))


def patterns(state):
    from omni_cache_teacache.backend import TeaState

    return {k: "".join("C" if c else "R" for c in v.pattern) for k, v in state.cache_state.items()
            if isinstance(v, TeaState)}


# ---------------------------------------------------------------------------------------------- exactness
def test_threshold_zero_and_disable_are_bit_identical(tiny_dit, tea):
    base = output_tensors(tiny_dit, states(tiny_dit))
    backend = tea(tiny_dit, rel_l1_thresh=0)
    cached_states = states(tiny_dit)
    zero = output_tensors(tiny_dit, cached_states, backend)
    assert all(torch.equal(a, b) for a, b in zip(base, zero))
    assert backend.mode_counts["all"] > 0 and backend.mode_counts["slice"] == backend.mode_counts["none"] == 0
    assert all(set(p) == {"C"} for s in cached_states for p in patterns(s).values())
    backend.disable(tiny_dit)
    assert all("forward" not in b.__dict__ for b in tiny_dit.transformer.blocks)
    assert "forward" not in tiny_dit.transformer.__dict__
    assert all(torch.equal(a, b) for a, b in zip(base, output_tensors(tiny_dit, states(tiny_dit))))


def test_engine_threshold_zero_bit_identical_with_metrics(tiny_dit_model):
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": ""} for p in PROMPTS[:2]]
    kw = dict(seed=5, num_inference_steps=6, use_tqdm=False, output_type="pt")
    outs = {}
    for cache in (None, "tea_cache"):
        extra = {"cache_backend": cache, "cache_config": {"rel_l1_thresh": 0}} if cache else {}
        with Omni(tiny_dit_model, dtype="float32", warmup=False, max_num_seqs=2, **extra) as o:
            outs[cache] = o.generate(prompts, **kw)
    for a, b in zip(outs[None], outs["tea_cache"]):
        assert torch.equal(a.images[0], b.images[0])
        assert b.metrics["cache_backend"] == "tea_cache"
        assert b.metrics["steps_computed"] == 12 and b.metrics["steps_reused"] == 0  # 6 steps x 2 CFG branches
        assert {k: v["pattern"] for k, v in b.metrics["cache_branches"].items()} == {
            "cond/transformer": "CCCCCC", "uncond/transformer": "CCCCCC"}


# ---------------------------------------------------------------------------------------------- skipping
def test_skipping_really_happens_and_is_counted(tiny_dit, tea):
    """Rows through the last block's MLP drop by exactly the reused evaluations; the output stays close."""
    rows = []
    hook = tiny_dit.transformer.blocks[-1].mlp.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    try:
        base = output_tensors(tiny_dit, states(tiny_dit, steps=(10, 10)))
        base_rows = sum(rows)
        rows.clear()
        backend = tea(tiny_dit, rel_l1_thresh=THRESH)
        cached_states = states(tiny_dit, steps=(10, 10))
        cached = output_tensors(tiny_dit, cached_states, backend)
    finally:
        hook.remove()
    metrics = [backend.request_metrics(s) for s in cached_states]
    reused = sum(m["steps_reused"] for m in metrics)
    assert reused > 0
    assert base_rows == 40 and sum(rows) == base_rows - reused  # 2 requests x 2 branches x 10 steps
    for m in metrics:
        assert m["cache_backend"] == "tea_cache"
        assert m["steps_computed"] + m["steps_reused"] == 20
        for branch in ("cond/transformer", "uncond/transformer"):
            p = m["cache_branches"][branch]["pattern"]
            assert len(p) == 10 and p[0] == "C" and p[-1] == "C"
            assert m["cache_branches"][branch]["reused"] == p.count("R")
    for a, b in zip(base, cached):
        assert 0 < (a - b).abs().max() < 0.1


@pytest.mark.parametrize("k", [1, 3])
def test_max_consecutive_reuse_bounds_every_run(tiny_dit, tea, k):
    steps = 12
    unbounded = tea(tiny_dit, rel_l1_thresh=1e6)
    free = states(tiny_dit, steps=(steps,))
    output_tensors(tiny_dit, free, unbounded)
    unbounded.disable(tiny_dit)
    bounded = tea(tiny_dit, rel_l1_thresh=1e6, max_consecutive_reuse=k)
    capped = states(tiny_dit, steps=(steps,))
    output_tensors(tiny_dit, capped, bounded)
    longest = lambda st: max(len(r) for p in patterns(st[0]).values() for r in re.findall("R+", p))  # noqa: E731
    assert longest(free) == steps - 2  # everything between the first and the last step
    assert longest(capped) == k
    for p in patterns(capped[0]).values():
        assert p.startswith("C") and p.endswith("C") and "R" * (k + 1) not in p


# ---------------------------------------------------------------------------------------------- per request
def test_batch_decides_per_request(tiny_dit, tea, monkeypatch):
    """Requests batched decide exactly as each alone; only the computing rows run (sliced)."""
    backend = tea(tiny_dit, rel_l1_thresh=THRESH)
    alone, alone_patterns = [], []
    for st in states(tiny_dit):
        alone += output_tensors(tiny_dit, [st], backend)
        alone_patterns.append(patterns(st))
    batched_states = states(tiny_dit)
    batched = output_tensors(tiny_dit, batched_states, backend)
    assert [patterns(s) for s in batched_states] == alone_patterns
    assert len({str(p) for p in alone_patterns}) > 1, "the requests should make different decisions"
    assert backend.mode_counts["slice"] > 0
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    # a model that declares its rows inseparable runs them all and overwrites the reused ones: same results
    backend.disable(tiny_dit)
    (spec,) = tiny_dit.denoisers()
    monkeypatch.setattr(tiny_dit, "denoisers", lambda: [attrs.evolve(spec, rows_separable=False)])
    backend = tea(tiny_dit, rel_l1_thresh=THRESH)
    masked_states = states(tiny_dit)
    masked = output_tensors(tiny_dit, masked_states, backend)
    assert backend.mode_counts["mask"] > 0 and backend.mode_counts["slice"] == 0
    assert [patterns(s) for s in masked_states] == alone_patterns
    for a, b in zip(alone, masked):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


def test_step_wave_requests_at_different_steps_decide_for_themselves(tiny_dit, tea):
    backend = tea(tiny_dit, rel_l1_thresh=THRESH)
    alone, alone_patterns = [], []
    for st in states(tiny_dit, steps=(10, 10, 10)):
        alone += output_tensors(tiny_dit, [st], backend)
        alone_patterns.append(patterns(st))
    waved = states(tiny_dit, steps=(10, 10, 10))
    with torch.inference_mode():
        stepped = [o.tensor for o in run_step_batch(tiny_dit, waved, admit_at=[0, 1, 3], cache_backend=backend)]
    assert [patterns(s) for s in waved] == alone_patterns
    assert backend.mode_counts["slice"] > 0, "staggered requests should reuse at different waves"
    for a, b in zip(alone, stepped):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-batch", "step-batch"])
def test_engine_batch_matches_each_alone(tiny_dit_model, step_execution):
    from omni_core import Omni

    prompts = [{"prompt": p, "negative_prompt": ""} for p in PROMPTS]
    outs = {}
    for n in (3, 1):
        with Omni(tiny_dit_model, dtype="float32", warmup=False, max_num_seqs=n, step_execution=step_execution,
                  cache_backend="tea_cache", cache_config={"rel_l1_thresh": THRESH}) as o:
            outs[n] = o.generate(prompts, seed=3, num_inference_steps=10, use_tqdm=False, output_type="pt")
    if not step_execution:
        assert [o.metrics["batch_size"] for o in outs[3]] == [3] * 3
    for batched, alone in zip(outs[3], outs[1]):
        assert batched.metrics["cache_branches"] == alone.metrics["cache_branches"]
        torch.testing.assert_close(batched.images[0], alone.images[0], atol=2e-4, rtol=0)
    assert sum(o.metrics["steps_reused"] for o in outs[3]) > 0


def test_call_without_denoise_call_is_one_request(tiny_dit, tea):
    """A caller that sets no DenoiseCall (e.g. its own loop) still gets TeaCache, as one request."""
    backend = tea(tiny_dit, rel_l1_thresh=THRESH)
    t = tiny_dit.transformer
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    text = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for step in range(8):
            t(x, torch.full([2], 1000.0 * (1 - step / 10)), text, None)
    from omni_core.hooks import standalone_state

    (tea_state,) = [v for v in standalone_state().values() if hasattr(v, "pattern")]
    assert len(tea_state.pattern) == 8 and tea_state.pattern[0] and not all(tea_state.pattern)


# ---------------------------------------------------------------------------------------------- shipped defaults
def test_folder_cache_defaults_json_overrides_the_spec(tiny_dit_model, tmp_path, tea):
    from omni_core.testing.tiny_dit import TEA_CACHE_DEFAULTS

    folder = shutil.copytree(tiny_dit_model, tmp_path / "model")
    spec_opts = tea(load_model(str(folder))).denoisers["transformer"].options
    assert spec_opts.coefficients == tuple(TEA_CACHE_DEFAULTS["coefficients"])
    (folder / "cache_defaults.json").write_text(json.dumps(
        {"tea_cache": {"coefficients": [3.0, 0.5], "denoisers": {"transformer": {"warmup_steps": 4}}}}))
    backend = tea(load_model(str(folder)), rel_l1_thresh=0.07)
    opts = backend.denoisers["transformer"].options
    assert opts.coefficients == (3.0, 0.5) and opts.warmup_steps == 4 and opts.rel_l1_thresh == 0.07


# ---------------------------------------------------------------------------------------------- calibration
def test_calibrate_fits_writes_and_is_used(tiny_dit_model, tmp_path, capsys, tea):
    """``omni cache calibrate`` on a model it knows nothing about but its spec: prompts from the pipeline,
    a fit over every (request, branch) step pair, the spec snippet printed and the folder's defaults written."""
    from omni_core.cli.main import main

    folder = shutil.copytree(tiny_dit_model, tmp_path / "model")
    out = tmp_path / "coeffs.json"
    code = main(["cache", "calibrate", "--model", str(folder), "--prompts", "2", "--steps", "6", "--dtype",
                 "float32", "--out", str(out), "--write", "--rel-l1-thresh", "0.05"])
    assert code == 0
    result = json.loads(out.read_text())
    assert len(result["coefficients"]) == 5 and result["denoiser"] == "TinyDiTTransformer"
    assert result["num_pairs"] == 20  # 2 prompts x 2 branches x 5 step pairs
    assert set(result["per_branch"]) == {"cond/transformer", "uncond/transformer"}
    printed = capsys.readouterr().out
    assert "cache_defaults={'tea_cache': {'coefficients': (" in printed and "cache_defaults.json" in printed
    shipped = json.loads((folder / "cache_defaults.json").read_text())
    assert shipped == {"tea_cache": {"coefficients": result["coefficients"], "rel_l1_thresh": 0.05}}
    opts = tea(load_model(str(folder))).denoisers["transformer"].options
    assert opts.coefficients == tuple(result["coefficients"]) and opts.rel_l1_thresh == 0.05
