"""Scheduling under a mixed load: FIFO vs priority without preemption vs priority with preemption, side by side.

The load (the same Poisson arrival schedule for every row): 80% low-priority large requests, 20% high-priority
small ones, in step mode. Each row starts its own engine and replays the schedule; it prints the high-priority
requests' p50/p99 latency (admission to final output), the low-priority p50, total throughput (requests/s over
the makespan) and the preemptions, then the ratios against FIFO. FIFO runs again last: how far the two FIFO rows
differ is how much the machine drifted during the run. The arrival rate is set from a short probe of
this machine's step cost (``--load`` of its capacity), so the queue is as busy on a fast machine as on a slow one.

    python bench/scheduling.py                      # tiny test pipeline, 150 requests at 80% load
    python bench/scheduling.py --requests 120 --load 0.9 --step-budget 0.05
    python bench/scheduling.py --executor mp         # worker process, pipelined step waves
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time

from _common import engine_config, parser, resolve, thread_header

ROWS = [("FIFO", {"max_preemptions": 0}, False), ("priority, no preemption", {"max_preemptions": 0}, True),
        ("priority + preemption", {}, True),
        ("FIFO again (drift check)", {"max_preemptions": 0}, False)]


def make_requests(args, n: int, rng: random.Random) -> list[tuple[float, bool]]:
    """(arrival offset s, high priority?) for ``n`` requests; offsets are filled in once the rate is known."""
    return [(rng.expovariate(1.0), rng.random() < args.high_fraction) for _ in range(n)]


def request(args, high: bool, i: int, use_priority: bool):
    from omni_core import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    size, steps, prio = (args.small, args.small_steps, 0) if high else (args.large, args.large_steps, 10)
    return OmniDiffusionRequest(prompt=f"request {i}", sampling_params=SamplingParams(
        height=size, width=size, num_inference_steps=steps, seed=i, output_type="latent",
        priority=prio if use_priority else 0))


def config(args, **extra) -> dict:
    """The engine options every row shares (limits that admit the large size), plus the row's own."""
    out = engine_config(args, executor=args.executor, **extra)
    out["limits"] = {**out["limits"], "max_pixels": max(args.large, args.small) ** 2}
    return out


def probe(args, model: str) -> float:
    """Seconds of work per request of the mix at full waves (large and small requests timed apart)."""
    from omni_core import Omni

    with Omni(model, step_execution=True, max_num_seqs=args.max_num_seqs, **config(args)) as omni:
        costs = {}
        for high in (False, True):
            reqs = [request(args, high, 10_000 + k, False) for k in range(args.max_num_seqs)]
            t0 = time.perf_counter()
            for h in omni.engine.submit(reqs):
                h.result()
            costs[high] = (time.perf_counter() - t0) / args.max_num_seqs
    return args.high_fraction * costs[True] + (1 - args.high_fraction) * costs[False]


def run_row(args, model: str, schedule: list[tuple[float, bool]], extra: dict, use_priority: bool) -> dict:
    from omni_core import Omni

    with Omni(model, step_execution=True, max_num_seqs=args.max_num_seqs,
              **config(args, **extra, step_time_budget_s=args.step_budget)) as omni:
        engine = omni.engine
        handles: list = [None] * len(schedule)
        submitted: list[float] = [0.0] * len(schedule)

        def submit_all() -> None:
            start = time.monotonic()
            for i, (at, high) in enumerate(schedule):
                delay = start + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                submitted[i] = time.monotonic()
                (handles[i],) = engine.submit([request(args, high, i, use_priority)])

        t0 = time.monotonic()
        feeder = threading.Thread(target=submit_all)
        feeder.start()
        feeder.join()
        outs = [h.result() for h in handles]
        end = time.monotonic()
        stats = engine.stats()
    assert all(o.status == "completed" for o in outs), [o.error for o in outs if o.status != "completed"]
    assert stats["tracked_requests"] == [], stats
    lat = {True: [], False: []}
    for (_, high), out in zip(schedule, outs):
        lat[high].append(out.metrics["e2e_latency_s"])
    return {"high": lat[True], "low": lat[False], "throughput": len(outs) / (end - t0),
            "preemptions": stats["requests_preempted"],
            "max_preempted": max(o.metrics.get("preemptions", 0) for o in outs)}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--high-fraction", type=float, default=0.2, help="share of high-priority small requests")
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the probed capacity")
    p.add_argument("--large", type=int, default=64, help="side of the low-priority requests")
    p.add_argument("--large-steps", type=int, default=20)
    p.add_argument("--small", type=int, default=16, help="side of the high-priority requests")
    p.add_argument("--small-steps", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--step-budget", type=float, default=None, help="step_time_budget_s for every row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor", default="uni", help="executor of every row (uni, mp)")
    args = p.parse_args()
    model = resolve(args)
    per_request = probe(args, model)
    rate = args.load / per_request
    rng = random.Random(args.seed)
    offsets, t = [], 0.0
    for gap, high in make_requests(args, args.requests, rng):
        t += gap / rate
        offsets.append((t, high))
    n_high = sum(h for _, h in offsets)
    print(f"# {args.requests} requests ({n_high} high-priority {args.small}px x {args.small_steps} steps, "
          f"{args.requests - n_high} low-priority {args.large}px x {args.large_steps} steps), Poisson arrivals at "
          f"{rate:.2f}/s = {args.load:.0%} of the probed capacity ({per_request * 1000:.0f} ms of work per request); "
          f"step mode, max_num_seqs={args.max_num_seqs}, step_time_budget_s={args.step_budget}, "
          f"executor={args.executor}")
    print(f"# {thread_header(args)}")
    rows = []
    for name, extra, use_priority in ROWS:
        r = run_row(args, model, offsets, extra, use_priority)
        rows.append((name, r))
    base = rows[0][1]
    print(f"{'policy':<26}{'high p50 s':>11}{'high p99 s':>11}{'low p50 s':>11}{'req/s':>8}{'preempt':>9}"
          f"{'high p99 / FIFO':>17}{'req/s / FIFO':>14}")
    for name, r in rows:
        print(f"{name:<26}{pct(r['high'], 50):>11.3f}{pct(r['high'], 99):>11.3f}{statistics.median(r['low']):>11.3f}"
              f"{r['throughput']:>8.2f}{r['preemptions']:>9d}{pct(r['high'], 99) / pct(base['high'], 99):>17.2f}"
              f"{r['throughput'] / base['throughput']:>14.2f}")
    print(f"# most preemptions of one request: {max(r['max_preempted'] for _, r in rows)} "
          f"(max_preemptions default 4); load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
