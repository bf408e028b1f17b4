"""What batching can gain on this machine, with no engine: the model's own step time at batch 1 and at larger
waves, split across the cores as the runner splits them, against the FLOPs per step and the cores' FLOP/s.

    python bench/batch_bound.py --model shapes [--batches 1 4 8] [--rounds 7] [--cpu-threads N]

Loads the pipeline once in this process (the engine's thread policy, one model thread: nothing else here opens
an OpenMP team), encodes ``max(--batches)`` requests, then per round times ``--reps`` denoising steps of each
batch size through ``CpuLanes.map`` (what ``ModelRunner`` calls: a wave of one runs as one call with every
thread, a larger one as one sub-batch per core). Prints, per batch size, the median step time, the time per
request and the gain per request over batch 1 (the median over rounds of the paired ratio): the most a
``max_num_seqs`` of that size can give over serial execution, before any engine cost. Then FLOPs per request
step (``torch.utils.flop_counter``) and the dense fp32 GEMM rate of one and of all threads, to say how far from
compute-bound a step is.
"""

from __future__ import annotations

import os
import statistics
import time

import _common


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10, help="denoising steps timed per batch size and round")
    args = p.parse_args()

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines.loader import load_pipeline, resolve_model
    from omni_core.platforms.threads import apply_thread_policy
    from omni_core.testing.driver import make_state
    from omni_core.worker.lanes import CpuLanes, lanes_allowed
    from omni_core.worker.timing import WaveClock

    model = _common.resolve(args)
    config = OmniDiffusionConfig.from_kwargs(model=model, **_common.engine_config(args))
    threads = apply_thread_policy(config)
    pipe = load_pipeline(resolve_model(model), config, torch.device("cpu"), torch.float32)
    lanes = CpuLanes(threads, enabled=lanes_allowed(config, pipe, torch.device("cpu")))
    params = _common.sampling(args)
    kw = {k: v for k, v in (("num_inference_steps", params.num_inference_steps), ("height", params.height),
                            ("width", params.width)) if v is not None}
    batches = sorted(set(args.batches) | {1})
    with torch.inference_mode():
        states = [make_state(pipe, f"a red circle in the top left {i}", seed=i, **kw) for i in range(max(batches))]
        for state in states:
            pipe.prepare_encode(state)

        def step_ms(b: int) -> float:
            wave = states[:b]
            t0 = time.perf_counter()
            for _ in range(args.reps):
                lanes.map(pipe.denoise_step, wave, WaveClock())
            return (time.perf_counter() - t0) / args.reps * 1e3

        for b in batches:
            step_ms(b)  # warm up every shape
        times: dict[int, list[float]] = {b: [] for b in batches}
        for r in range(args.rounds):
            for b in (batches if r % 2 == 0 else batches[::-1]):
                times[b].append(step_ms(b))
        with FlopCounterMode(display=False) as counter:
            pipe.denoise_step(states[:1])
        flops = counter.get_total_flops()
    lanes.shutdown()

    def gemm_gflops(n_threads: int) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(n_threads)
        a = torch.randn(1024, 1024)
        a @ a
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        rate = 20 * 2 * 1024 ** 3 / (time.perf_counter() - t0) / 1e9
        torch.set_num_threads(before)
        return rate

    print(f"model={args.model or 'tiny test pipeline'}; {_common.thread_header(args)}; lanes "
          f"{'on' if lanes.enabled else 'off'}; {args.rounds} rounds x {args.reps} steps")
    print(f"{'batch':>5} {'lanes':>5} {'ms/step':>8} {'ms/request':>10} {'gain/request vs batch 1':>24}")
    for b in batches:
        step = statistics.median(times[b])
        gain = statistics.median(t1 / (tb / b) for t1, tb in zip(times[1], times[b]))
        print(f"{b:5d} {lanes.lanes_for(b):5d} {step:8.2f} {step / b:10.2f} {gain:23.2f}x")
    one_step_s = statistics.median(times[1]) / 1e3
    all_rate, one_rate = gemm_gflops(threads), gemm_gflops(1)
    print(f"FLOPs per request step: {flops / 1e6:.1f} MFLOP (both CFG branches); at batch 1 that is "
          f"{flops / one_step_s / 1e9:.1f} GFLOP/s")
    print(f"fp32 GEMM 1024^3: {one_rate:.1f} GFLOP/s on 1 thread, {all_rate:.1f} on {threads}: a batch-1 step runs "
          f"at {100 * flops / one_step_s / 1e9 / all_rate:.0f}% of the cores' GEMM rate")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
