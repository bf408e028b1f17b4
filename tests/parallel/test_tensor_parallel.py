"""Tensor parallelism (issue #39) through the engine equals one process, and each rank holds and reads a shard.

Each case starts ``Omni(folder, parallel_config={"tensor_parallel_size": 2, ...})`` (``mp`` executor, gloo on CPU)
and runs the same requests as the single-process engine of ``test_engine_parallel`` (cached per model in the
session's ``references``); float32 outputs must agree within 1e-5 and every wave must have communicated.
"""

from __future__ import annotations

import pytest

from tests.parallel.requests import QWEN_REQUESTS, WAN_REQUESTS

pytestmark = pytest.mark.dist

#: TP's partial sums add in another order than one process's matmul: float32 rounding only
TP_TOL = 1e-5

FLUX_REQUESTS = [
    {"prompt": "a red fox jumping over a lazy dog", "height": 32, "width": 48, "num_inference_steps": 2, "seed": 1,
     "guidance_scale": 3.5},
    {"prompt": "a cat", "height": 32, "width": 32, "num_inference_steps": 2, "seed": 2, "guidance_scale": 3.5},
]

#: (parallel_config, engine options)
CONFIGS = {
    "tp2": ({"tensor_parallel_size": 2}, {}),
    "tp2-step": ({"tensor_parallel_size": 2}, {"step_execution": True}),
    "tp2xcfg2": ({"tensor_parallel_size": 2, "cfg_parallel_size": 2}, {"oversubscribe": True}),
    "tp2xulysses2": ({"tensor_parallel_size": 2, "ulysses_degree": 2}, {"oversubscribe": True}),
    # caches decide on the whole (replicated) block streams, so every rank skips the same steps
    "tp2-tea_cache": ({"tensor_parallel_size": 2}, {"cache_backend": "tea_cache",
                                                    "cache_config": {"rel_l1_thresh": 5.0, "warmup_steps": 0}}),
    # the decode split across the two ranks (tiles of 16 pixels): equal to one process's tiled decode
    "tp2-vae_tiling": ({"tensor_parallel_size": 2}, {"vae_tiling": {
        "tile_sample_min_height": 16, "tile_sample_min_width": 16, "tile_sample_stride_height": 8,
        "tile_sample_stride_width": 8}}),
    "tp2-cache_dit": ({"tensor_parallel_size": 2}, {"cache_backend": "cache_dit", "cache_config": {
        "residual_diff_threshold": 5.0, "max_warmup_steps": 1, "Fn_compute_blocks": 1}}),
}
#: engine options that change the output: the single-process reference runs with them too
SAME_IN_REFERENCE = ("cache_backend", "cache_config", "vae_tiling")
#: cached runs need steps to reuse: their requests take this many
CACHE_STEPS = 6
CASES = [("qwen", "tp2"), ("qwen", "tp2-step"), ("wan", "tp2"), ("wan", "tp2-step"), ("flux", "tp2"),
         ("flux", "tp2-step"), ("qwen", "tp2xcfg2"), ("qwen", "tp2xulysses2"), ("wan", "tp2xcfg2"),
         ("wan", "tp2xulysses2"), ("flux", "tp2xulysses2"), ("qwen", "tp2-tea_cache"), ("wan", "tp2-cache_dit"),
         ("wan", "tp2-vae_tiling"), ("qwen", "tp2-vae_tiling")]
#: 4-rank layouts take ~30 s each on 2 cores: one model of each in CI, the rest with the slow checks; Qwen-Image's
#: pairs of TP with step mode, Ulysses, CFG and the caches run in CI in the combination matrix
#: (tests/combos/test_matrix.py: P+O, P+D, P+ulysses, P+ring, P+cfg), so here they repeat it
SLOW = {("wan", "tp2xcfg2"), ("wan", "tp2xulysses2"), ("flux", "tp2xulysses2"), ("wan", "tp2-step"), ("qwen", "tp2xcfg2"),
        ("flux", "tp2-step"), ("wan", "tp2-cache_dit"), ("qwen", "tp2-vae_tiling"), ("qwen", "tp2-step"),
        ("qwen", "tp2xulysses2"), ("qwen", "tp2-tea_cache")}


