"""The thread policy on a shared CPU: the engine's default against ``cpu_threads=1``, quiet and under N busy
processes, before the policy watched for contention and after.

    python bench/contention.py [--model shapes] [--busy 0 2] [--rounds 3] [--prompts 4] [--steps 10]

Each measurement is a fresh process: it starts ``Omni(model)``, warms up with one request, then times ``--reps``
calls of ``generate`` on ``--prompts`` prompts and prints the median. Rows:

* ``before``: ``cpu_threads`` = this machine's usable cores, fixed: what the default was before the engine
  watched the CPU's pressure (an explicit ``cpu_threads`` still fixes the count);
* ``after``: the default (no ``cpu_threads``): the usable cores, one while the CPU is contended
  (``omni_core.platforms.threads.ContentionGauge``);
* ``one``: ``cpu_threads=1``.

Busy processes (``--busy``, pure-Python spinners started and stopped here) compete for the cores; within a load
level the rows run in rounds, their order alternating, and the table shows medians over rounds and the paired
ratios per round: each default over ``cpu_threads=1`` (the bar under load: <= 1.5x) and after over before
(quiet: no slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROWS = ("before", "after", "one")
JOB = r"""
import statistics, sys, time
model, threads, prompts, steps, reps = sys.argv[1], int(sys.argv[2]) or None, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from omni_core import Omni, SamplingParams
with Omni(model, cpu_threads=threads) as omni:
    params = SamplingParams(num_inference_steps=steps, seed=0)
    omni.generate(["a red circle in the top left"], params)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        omni.generate([f"a blue square in the center {i}" for i in range(prompts)], params)
        times.append(time.perf_counter() - t0)
print("RESULT", statistics.median(times))
"""


def run_job(args, row: str) -> float:
    from omni_core.platforms.threads import usable_cpu_cores

    threads = {"before": usable_cpu_cores(), "after": 0, "one": 1}[row]
    cmd = [sys.executable, "-c", JOB, args.model, str(threads), str(args.prompts), str(args.steps), str(args.reps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"contention: the {row} job failed:\n{out.stderr[-3000:]}")
    return float(line.split()[1])


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes")
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="busy processes per load level")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=3, help="timed generate calls per job (median)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    args = p.parse_args()

    print(f"contention: {args.model}, {args.prompts} prompts x {args.steps} steps, median of {args.reps} calls per "
          f"job, {args.rounds} rounds; cores {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    for n in args.busy:
        spinners = busy_processes(n)
        try:
            time.sleep(1.0 if n else 0.0)
            load0 = os.getloadavg()[0]
            times: dict[str, list[float]] = {row: [] for row in ROWS}
            for r in range(args.rounds):
                for row in (ROWS if r % 2 == 0 else ROWS[::-1]):
                    times[row].append(run_job(args, row))
            load1 = os.getloadavg()[0]
        finally:
            for s in spinners:
                s.kill()
                s.wait()
        print(f"\n{n} busy process(es); load average {load0:.2f} -> {load1:.2f}")
        for row in ROWS:
            print(f"  {row:<8}{statistics.median(times[row]):8.3f} s   rounds "
                  + " ".join(f"{t:.3f}" for t in times[row]))
        for a, b in (("before", "one"), ("after", "one"), ("after", "before")):
            ratios = [x / y for x, y in zip(times[a], times[b])]
            print(f"  {a} / {b}: {statistics.median(ratios):.2f}x (rounds {', '.join(f'{x:.2f}' for x in ratios)})")



if __name__ == "__main__":
    main()
