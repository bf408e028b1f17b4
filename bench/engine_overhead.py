"""Engine overhead: the same pipeline called directly vs through the engine, one image at a time.

    python bench/engine_overhead.py [--model shapes] [--n 20] [--paths direct uni mp one-thread batch]
                                    [--budget 2]

Paths (``--paths``, default ``direct uni mp``):

* ``direct`` -- ``pipeline.forward`` on one request plus post-processing: what the engine wraps;
* ``uni`` / ``mp`` -- ``Omni(model).generate(prompt)`` with the in-process / the multi-process executor
  (1 worker): engine, scheduler, executor and post-processing included;
* ``one-thread`` -- ``uni`` with ``cpu_threads=1`` (one torch thread instead of every usable core);
* ``batch`` -- ``uni`` with ``max_num_seqs=8``: eight prompts in one ``generate``, per image.

Every path is loaded first, then measured interleaved (one request -- one batch for ``batch`` -- on each path per
round, after a warm-up round), so load drift on a shared machine hits them alike. Prints each path's median wall
time per image, its CPU time (this process only: an ``mp`` worker's is not counted), its ratio over ``direct``
(or the first path) and, with ``--budget``, over a latency budget; the header gives the model's settings, the
engine's start-up time and the load average (on a shared machine wall times include waiting for a core, CPU
times do not). Merged from ``bench/shapes_latency.py`` (the ``shapes`` README's latency table:
``--model shapes --paths uni batch one-thread direct --n 10 --budget 2``).
"""

from __future__ import annotations

import os
import statistics
import time

import _common

PROMPTS = ["a red circle in the top left", "a blue square in the center", "a green triangle in the bottom right",
           "a yellow cross in the top right", "a purple circle in the bottom left", "an orange square in the center",
           "a red triangle in the top right", "a blue cross in the bottom left"]
PATHS = ("direct", "uni", "mp", "one-thread", "batch")
LABELS = {"direct": "direct pipeline.forward", "uni": "engine, uni executor", "mp": "engine, mp executor (1 worker)",
          "one-thread": "engine, uni, cpu_threads=1", "batch": "engine, uni, 8 in one batch, per image"}
BATCH = 8


class Direct:
    """``pipeline.forward`` on one request, plus post-processing: what the engine wraps."""

    def __init__(self, model: str, threads: int | None) -> None:
        import torch

        from omni_core.config import OmniDiffusionConfig
        from omni_core.pipelines import load_pipeline, resolve_model

        if threads:
            torch.set_num_threads(threads)
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
    p.add_argument("--n", type=int, default=20, help="timed rounds (after one warm-up round)")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=["direct", "uni", "mp"], help="paths to measure")
    p.add_argument("--budget", type=float, default=None, help="a latency budget in seconds to compare against")
    args = p.parse_args()
    model = _common.resolve(args)
    params = _common.sampling(args)
    cfg = _common.engine_config(args)
    engines, runs = [], {}
    startup = None
    for name in args.paths:
        if name == "direct":
            runs[name] = (1, Direct(model, args.cpu_threads))
            continue
        kw = {"executor": "mp"} if name == "mp" else {"cpu_threads": 1} if name == "one-thread" else {}
        if name == "batch":
            kw["max_num_seqs"] = BATCH
        t0 = time.perf_counter()
        omni = Omni(model, warmup=True, **{**cfg, **kw})
        if name == "uni":
            startup = time.perf_counter() - t0
        engines.append(omni)
        if name == "batch":
            runs[name] = (BATCH, lambda prompt, sp, omni=omni: omni.generate(
                [prompt] + PROMPTS[1:BATCH], sp, use_tqdm=False))
        else:
            runs[name] = (1, lambda prompt, sp, omni=omni: omni.generate(prompt, sp, use_tqdm=False))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    try:
        for i in range(args.n + 1):
            for name, (per, run) in runs.items():
                wall, cpu = time.perf_counter(), time.process_time()
                run(PROMPTS[i % len(PROMPTS)], params.replace(seed=i))
                if i:  # round 0 warms every path up
                    times[name].append(((time.perf_counter() - wall) / per, (time.process_time() - cpu) / per))
    finally:
        for omni in engines:
            omni.close()
    base_name = "direct" if "direct" in times else next(iter(times))
    base = statistics.median(w for w, _ in times[base_name])
    print(f"model={args.model or 'tiny test pipeline'} rounds={args.n} per path (medians, interleaved); "
          f"{_common.thread_header(args)} on {os.cpu_count()} cores"
          + (f"; engine start-up {startup:.1f} s" if startup is not None else ""))
    print(f"{'path':40} {'ms/image':>9} {'cpu ms':>8} {'vs ' + base_name:>12}"
          + (f" {'vs budget':>10}" if args.budget else ""))
    for name, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(f"{LABELS[name]:40} {wall * 1e3:9.2f} {cpu * 1e3:8.2f} {wall / base:11.2f}x"
              + (f" {wall / args.budget:9.2f}x" if args.budget else ""))


if __name__ == "__main__":
    main()
