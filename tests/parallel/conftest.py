"""Engine-level parallelism checks: helpers to run one engine over a set of requests and compare outputs.

Every check starts a real engine (``Omni(model, parallel_config=...)``; the executor is chosen from the world
size: ``uni`` for one process, ``mp`` with gloo workers otherwise) and submits all its requests at once, so one
engine start (the expensive part) covers several prompts, sizes and CFG settings.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: float32 outputs (before 8-bit conversion) of a parallel run must match one process this closely
TOL = 1e-4


def run_engine(model: str, requests: list[dict], parallel_config: dict | None = None, **engine_kwargs: Any
               ) -> dict[str, Any]:
    """Start ``Omni(model, parallel_config=...)``, submit every request (dicts: ``prompt``, optional
    ``negative_prompt``, the rest SamplingParams fields), wait for all. Returns ``images`` (one float tensor
    per request), ``metrics``, ``executor`` and ``worker_pids``."""
    import torch

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    plain = engine_kwargs.pop("plain", False)  # exactly Omni(model, parallel_config=...), nothing else
    kwargs = {} if plain else {"dtype": "float32", "warmup": False, "max_num_seqs": 4, **engine_kwargs}
    with Omni(model, parallel_config=parallel_config or {}, **kwargs) as omni:
        engine = omni.engine
        streams = []
        for spec in requests:
            spec = dict(spec)
            prompt, negative = spec.pop("prompt"), spec.pop("negative_prompt", None)
            params = SamplingParams(output_type="pt", **spec)
            streams.extend(engine.submit([OmniDiffusionRequest(prompt=prompt, negative_prompt=negative,
                                                               sampling_params=params)]))
        finals = []
        for stream in streams:
            while not (out := stream.get(timeout=300)).finished:
                pass
            finals.append(out)
        pids = engine.executor.worker_pids() if hasattr(engine.executor, "worker_pids") else []
        alive = [p for p in multiprocessing.active_children() if p.pid in pids]
        executor = type(engine.executor).__name__
        model_bytes = engine.stats()["model_bytes"]  # one rank's parameter bytes per component
    errors = [o.error for o in finals if o.status == "error"]
    assert not errors, errors
    return {"images": [torch.stack(list(o.images)).float() for o in finals],
            "metrics": [dict(o.metrics) for o in finals], "executor": executor, "worker_pids": pids,
            "alive_workers": len(alive), "model_bytes": model_bytes}


def uses_cfg(spec: dict) -> bool:
    """Whether a request runs a negative branch (Qwen-Image: true_cfg_scale > 1 with a negative prompt;
    Wan and shapes: guidance_scale > 1)."""
    if "true_cfg_scale" in spec:
        return spec["true_cfg_scale"] > 1 and spec.get("negative_prompt") is not None
    return spec.get("guidance_scale", 1.0) > 1


def compare(label: str, result: dict, reference: dict, requests: list[dict], *, communicates: Any) -> list[str]:
    """Problems of a parallel run against the single-process reference (empty when it matches): image
    shapes and values within ``TOL``, and whether each request's waves really communicated (a plan that
    silently did nothing would still match one process). ``communicates``: a bool, or one per request."""
    if isinstance(communicates, bool):
        communicates = [communicates] * len(requests)
    problems = []
    for i, (got, ref, spec) in enumerate(zip(result["images"], reference["images"], requests)):
        if got.shape != ref.shape:
            problems.append(f"{label} request {i} {spec}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
            continue
        diff = float((got - ref).abs().max())
        result.setdefault("diffs", []).append(diff)
        if not diff <= TOL:
            problems.append(f"{label} request {i} {spec}: max |diff| {diff:.3g} > {TOL}")
    sent = [m.get("communication_bytes") for m in result["metrics"]]
    if [bool(s) for s in sent] != list(communicates):
        problems.append(f"{label}: expected communication per request {list(communicates)}, got "
                        f"communication_bytes={sent}")
    return problems


@pytest.fixture(scope="session")
def engine_run():
    """:func:`run_engine` (test modules cannot import conftest under ``--import-mode=importlib``)."""
    return run_engine


@pytest.fixture(scope="session")
def engine_compare():
    """:func:`compare`."""
    return compare


@pytest.fixture(scope="session")
def request_uses_cfg():
    """:func:`uses_cfg`."""
    return uses_cfg


@pytest.fixture(scope="session")
def references() -> dict:
    """Single-process outputs, computed once per session and model: ``{key: run_engine result}``."""
    return {}


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Qwen-Image with 4 heads (Ulysses 2 and 4 divide it)."""
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen4"), num_heads=4)


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Wan 2.2 (two experts, boundary_ratio) with 4 heads."""
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan22"), two_experts=True, num_heads=4)


@pytest.fixture(scope="session")
def shapes_model() -> str:
    """The shipped, trained ``shapes`` model, by its registered name."""
    return "shapes"
