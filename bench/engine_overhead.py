"""Engine overhead: the same pipeline called directly vs through the engine (uni and mp executors).

    python bench/engine_overhead.py [--model shapes] [--n 20]

All three paths are loaded first, then measured interleaved (one request on each path per round), so
load drift on a shared machine hits them alike. Prints the median latency per request of each path and
its ratio over the direct call.
"""

from __future__ import annotations

import statistics
import time

import _common


class Direct:
    """``pipeline.forward`` on one request, plus post-processing: what the engine wraps."""

    def __init__(self, model: str) -> None:
        import torch

        from omni_core.config import OmniDiffusionConfig
        from omni_core.pipelines import load_pipeline, resolve_model

        self.torch = torch
        self.resolved = resolve_model(model)
        self.cls = self.resolved.pipeline_cls()
        self.pipe = load_pipeline(self.resolved, OmniDiffusionConfig(model=model), torch.device("cpu"), torch.float32)

    def __call__(self, prompt: str, params) -> None:
        from omni_core.pipelines import StepState
        from omni_core.request import OmniDiffusionRequest

        params = self.cls.check_sampling_params(params, self.resolved.model_path)
        req = OmniDiffusionRequest(prompt=prompt, sampling_params=params)
        with self.torch.inference_mode():
            (res,) = self.pipe.forward([StepState(request=req, generator=self.torch.Generator().manual_seed(params.seed))])
        self.cls.post_process(res, req)


def main() -> None:
    from omni_core import Omni

    p = _common.parser(__doc__)
    p.add_argument("--n", type=int, default=20)
    args = p.parse_args()
    model = _common.resolve(args)
    params = _common.sampling(args)
    uni = Omni(model, warmup=True)
    mp = Omni(model, executor="mp", warmup=True)
    paths = {"direct pipeline.forward": Direct(model),
             "engine, uni executor": lambda prompt, sp: uni.generate(prompt, sp, use_tqdm=False),
             "engine, mp executor (1 worker)": lambda prompt, sp: mp.generate(prompt, sp, use_tqdm=False)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for i in range(args.n + 1):
            for name, run in paths.items():
                t0 = time.perf_counter()
                run(f"prompt {i}", params.replace(seed=i))
                if i:  # round 0 warms every path up
                    times[name].append(time.perf_counter() - t0)
    finally:
        uni.close()
        mp.close()
    base = statistics.median(times["direct pipeline.forward"])
    print(f"model={args.model or 'tiny test pipeline'} requests={args.n} per path (medians, interleaved)")
    print(f"{'path':34} {'ms/request':>11} {'vs direct':>10}")
    for name, lat in times.items():
        med = statistics.median(lat)
        print(f"{name:34} {med * 1e3:11.2f} {med / base:9.2f}x")


if __name__ == "__main__":
    main()
