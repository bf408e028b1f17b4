"""Tensor parallelism (issue #39) through the engine equals one process, and each rank holds and reads a shard.

Each case starts ``Omni(folder, parallel_config={"tensor_parallel_size": 2, ...})`` (``mp`` executor, gloo on CPU)
and runs the same requests as the single-process engine of ``test_engine_parallel`` (cached per model in the
session's ``references``); float32 outputs must agree within 1e-5 and every wave must have communicated.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dist

#: TP's partial sums add in another order than one process's matmul: float32 rounding only
TP_TOL = 1e-5

#: tiny Qwen-Image (VAE factor 4, 2x2 packing): a CFG pair with prompts of different token lengths, one without
QWEN_REQUESTS = [
    {"prompt": "a red fox jumping over a lazy dog in the snow", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
     "height": 24, "width": 40, "num_inference_steps": 2, "seed": 1},
    {"prompt": "an astronaut riding a horse", "height": 32, "width": 32, "num_inference_steps": 2, "seed": 3},
]
#: tiny Wan 2.2 (two experts): three steps cross the boundary; one request with CFG, one without
WAN_REQUESTS = [
    {"prompt": "a red fox in the snow", "negative_prompt": "blurry", "guidance_scale": 4.0, "guidance_scale_2": 3.0,
     "height": 16, "width": 48, "num_frames": 9, "num_inference_steps": 3, "seed": 1},
    {"prompt": "a cat", "guidance_scale": 1.0, "guidance_scale_2": 1.0, "height": 32, "width": 32, "num_frames": 5,
     "num_inference_steps": 3, "seed": 2},
]
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
}
CASES = [("qwen", "tp2"), ("qwen", "tp2-step"), ("wan", "tp2"), ("wan", "tp2-step"), ("flux", "tp2"),
         ("flux", "tp2-step"), ("qwen", "tp2xcfg2"), ("qwen", "tp2xulysses2"), ("wan", "tp2xcfg2"),
         ("wan", "tp2xulysses2"), ("flux", "tp2xulysses2")]
#: 4-rank layouts take ~30 s each on 2 cores: one model of each in CI, the rest with the slow checks
SLOW = {("wan", "tp2xcfg2"), ("wan", "tp2xulysses2"), ("flux", "tp2xulysses2"), ("wan", "tp2-step"),
        ("flux", "tp2-step")}


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
    key = f"tp-{model}"  # this file's requests: their own single-process reference
    if key not in references:
        references[key] = engine_run(folder, requests)
    ref = references[key]
    parallel_config, options = CONFIGS[config]
    result = engine_run(folder, requests, parallel_config, **options)
    assert result["executor"] == "MultiProcExecutor"
    for i, (got, want) in enumerate(zip(result["images"], ref["images"])):
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= TP_TOL, f"{model} {config} request {i}: max |diff| {diff:.2e} > {TP_TOL}"
    assert all(m["communication_bytes"] > 0 for m in result["metrics"]), result["metrics"]
