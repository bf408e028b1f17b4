"""The combination matrix's own table: each feature's options and tolerance, the runs that combine them on a
tiny Qwen-Image, which pair each comparison covers, and the table ``docs/architecture.md`` shows (rendered
by :func:`render_table`; ``scripts/doc_tables.py`` writes it, ``tests/combos/test_matrix.py`` checks the
doc equals it and runs every comparison). Refusals come from the core's :mod:`omni_core.combinations`.

How a pair is checked: a *run* is an engine with a set of features on the same requests; a *comparison* is a
run against the run without some of its features (``removed``), every output within the sum of the removed
features' tolerances, and each feature of both runs shows it acted (:data:`EVIDENCE`). A comparison covers
every pair (kept feature, removed feature) and the pairs among the removed ones. Stacking several features
in one run lets one ``world_size`` 2 or 4 engine cover many pairs.

Every run also holds the mixed LoRA wave (adapter a, no adapter, adapter b in one batch) and the same
no-adapter request alone: ``lora`` is checked inside each run (the no-adapter row of the mixed wave equals
it alone within ``lora``'s tolerance; both adapter rows differ from their no-adapter twins by more than
:data:`LORA_EFFECT`), so each run covers the pairs (feature, ``lora``). Request mode is the default: a run
without ``step`` or ``streaming`` is in request mode and covers the pairs (feature, ``request``).

Import-light: no torch.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from omni_core.combinations import PLATFORM_REFUSED, all_features, one_option, refusal

#: the features of the matrix, in the table's order (``lora`` is per request, all others are engine options)
ORDER = ("tea_cache", "cache_dit", "lora", "int8", "gguf", "offload_model", "offload_group", "compile",
         "vae_tiling", "ulysses", "ring", "cfg_parallel", "tensor_parallel", "step", "request", "streaming",
         "encode_apart", "decode_apart")

#: VAE tiles smaller than the 32x32 image (overlapping latent tiles of 2x2): the seams change the output
SMALL_TILES = {"tile_sample_min_height": 16, "tile_sample_min_width": 16, "tile_sample_stride_height": 12,
               "tile_sample_stride_width": 12}

#: a LoRA adapter (std 0.5) must move its rows at least this much (max |diff|) from the same request without it
LORA_EFFECT = 0.02


@attrs.frozen
class MatrixFeature:
    name: str
    #: engine keyword arguments (``"<gguf>"`` stands for the GGUF file the test writes)
    options: dict
    #: largest max |diff| of the float images in [0, 1] allowed between a run with the feature and without it
    tolerance: float
    #: what the tolerance is, for the documentation
    why: str


MATRIX: dict[str, MatrixFeature] = {f.name: f for f in (
    MatrixFeature("tea_cache", {"cache_backend": "tea_cache", "cache_config": {"rel_l1_thresh": 0.45}}, 0.25,
                  "reuses whole denoiser steps: an approximation (threshold 0.45 on the tiny model)"),
    MatrixFeature("cache_dit", {"cache_backend": "cache_dit",
                                "cache_config": {"residual_diff_threshold": 0.5, "max_warmup_steps": 2}}, 0.25,
                  "reuses the middle blocks' residuals: an approximation (threshold 0.5 on the tiny model)"),
    MatrixFeature("lora", {}, 1e-5,
                  "rows without an adapter in a mixed batch equal the request alone (batch-size rounding)"),
    MatrixFeature("int8", {"quantization": "int8"}, 0.05, "torchao int8 weight-only denoiser: quantization error"),
    MatrixFeature("gguf", {"denoiser_weights": "<gguf>"}, 5e-3, "Q8_0 denoiser weights: quantization error"),
    MatrixFeature("offload_model", {"offload": "model"}, 1e-6, "moves weights, not values: exact"),
    MatrixFeature("offload_group", {"offload": "group"}, 1e-6, "moves weights, not values: exact"),
    MatrixFeature("compile", {"compile": True}, 5e-4,
                  "compiled vs eager: float rounding (inductor reorders sums: 1.3e-4 measured with GGUF)"),
    MatrixFeature("vae_tiling", {"vae_tiling": SMALL_TILES}, 0.5,
                  "16 px tiles on a 32 px image: blended seams (random-weight VAE, far from exact)"),
    MatrixFeature("ulysses", {"parallel_config": {"ulysses_degree": 2}}, 1e-4, "equals one process"),
    MatrixFeature("ring", {"parallel_config": {"ring_degree": 2}}, 1e-4, "equals one process"),
    MatrixFeature("cfg_parallel", {"parallel_config": {"cfg_parallel_size": 2}}, 1e-4, "equals one process"),
    MatrixFeature("tensor_parallel", {"parallel_config": {"tensor_parallel_size": 2}}, 1e-5,
                  "equals one process (split matmuls' partial sums add in another order)"),
    MatrixFeature("step", {"step_execution": True}, 1e-5, "step waves vs whole requests: batch rounding"),
    MatrixFeature("request", {}, 0.0, "the default mode"),
    MatrixFeature("streaming", {"streaming_output": True}, 1e-5,
                  "previews read the latents, never change them (streaming runs in step mode)"),
    MatrixFeature("encode_apart", {"encode_workers": 1}, 1e-5,
                  "the same text encoders in their own process: prompts batched differently"),
    MatrixFeature("decode_apart", {"decode_workers": 1}, 1e-5,
                  "the same VAE in its own process: latents decoded in other batches"),
)}

#: what shows a feature acted in a run (``tests/combos/test_matrix.py`` checks each)
EVIDENCE = {
    "tea_cache": "steps_reused > 0", "cache_dit": "steps_reused > 0",
    "lora": "adapter rows differ from their no-adapter twins", "int8": "applied quantization (in-process runs)",
    "gguf": "applied denoiser_weights (in-process runs)", "offload_model": "applied offload (in-process runs)",
    "offload_group": "applied offload (in-process runs)",
    "compile": "compiled block calls > 0 and no fall-back to eager in every output's metrics (every run); "
               "applied compile with the expected backend (in-process runs)",
    "vae_tiling": "applied vae_tiling (in-process runs)", "ulysses": "communication_bytes > 0",
    "ring": "communication_bytes > 0", "cfg_parallel": "communication_bytes > 0",
    "tensor_parallel": "communication_bytes > 0",
    "step": "execution_mode step_batch", "request": "execution_mode request_batch",
    "streaming": "one preview per step",
    "encode_apart": "the encode process encoded every request", "decode_apart": "the decode process decoded every "
                                                                              "request",
}


def run_options(features: frozenset[str] | set[str], gguf_file: str = "<gguf>") -> dict[str, Any]:
    """Engine keyword arguments of a run with ``features`` (parallel degrees merged)."""
    out: dict[str, Any] = {}
    parallel: dict[str, int] = {}
    for name in ORDER:
        if name in features:
            for key, value in MATRIX[name].options.items():
                if key == "parallel_config":
                    parallel.update(value)
                else:
                    out[key] = gguf_file if value == "<gguf>" else value
    if parallel:
        out["parallel_config"] = parallel
        world = 1
        for v in parallel.values():
            world *= v
        if world > 2:
            out["oversubscribe"] = True  # 4 ranks on the 2-core CI machine
    return out


#: the features that each double the ranks of a run
PARALLEL = ("ulysses", "ring", "cfg_parallel", "tensor_parallel")


def world_size(features: frozenset[str] | set[str]) -> int:
    return 2 ** len(set(PARALLEL) & set(features))


def with_adapters(features: frozenset[str] | set[str]) -> bool:
    """Whether a run holds the mixed LoRA wave: not when one of its features refuses LoRA (tensor parallelism);
    such a run submits the same requests without adapters and is compared on the rows that have none."""
    return not any(refusal(f, "lora") for f in features)


def _s(*names: str) -> frozenset[str]:
    return frozenset(names)


A = _s("tea_cache", "int8", "vae_tiling", "step", "streaming")  # step mode, tea_cache, int8
B = _s("cache_dit", "gguf", "vae_tiling")                       # request mode, cache_dit, GGUF
G = _s("gguf", "vae_tiling")                                   # B without cache_dit (SP refuses it)
O = _s("tea_cache", "vae_tiling", "step", "streaming")          # A without int8, for offload
C = _s("compile")

#: the runs: name -> features (every run also has the LoRA waves)
RUNS: dict[str, frozenset[str]] = {
    "base": _s(),
    "T": _s("tea_cache"), "D": _s("cache_dit"), "Q": _s("int8"), "G": _s("gguf"), "V": _s("vae_tiling"),
    "TQ": _s("tea_cache", "int8"), "TQV": _s("tea_cache", "int8", "vae_tiling"),
    "DG": _s("cache_dit", "gguf"), "B": B, "TG": _s("tea_cache", "gguf"), "DQ": _s("cache_dit", "int8"),
    "A1": _s("tea_cache", "int8", "vae_tiling", "step"), "A": A,
    "TV": _s("tea_cache", "vae_tiling"), "TV1": _s("tea_cache", "vae_tiling", "step"), "O": O,
    "O+offload_model": O | {"offload_model"}, "O+offload_group": O | {"offload_group"},
    "B+offload_model": B | {"offload_model"}, "B+offload_group": B | {"offload_group"},
    "Q+offload_model": _s("int8", "offload_model"), "Q+offload_group": _s("int8", "offload_group"),
    "B+streaming": B | {"streaming"}, "B+step": B | {"step"},
    "Gs": G,
    "A+ulysses+ring": A | {"ulysses", "ring"}, "A+cfg": A | {"cfg_parallel"}, "B+cfg": B | {"cfg_parallel"},
    "G+ulysses+cfg": G | {"ulysses", "cfg_parallel"}, "G+ring+cfg": G | {"ring", "cfg_parallel"},
    # compile: with compile_backend(features) (aot_eager; inductor with GGUF, which aot_eager mistraces)
    "G+offload_model": G | {"offload_model"},
    "A+compile": A | C, "DC": _s("cache_dit") | C, "GC+offload_model": G | C | {"offload_model"},
    "DC+offload_group": _s("cache_dit", "offload_group") | C,
    # the parallel compile runs compile plain blocks only: every rank compiles its own graphs on the 2 CI cores
    # and with two ranks each (four ranks compiling on two cores took 131 s in CI, two ranks ~22 s)
    "C": C, "C+ulysses": C | {"ulysses"}, "C+ring": C | {"ring"}, "C+cfg": C | {"cfg_parallel"},
    # tensor parallelism (refuses LoRA: these runs carry no adapters); two ranks, or four with another degree
    "P+O": O | {"tensor_parallel"}, "P+D": _s("cache_dit", "tensor_parallel"),
    "P+ulysses": _s("tensor_parallel", "ulysses"), "P+ring": _s("tensor_parallel", "ring"),
    "P+cfg": _s("tensor_parallel", "cfg_parallel"),
    # stages apart (S: both, E: the encode only, since the decode apart refuses model ranks)
    "S+A": A | {"encode_apart", "decode_apart"}, "S+B": B | {"encode_apart", "decode_apart"},
    "S+C": C | {"encode_apart", "decode_apart"},
    "E+A+ulysses+ring": A | {"ulysses", "ring", "encode_apart"}, "E+B+cfg": B | {"cfg_parallel", "encode_apart"},
    "E+P+O": O | {"tensor_parallel", "encode_apart"},
}

#: the comparisons: (run, reference run); the removed features are the difference
COMPARISONS: list[tuple[str, str]] = [
    ("T", "base"), ("D", "base"), ("Q", "base"), ("G", "base"), ("V", "base"),
    ("TQ", "T"), ("TQV", "TQ"), ("DG", "D"), ("B", "DG"), ("TG", "T"), ("DQ", "D"),
    ("A1", "TQV"), ("A", "A1"), ("TV", "T"), ("TV1", "TV"), ("O", "TV1"),
    ("O+offload_model", "O"), ("O+offload_group", "O"), ("B+offload_model", "B"), ("B+offload_group", "B"),
    ("Q+offload_model", "Q"), ("Q+offload_group", "Q"), ("B+streaming", "B"), ("B+step", "B"),
    ("A+ulysses+ring", "A"), ("A+cfg", "A"), ("B+cfg", "B"), ("G+ulysses+cfg", "Gs"), ("G+ring+cfg", "Gs"),
    ("A+compile", "A"), ("DC", "D"), ("GC+offload_model", "G+offload_model"), ("DC+offload_group", "DC"),
    ("C+ulysses", "C"), ("C+ring", "C"), ("C+cfg", "C"),
    ("P+O", "O"), ("P+D", "D"), ("P+ulysses", "base"), ("P+ring", "base"), ("P+cfg", "base"),
    ("S+A", "A"), ("S+B", "B"), ("S+C", "C"), ("E+A+ulysses+ring", "A+ulysses+ring"), ("E+B+cfg", "B+cfg"),
    ("E+P+O", "P+O"),
]

#: torch.compile's backend for the compile runs: ``aot_eager`` traces what inductor would get (dynamo's graphs
#: around the hooks, guards, AOTAutograd with torchao tensor subclasses) without generating kernels, which cold in
#: CI costs ~100 s per run; inductor itself is tested with the caches in tests/optimize
COMPILE_BACKEND = "aot_eager"
#: dynamo's capture alone (its graphs, graph breaks, guards and recompiles around Omni's hooks, run eagerly) for
#: the runs with GGUF weights -- under aot_eager diffusers' ``GGUFParameter.__torch_function__`` rebuilds a
#: parameter without its quant type on a recompile (``KeyError: None``), and inductor cold took 63 s of CI's run
#: (205 s at load 6) against ~15 s -- and for the multi-rank runs (each rank traces on the 2 CI cores: C+ulysses
#: 58 s vs 83 s at load 6); AOTAutograd is what the one-process runs check
CAPTURE_BACKEND = "eager"


def compile_backend(features: frozenset[str] | set[str]) -> str:
    """The torch.compile backend a run with ``features`` uses (``OMNI_COMPILE_BACKEND``)."""
    return CAPTURE_BACKEND if "gguf" in features or world_size(features) > 1 else COMPILE_BACKEND



def mode_features(features: frozenset[str]) -> frozenset[str]:
    """``features`` with ``request`` added when the run is in request mode (neither step nor streaming)."""
    return features if features & {"step", "streaming"} else features | {"request"}


def removed(run: str, ref: str) -> frozenset[str]:
    out = RUNS[run] - RUNS[ref]
    assert RUNS[ref] <= RUNS[run], f"{ref} is not a subset of {run}"
    return out


def tolerance(features: frozenset[str]) -> float:
    """The sum of the removed features' tolerances."""
    return sum(MATRIX[f].tolerance for f in features)


def pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if ORDER.index(a) < ORDER.index(b) else (b, a)


def coverage() -> dict[tuple[str, str], list[str]]:
    """``{pair: [labels of what covers it]}`` over every pair of :data:`ORDER`. A comparison covers (kept,
    changed) for every feature both runs have and every feature only one has (the removed ones, and
    ``request`` when the run is in step mode and its reference is not), and the pairs among the changed ones;
    the LoRA check inside each run covers (feature, ``lora``) for the run's features."""
    out: dict[tuple[str, str], list[str]] = {pair(a, b): [] for a, b in itertools.combinations(ORDER, 2)}
    for run, ref in COMPARISONS:
        removed(run, ref)  # the reference must be a subset
        lora = {"lora"} if with_adapters(RUNS[run]) and with_adapters(RUNS[ref]) else set()
        mine, theirs = mode_features(RUNS[run]) | lora, mode_features(RUNS[ref]) | lora
        changed, kept = mine ^ theirs, mine & theirs
        for k in kept:
            for g in changed:
                out[pair(k, g)].append(f"{run} vs {ref}")
        for a, b in itertools.combinations(sorted(changed), 2):
            out[pair(a, b)].append(f"{run} vs {ref}")
    for run, feats in RUNS.items():
        if with_adapters(feats):
            for f in mode_features(feats):
                out[pair(f, "lora")].append(f"{run} (lora)")
    return out


