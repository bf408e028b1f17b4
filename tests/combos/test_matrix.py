"""The combination matrix (issue #35): every pair of {tea_cache, cache_dit, mixed LoRA batch, int8, GGUF, offload
model/group, compile, VAE tiling, Ulysses-2, Ring-2, CFG-2, TP-2, step mode, request mode, streaming} either
gives the output of the same run without the second feature within that feature's tolerance, or is refused before
any work with a ConfigError naming both options. Tensor parallelism refuses LoRA, so its runs carry the same
requests without adapters and are compared on those rows (``NO_ADAPTER_ROWS``).

The table (features, tolerances, runs, comparisons) is ``omni_core/testing/combination_matrix.py``; refusals are
the core's ``omni_core/combinations.py``. Runs are computed once per worker (a module fixture) and shared by the
comparisons that need them, which therefore share an xdist group (:func:`_group`); the world-size 2 and 4 engines
stack features so that three of them cover the parallel pairs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from omni_core.testing import combination_matrix as M

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
SIZE = dict(height=32, width=32, num_inference_steps=STEPS, true_cfg_scale=4.0)
#: wave 1: one CFG request; wave 2: the mixed LoRA batch (adapter a, none, adapter b); wave 3: the
#: no-adapter request of wave 2 alone
P0, P1 = "a red fox jumping over a lazy dog", "a cat on a sofa"
NEG = "blurry, low quality"


@pytest.fixture(scope="module")
def qwen4_dir(tmp_path_factory) -> str:
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("matrix-qwen4"), num_layers=2, num_heads=4)


@pytest.fixture(scope="module")
def matrix_files(qwen4_dir, tmp_path_factory) -> dict[str, str]:
    from diffusers import QwenImageTransformer2DModel

    from omni_core.lora.testing import make_lora
    from omni_core.optimize.quantize import write_gguf

    root = tmp_path_factory.mktemp("matrix-files")
    tr = QwenImageTransformer2DModel.from_pretrained(os.path.join(qwen4_dir, "transformer"))
    targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    return {"gguf": write_gguf(tr, str(root / "transformer-q8_0.gguf"), arch="qwen_image"),
            "a": make_lora(qwen4_dir, str(root / "a"), rank=4, seed=1, std=0.5, targets=targets),
            "b": make_lora(qwen4_dir, str(root / "b"), rank=4, seed=2, std=0.5, targets=targets)}


def _collect(stream) -> tuple[object, int]:
    previews = 0
    while not (out := stream.get(timeout=300)).finished:
        previews += out.preview is not None
    return out, previews


def run_matrix(model: str, features: frozenset[str], files: dict[str, str]) -> dict:
    """One engine with ``features`` on the three waves; images (float, one per request), metrics, previews,
    the execution mode and, in process, what the loader applied."""
    import torch

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    if "compile" in features:
        torch._dynamo.reset()  # a fresh cache per engine: never past dynamo's recompile limit
    options = M.run_options(features, files["gguf"])

    def req(prompt, seed, lora=None):
        return OmniDiffusionRequest(prompt=prompt, negative_prompt=NEG, sampling_params=SamplingParams(
            seed=seed, output_type="pt", lora=lora, **SIZE))

    if M.with_adapters(features):
        waves = [[req(P0, 1)], [req(P1, 2, files["a"]), req(P1, 2), req(P0, 1, files["b"])], [req(P1, 2)]]
    else:  # the same waves without the adapter rows (NO_ADAPTER_ROWS)
        waves = [[req(P0, 1)], [req(P1, 2), req(P0, 1)], [req(P1, 2)]]
    t0 = time.monotonic()
    outs, previews = [], []
    with Omni(model, dtype="float32", warmup=False, max_num_seqs=3, max_lora_rank=8, **options) as omni:
        for wave in waves:
            for stream in omni.engine.submit(wave):
                out, n = _collect(stream)
                outs.append(out)
                previews.append(n)
        stats = omni.stats()
        runner = getattr(omni.engine.executor, "runner", None)
        pipeline = getattr(runner, "pipeline", None)
        applied = dict(getattr(pipeline, "omni_optimizations", {}) or {}) if pipeline is not None else None
        compile_failed = getattr(getattr(pipeline, "omni_compile", None), "failed", None)
    errors = [f"request {i}: {o.error}" for i, o in enumerate(outs) if o.status != "completed"]
    assert not errors, f"{sorted(features)}: {errors}"
    return {"images": [torch.stack(list(o.images)).float() for o in outs], "metrics": [dict(o.metrics) for o in outs],
            "previews": previews, "mode": stats["execution_mode"], "applied": applied,
            "stages": {name: stage["done"] for name, stage in stats.get("stages", {}).items()},
            "compile_failed": compile_failed, "seconds": time.monotonic() - t0}


@pytest.fixture(scope="module")
def matrix_run(qwen4_dir, matrix_files):
    """Runs by name, each computed once; compile runs with torch.compile's ``M.compile_backend`` (the worker
    processes inherit the environment)."""
    cache: dict[str, dict] = {}
    before = os.environ.get("OMNI_COMPILE_BACKEND")

    def get(name: str) -> dict:
        if name not in cache:
            os.environ["OMNI_COMPILE_BACKEND"] = M.compile_backend(M.RUNS[name])
            cache[name] = run_matrix(qwen4_dir, M.RUNS[name], matrix_files)
            check_evidence(name, M.RUNS[name], cache[name])
        return cache[name]

    yield get
    if before is None:
        os.environ.pop("OMNI_COMPILE_BACKEND", None)
    else:
        os.environ["OMNI_COMPILE_BACKEND"] = before


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


#: a run without adapters has outputs 0-3: the requests of rows 0, 2, 0 (row 3 without its adapter) and 4 of a
#: run with them
NO_ADAPTER_ROWS = (0, 2, 0, 4)


def paired_images(got: dict, want: dict) -> list[tuple]:
    """The images of the same requests in two runs (only the rows without an adapter when one run has none)."""
    a, b = got["images"], want["images"]
    if len(a) == len(b):
        return list(zip(a, b))
    if len(a) < len(b):
        return [(x, b[i]) for x, i in zip(a, NO_ADAPTER_ROWS)]
    return [(a[i], y) for i, y in zip(NO_ADAPTER_ROWS, b)]


def check_evidence(name: str, features: frozenset[str], result: dict) -> None:
    """Each feature of the run acted (so a pair that silently dropped one fails), and the LoRA check."""
    problems = []
    metrics, applied = result["metrics"], result["applied"]
    for cache in ("tea_cache", "cache_dit"):
        if cache in features and not sum(m.get("steps_reused", 0) for m in metrics):
            problems.append(f"{cache}: no step was reused")
    if set(M.PARALLEL) & features:
        if not all(m.get("communication_bytes") for m in metrics):
            problems.append(f"parallel: communication_bytes {[m.get('communication_bytes') for m in metrics]}")
    if "compile" in features:  # from the workers' outputs: holds for the multi-rank runs too
        ran = [(m.get("compiled_block_calls"), m.get("compile_failed")) for m in metrics]
        if not all(calls and failed is None for calls, failed in ran):
            problems.append(f"compile: (compiled block calls, fall-back reason) per output {ran}")
    for stage in ("encode", "decode"):  # a stage apart did every request's work, and only then
        done = result["stages"].get(stage, 0)
        if (f"{stage}_apart" in features) != (done >= len(metrics)):
            problems.append(f"{stage} process: {done} done for {len(metrics)} requests")
    step = bool(features & {"step", "streaming"})
    if result["mode"] != ("step_batch" if step else "request_batch"):
        problems.append(f"execution mode {result['mode']}")
    want_previews = [STEPS if "streaming" in features else 0] * len(result["previews"])
    if result["previews"] != want_previews:
        problems.append(f"previews {result['previews']}, expected {want_previews}")
    if applied is not None:  # in process: what the loader applied
        expect = {"int8": "quantization", "gguf": "denoiser_weights", "compile": "compile",
                  "offload_model": "offload", "offload_group": "offload", "vae_tiling": "vae_tiling"}
        for feature, key in expect.items():
            if feature == "vae_tiling" and "decode_apart" in features:
                continue  # applied in the decode process: the run equals its in-line reference, which tiles
            if feature in features and key not in applied:
                problems.append(f"{feature}: {key} not applied ({sorted(applied)})")
        if "compile" in features and applied.get("backend") != M.compile_backend(features):
            problems.append(f"compile ran with backend {applied.get('backend')!r}, not {M.compile_backend(features)!r}")
        if "compile" in features and result["compile_failed"]:
            problems.append(f"compile fell back to eager: {result['compile_failed']}")
        for mode in ("model", "group"):
            if f"offload_{mode}" in features and applied.get("offload") != mode:
                problems.append(f"offload_{mode}: applied offload={applied.get('offload')!r}")
    images = result["images"]
    if not M.with_adapters(features):
        assert not problems, f"run {name} {sorted(features)}: " + "; ".join(problems)
        return
    alone = max_diff(images[2], images[4])  # the no-adapter row of the mixed wave vs alone
    if not alone <= M.MATRIX["lora"].tolerance:
        problems.append(f"lora: the no-adapter row of the mixed batch differs from it alone by {alone:.3g}")
    for row, twin, which in ((1, 2, "a"), (3, 0, "b")):
        effect = max_diff(images[row], images[twin])
        if not effect > M.LORA_EFFECT:
            problems.append(f"lora: adapter {which} moved its row by only {effect:.3g}")
    assert not problems, f"run {name} {sorted(features)}: " + "; ".join(problems)


#: comparisons that fail today because of a bug (not a refusal): (run, ref) -> the bug; strict, so a fix shows
KNOWN_BUGS: dict[tuple[str, str], str] = {}

#: comparisons CI leaves to ``-m slow`` (every one still runs there), and why each repeats one CI runs: the
#: sequence-parallel strategy runs eagerly around the compiled blocks (``torch.compiler.disable`` in
#: ``omni_core/attention/layer.py``), so two-rank compile meets Ring and CFG-parallel where it meets Ulysses -- a
#: compiled block per rank with its own graphs -- and C+ulysses, the costliest of the three, runs in CI
SLOW_REPEATS: dict[tuple[str, str], str] = {
    ("C+ring", "C"): "repeats C+ulysses for compile (the strategy is eager; ring's own merge: A+ulysses+ring)",
    ("C+cfg", "C"): "repeats C+ulysses for compile (two ranks, one compiled block each; CFG-parallel: A+cfg, B+cfg)",
}


def _group(run: str, ref: str) -> str:
    """The test-run group of a comparison (``pytest -n``: a group runs on one worker, computing each of its runs
    once): the compile runs are most of this file's time, so they make groups of their own (parallel ones apart).
    The parallel group computes C once for the cells compared with it (split test by test, two workers each compiled
    C), the stages' S+C included."""
    features = M.RUNS[run]
    if "tensor_parallel" in features:
        return "matrix-tp"
    if "compile" not in features:
        return "matrix"
    return "matrix-compile-parallel" if M.world_size(features) > 1 or ref == "C" else "matrix-compile"


