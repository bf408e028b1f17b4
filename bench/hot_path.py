"""The hot path: per wave, the time inside the model's pipeline against the engine's own time.

    python bench/hot_path.py [--model shapes] [--max-num-seqs 4] [--depths 1 4 16 64] [--rounds 3] [--profile]

For each executor (uni, mp) and mode (request_batch, step_batch), one engine is loaded and a closed loop keeps
``depth`` requests in it (each finished request is replaced at once) until ``--requests`` have completed, for
every depth in turn, after one warm-up round; ``--rounds`` repeats that, the order of the depths alternating, so
the depths of one engine are measured side by side (this VM's speed moves by a third within minutes: depths
measured one after another compared the machine's minutes as much as the queue depths). From
``engine.wave_timing()`` (the runner times every pipeline call; the engine times each wave from scheduling to
output delivery) it prints, per denoising step over all rounds: the wall time, the time inside ``denoise_step``,
the rest of the pipeline (encode, scheduler step, decode), and the engine's own time (scheduling, transport,
bookkeeping, progress and preview events, delivery). Throughput is the median over rounds, and each depth's
against depth 4 is the median of the ratios within a round. ``--profile`` adds a cProfile of the engine's
busy-loop thread at the largest depth (the first executor, the last mode; an extra engine after the table):
where the engine's own time goes; with ``mp`` also of the worker's wave loop (``OMNI_WORKER_PROFILE``), whose
time outside the model is the rest of the engine's time there.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time

import _common

WORKER_PROFILE_ENV = "OMNI_WORKER_PROFILE"  # omni_core.worker.mp_worker.PROFILE_ENV, without importing the core


async def closed_loop(omni, params, depth: int, total: int) -> float:
    """Keep ``depth`` requests in flight until ``total`` have completed; returns the wall time."""
    started = 0

    async def client() -> None:
        nonlocal started
        while started < total:
            i, started = started, started + 1
            async for _ in omni.generate(f"a red circle in the top left {i}", params.replace(seed=i)):
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(depth)))
    return time.perf_counter() - t0


TIMING = ("waves", "denoise_calls", "wave_s", "pipeline_s", "denoise_s")


def measure(model: str, params, depths: list[int], totals: dict[int, int], rounds: int = 1, profile: bool = False,
            **config) -> dict[int, list[dict]]:
    """One engine; ``rounds`` rounds of a closed loop at every depth (order alternating by round). Returns
    ``{depth: [one dict per round]}`` with the round's wall time, throughput and ``wave_timing()`` deltas; with
    ``profile``, the busy loop is profiled from the first measured wave on (``"prof"`` of the last round)."""
    from omni_core import AsyncOmni

    async def go():
        omni = AsyncOmni(model, **config)
        engine = omni.engine
        prof = None
        out: dict[int, list[dict]] = {d: [] for d in depths}
        try:
            seqs = config["max_num_seqs"]
            await closed_loop(omni, params, min(max(depths), seqs), seqs)  # warm up
            if profile:
                prof = _profile_busy_loop(engine)
            for r in range(rounds):
                for depth in (depths if r % 2 == 0 else depths[::-1]):
                    before = engine.wave_timing()
                    wall = await closed_loop(omni, params, depth, totals[depth])
                    after = engine.wave_timing()
                    t = {k: after[k] - before[k] for k in TIMING}
                    t.update(wall=wall, rps=totals[depth] / wall, prof=prof)
                    out[depth].append(t)
        finally:
            await omni.close()
        return out

    return asyncio.run(go())


def _profile_busy_loop(engine):
    """Start a cProfile inside the engine's busy-loop thread (from its next wave on)."""
    prof = cProfile.Profile()
    original = engine.scheduler.observe_wave
    state = {"on": False}

    def observe_and_profile(sched, seconds):  # runs on the busy-loop thread after every step wave
        original(sched, seconds)
        if not state["on"]:
            prof.enable()
            state["on"] = True

    engine.scheduler.observe_wave = observe_and_profile
    return prof


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--max-num-seqs", type=int, default=4, help="wave capacity (default 4: depth 4 fills a wave)")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=None, help="completed requests per row (default: 2x depth, >= 16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the depths (medians and paired ratios)")
    p.add_argument("--executors", nargs="+", default=["uni", "mp"])
    p.add_argument("--modes", nargs="+", default=["request_batch", "step_batch"])
    p.add_argument("--profile", action="store_true",
                   help="also profile the busy loop (first executor, last mode, largest depth)")
    args = p.parse_args()
    model = _common.resolve(args)
    params = _common.sampling(args)
    print(f"model={args.model or 'tiny test pipeline'} max_num_seqs={args.max_num_seqs}; {_common.thread_header(args)}")
    print(f"{'executor':8} {'mode':14} {'depth':>5} {'req/s':>6} {'vs d4':>6} {'steps':>6} {'wall':>7} "
          f"{'denoise':>8} {'pipe+':>6} {'engine':>7} {'engine%':>7}   (ms per denoising step)")
    totals = {d: args.requests or max(16, 2 * d) for d in args.depths}

    def config(executor: str, mode: str) -> dict:
        return _common.engine_config(args, executor=executor, max_num_seqs=args.max_num_seqs,
                                     step_execution=mode == "step_batch")

    for executor in args.executors:
        for mode in args.modes:
            rows = measure(model, params, args.depths, totals, args.rounds, **config(executor, mode))
            for depth, runs in rows.items():
                t = {k: sum(run[k] for run in runs) for k in TIMING}
                steps = max(1, t["denoise_calls"])
                engine_s = t["wave_s"] - t["pipeline_s"]
                rps = statistics.median(run["rps"] for run in runs)
                ratio = (f"{statistics.median(a['rps'] / b['rps'] for a, b in zip(runs, rows[4])):5.2f}x"
                         if 4 in rows else "     -")
                print(f"{executor:8} {mode:14} {depth:5d} {rps:6.2f} {ratio:>6} {steps:6d} "
                      f"{t['wave_s'] / steps * 1e3:7.2f} {t['denoise_s'] / steps * 1e3:8.2f} "
                      f"{(t['pipeline_s'] - t['denoise_s']) / steps * 1e3:6.2f} {engine_s / steps * 1e3:7.3f} "
                      f"{100 * engine_s / max(t['wave_s'], 1e-9):6.1f}%", flush=True)
    profile_out = worker_profile = None
    if args.profile:  # an engine of its own, so the tables above are not measured under the profiler
        executor, mode, depth = args.executors[0], args.modes[-1], max(args.depths)
        if executor != "uni":
            os.environ[WORKER_PROFILE_ENV] = worker_profile = os.path.join(tempfile.mkdtemp(), "worker")
        rows = measure(model, params, [depth], totals, 1, True, **config(executor, mode))
        os.environ.pop(WORKER_PROFILE_ENV, None)
        profile_out = rows[depth][-1]["prof"]
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if profile_out is not None:
        buf = io.StringIO()
        stats = pstats.Stats(profile_out, stream=buf)
        # the engine's own functions (the model's time is the pipeline's, reported above)
        stats.sort_stats("tottime").print_stats(r"omni_core/(engine|sched|executor|waves|outputs|request|worker/"
                                                r"(runner|lanes|timing))|threading|queue", 25)
        print(f"\nbusy-loop thread profile ({args.executors[0]}, {args.modes[-1]}, depth {max(args.depths)}), "
              f"by own time:")
        print(buf.getvalue())
    if worker_profile and os.path.exists(worker_profile + ".rank0"):
        buf = io.StringIO()
        stats = pstats.Stats(worker_profile + ".rank0", stream=buf)
        # the worker's own functions: receiving, bookkeeping, packing and sending (the model's time is above)
        stats.sort_stats("tottime").print_stats(r"omni_core/(worker|waves|outputs|pipelines/state)|multiprocessing|"
                                                r"pickle|copyreg|attr|posix|_thread", 25)
        print(f"\nworker rank 0 wave-loop profile ({args.executors[0]}, {args.modes[-1]}, depth {max(args.depths)}), "
              f"by own time:")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