@pytest.fixture(scope="session")
def flux_tp_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny FLUX.1 with 4 heads, two blocks of each kind."""
    from omni_model_flux.testing import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("flux-tp"), num_layers=2, num_single_layers=2, num_heads=4)


REQUESTS = {"qwen": QWEN_REQUESTS, "wan": WAN_REQUESTS, "flux": FLUX_REQUESTS}


@pytest.mark.parametrize(("model", "config"), [pytest.param(m, c, marks=pytest.mark.slow) if (m, c) in SLOW
                                               else (m, c) for m, c in CASES], ids=[f"{m}-{c}" for m, c in CASES])
def test_tensor_parallel_matches_one_process(model, config, request, engine_run, references):
    folder = request.getfixturevalue({"qwen": "qwen_dir", "wan": "wan_dir", "flux": "flux_tp_dir"}[model])
    requests = REQUESTS[model]
    parallel_config, options = CONFIGS[config]
    if "cache_backend" in options:
        requests = [{**r, "num_inference_steps": CACHE_STEPS} for r in requests]
    same = {k: v for k, v in options.items() if k in SAME_IN_REFERENCE}
    key = f"{model}-{sorted(same.items())}" if same else model  # shared with test_engine_parallel's runs
    if key not in references:
        references[key] = engine_run(folder, requests, **same)
    ref = references[key]
    result = engine_run(folder, requests, parallel_config, **options)
    assert result["executor"] == "MultiProcExecutor"
    for i, (got, want) in enumerate(zip(result["images"], ref["images"])):
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= TP_TOL, f"{model} {config} request {i}: max |diff| {diff:.2e} > {TP_TOL}"
    assert all(m["communication_bytes"] > 0 for m in result["metrics"]), result["metrics"]
    # each rank holds a shard: stats() reports rank 0's transformer bytes (tiny models: embeddings stay whole)
    assert result["model_bytes"]["transformer"] <= 0.8 * ref["model_bytes"]["transformer"], \
        (result["model_bytes"], ref["model_bytes"])
    if "cache_backend" in options:  # the cache acted, on the same steps as in one process
        reused = [m.get("steps_reused") for m in result["metrics"]]
        assert any(reused) and reused == [m.get("steps_reused") for m in ref["metrics"]], (reused, ref["metrics"])


def test_what_tensor_parallelism_does_not_combine_with_is_refused_by_name(tmp_path):
    """Before any worker starts: each refused feature names itself, tensor parallelism and why; LoRA is refused
    for preloaded adapters and per request."""
    from omni_core.combinations import FEATURES, TENSOR_PARALLEL_REFUSED, check_combinations
    from omni_core.config import OmniDiffusionConfig, SamplingParams
    from omni_core.errors import ConfigError
    from omni_core.lora import check_request_lora

    tp = {"tensor_parallel_size": 2}
    options = {"int8": {"quantization": "int8", "quantize_components": ("denoiser",)},
               "gguf": {"denoiser_weights": str(tmp_path / "t.gguf")}, "offload_model": {"offload": "model"},
               "offload_group": {"offload": "group"}, "compile": {"compile": True}}
    assert set(options) == set(TENSOR_PARALLEL_REFUSED)
    for name, kwargs in options.items():
        config = OmniDiffusionConfig(model="shapes", **kwargs)
        check_combinations(config)  # alone it is fine
        with pytest.raises(ConfigError, match="tensor_parallel_size > 1") as info:
            check_combinations(OmniDiffusionConfig(model="shapes", parallel_config=tp, **kwargs))
        assert FEATURES[name].option in str(info.value) and TENSOR_PARALLEL_REFUSED[name] in str(info.value)
    with pytest.raises(ConfigError, match="LoRA adapters are full-size") as info:
        check_combinations(OmniDiffusionConfig(model="shapes", parallel_config=tp, loras={"a": str(tmp_path)}))
    assert info.value.field == "loras"
    with pytest.raises(ConfigError, match="lora='a' cannot be used with parallel_config.tensor_parallel_size") as info:
        check_request_lora(SamplingParams(lora="a"), OmniDiffusionConfig(model="shapes", parallel_config=tp), None,
                           None)
    assert info.value.field == "lora"
    check_combinations(OmniDiffusionConfig(model="shapes", parallel_config=tp, cache_backend="tea_cache"))


def test_a_refused_combination_fails_before_any_worker_starts(qwen_dir):
    import multiprocessing

    from omni_core import Omni
    from omni_core.errors import ConfigError

    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigError, match="compile=True cannot be combined with parallel_config.tensor_parallel_size"):
        Omni(qwen_dir, parallel_config={"tensor_parallel_size": 2}, compile=True, warmup=False)
    assert set(multiprocessing.active_children()) == before
