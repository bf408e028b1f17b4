"""Engine overhead: the same pipeline called directly vs through the engine (uni and mp executors).

    python bench/engine_overhead.py [--model shapes] [--n 20]

Prints per-request latency of each path and its ratio over the direct call, measured in one run.
"""

from __future__ import annotations

import statistics
import time

import _common


def direct_latencies(model: str, params, n: int) -> list[float]:
    import torch

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import StepState, load_pipeline, resolve_model
    from omni_core.request import OmniDiffusionRequest

    config = OmniDiffusionConfig(model=model)
    resolved = resolve_model(model)
    cls = resolved.pipeline_cls()
    params = cls.check_sampling_params(params, resolved.model_path)
    pipe = load_pipeline(resolved, config, torch.device("cpu"), torch.float32)
    out = []
    for i in range(n + 1):
        req = OmniDiffusionRequest(prompt=f"prompt {i}", sampling_params=params.replace(seed=i))
        t0 = time.perf_counter()
        with torch.inference_mode():
            (res,) = pipe.forward([StepState(request=req, generator=torch.Generator().manual_seed(i))])
        cls.post_process(res, req)
        if i:  # the first call warms up
            out.append(time.perf_counter() - t0)
    return out


def engine_latencies(model: str, params, n: int, **config) -> list[float]:
    from omni_core import Omni

    out = []
    with Omni(model, **config) as omni:
        for i in range(n):
            t0 = time.perf_counter()
            omni.generate(f"prompt {i}", params.replace(seed=i), use_tqdm=False)
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--n", type=int, default=20)
    args = p.parse_args()
    model = _common.resolve(args)
    params = _common.sampling(args)
    rows = [("direct pipeline.forward", direct_latencies(model, params, args.n))]
    rows.append(("engine, uni executor", engine_latencies(model, params, args.n)))
    rows.append(("engine, mp executor (1 worker)", engine_latencies(model, params, args.n, executor="mp")))
    base = statistics.median(rows[0][1])
    print(f"model={args.model or 'tiny test pipeline'} requests={args.n} (medians)")
    print(f"{'path':34} {'ms/request':>11} {'vs direct':>10}")
    for name, lat in rows:
        med = statistics.median(lat)
        print(f"{name:34} {med * 1e3:11.2f} {med / base:9.2f}x")


if __name__ == "__main__":
    main()