#: the order the groups are collected, hence dealt to the workers (``conftest.py`` deals groups in collection
#: order): the most expensive first, so the two-rank compile runs never start last on one worker
GROUP_ORDER = ("matrix-compile-parallel", "matrix-compile", "matrix-tp", "matrix")


def _params():
    for run, ref in sorted(M.COMPARISONS, key=lambda c: GROUP_ORDER.index(_group(*c))):  # stable: table order
        marks = [pytest.mark.xdist_group(_group(run, ref))]
        if (run, ref) in KNOWN_BUGS:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[(run, ref)]))
        if (run, ref) in SLOW_REPEATS:
            marks.append(pytest.mark.slow)
        yield pytest.param(run, ref, marks=marks, id=f"{run}-vs-{ref}")


@pytest.mark.parametrize(("run", "ref"), list(_params()))
def test_pair_matches_the_run_without_it(run, ref, matrix_run):
    gone = M.removed(run, ref)
    tol = M.tolerance(gone)
    got, want = matrix_run(run), matrix_run(ref)
    diffs = [max_diff(a, b) for a, b in paired_images(got, want)]
    print(f"{run} vs {ref} (-{sorted(gone)}): max diffs {['%.3g' % d for d in diffs]} tol {tol:g}; "
          f"{got['seconds']:.1f} s")
    assert max(diffs) <= tol, f"{run} vs {ref}: removing {sorted(gone)} changed the images by {diffs} > {tol:g}"