def status(a: str, b: str) -> tuple[str, str]:
    """``(status, note)`` of a pair: ``refused`` (core), ``one option``, ``platform`` (refused where ranks
    outnumber devices) or ``combines``."""
    a, b = pair(a, b)
    why = refusal(a, b)
    if why:
        return "refused", why
    note = one_option(a, b)
    if note:
        return "one option", note
    note = PLATFORM_REFUSED.get((a, b)) or PLATFORM_REFUSED.get((b, a))
    if note:
        return "platform", note
    return "combines", ""


SYMBOL = {"combines": "yes", "refused": "no", "one option": "-", "platform": "no*"}


def render_table() -> str:
    """The markdown ``docs/architecture.md`` carries between its ``combination-matrix`` markers."""
    short = {"tea_cache": "tea", "cache_dit": "dit", "lora": "lora", "int8": "int8", "gguf": "gguf",
             "offload_model": "off-m", "offload_group": "off-g", "compile": "comp", "vae_tiling": "tile",
             "ulysses": "uly", "ring": "ring", "cfg_parallel": "cfg", "tensor_parallel": "tp", "step": "step",
             "request": "req", "encode_apart": "enc", "decode_apart": "dec",
             "streaming": "strm"}
    lines = ["| | " + " | ".join(short[f] for f in ORDER) + " |", "|---" * (len(ORDER) + 1) + "|"]
    for a in ORDER:
        cells = [" " if a == b else SYMBOL[status(a, b)[0]] for b in ORDER]
        lines.append(f"| **{short[a]}** | " + " | ".join(cells) + " |")
    counts = {k: 0 for k in SYMBOL}
    for a, b in itertools.combinations(ORDER, 2):
        counts[status(a, b)[0]] += 1
    lines += ["", f"{len(ORDER)} features, {sum(counts.values())} pairs: {counts['combines']} combine, "
              f"{counts['refused']} are refused (`omni_core/combinations.py`, or a cache backend's record), "
              f"{counts['platform']} are refused "
              f"where ranks outnumber devices (`no*`), {counts['one option']} are two values of one option (`-`).",
              "", "| feature | options | tolerance (max \\|diff\\|) | what |", "|---|---|---|---|"]
    features = all_features()
    for name in ORDER:
        f = MATRIX[name]
        opts = features[name].option if name in features else "per request: `lora=` (a mixed batch)"
        lines.append(f"| `{name}` | {opts} | {f.tolerance:g} | {f.why} |")
    lines += ["", "| refused pair | why |", "|---|---|"]
    for a, b in itertools.combinations(ORDER, 2):
        st, note = status(a, b)
        if st != "combines":
            lines.append(f"| `{a}` + `{b}` | {note if st == 'one option' else st + ': ' + note} |")
    return "\n".join(lines) + "\n"
