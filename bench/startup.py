"""Engine start-up: ``Omni(model, executor="mp")`` to ready, in a fresh process, with the worker processes started
by plain spawn and by Omni's fork server (``OMNI_START_METHOD``), in paired rounds; and a second engine in the same
process (what a test suite, or several models behind one server, pays for each engine after the first).

    .venv/bin/python bench/startup.py [--rounds 5] [--model shapes] [--world 1]

Prints each round, the medians, the ratio fork server / spawn per round (below 1: faster) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from omni_core import Omni
if __name__ == "__main__":
    model, world = sys.argv[1], int(sys.argv[2])
    kw = {"parallel_config": {"cfg_parallel_size": 2}} if world == 2 else {}
    times = []
    for _ in range(2):
        t = time.perf_counter()
        with Omni(model, executor="mp", **kw) as omni:
            times.append(time.perf_counter() - t)
    print(json.dumps({"first": times[0], "second": times[1], "process": time.perf_counter() - t0}))
"""


def one(method: str, model: str, world: int) -> dict:
    env = {**os.environ, "OMNI_START_METHOD": method}
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(world)], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{method} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--world", type=int, default=1, choices=(1, 2), help="worker processes (2: CFG-parallel)")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; {args.model}, {args.world} worker(s), warm-up on")
    rows = {"spawn": [], "forkserver": []}
    for r in range(args.rounds):
        order = ("spawn", "forkserver") if r % 2 == 0 else ("forkserver", "spawn")
        got = {m: one(m, args.model, args.world) for m in order}
        for m in order:
            rows[m].append(got[m])
        print(f"round {r + 1}: spawn first {got['spawn']['first']:.2f} s second {got['spawn']['second']:.2f} s | "
              f"fork server first {got['forkserver']['first']:.2f} s second {got['forkserver']['second']:.2f} s | "
              f"ratio first {got['forkserver']['first'] / got['spawn']['first']:.2f}x "
              f"second {got['forkserver']['second'] / got['spawn']['second']:.2f}x", flush=True)
    for key in ("first", "second", "process"):
        s = statistics.median(x[key] for x in rows["spawn"])
        f = statistics.median(x[key] for x in rows["forkserver"])
        ratios = [b[key] / a[key] for a, b in zip(rows["spawn"], rows["forkserver"])]
        print(f"median {key:<8} spawn {s:6.2f} s  fork server {f:6.2f} s  ratio per round (fork server / spawn) "
              f"median {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