REFUSED = [(a, b) for a, b in M.coverage() if M.status(a, b)[0] in ("refused", "platform")]


@pytest.mark.xdist_group("matrix")  # on the worker that already holds the module's model folder and files
@pytest.mark.parametrize(("a", "b"), REFUSED, ids=[f"{a}+{b}" for a, b in REFUSED])
def test_refused_pair_before_any_worker(a, b, qwen4_dir, matrix_files, monkeypatch):
    from omni_core import Omni
    from omni_core.combinations import all_features
    from omni_core.errors import ConfigError
    from omni_core.executor.mp import MultiProcExecutor
    from omni_core.executor.uni import UniProcExecutor

    def no_start(self):
        raise AssertionError("a worker started for a refused pair")

    for cls in (UniProcExecutor, MultiProcExecutor):
        monkeypatch.setattr(cls, "start", no_start)
    options = M.run_options({a, b}, matrix_files["gguf"])
    if "lora" in (a, b):  # per request: refused at start-up when preloaded (a request naming one: tests/lora)
        options["loras"] = {"a": matrix_files["a"]}
    with pytest.raises(ConfigError) as exc:
        Omni(qwen4_dir, dtype="float32", warmup=False, **options)
    message = str(exc.value)
    kind, _ = M.status(a, b)
    if kind == "refused":
        features = all_features()
        names = [features[f].option if f in features else "loras" for f in (a, b)]
        assert all(n in message for n in names), message
    else:  # check_offload: names offload and the parallel strategy it cannot place
        strategy = {"ulysses": "ulysses 2", "ring": "ring 2", "cfg_parallel": "cfg 2"}[b if b in ("ulysses", "ring", "cfg_parallel") else a]
        assert "offload=" in message and f"parallel_config {strategy}" in message, message


def test_every_pair_is_covered_or_refused():
    cov = M.coverage()
    uncovered = [p for p, how in cov.items() if M.status(*p)[0] == "combines" and not how]
    assert not uncovered, f"pairs no comparison covers: {uncovered}"
    assert set(cov) == {M.pair(a, b) for i, a in enumerate(M.ORDER) for b in M.ORDER[i + 1:]}


def test_architecture_doc_carries_the_generated_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts" / "doc_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert mod.current(doc, "combination-matrix") == M.render_table(), \
        "docs/architecture.md is stale: run scripts/doc_tables.py"
