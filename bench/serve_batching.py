"""Batching by default, through HTTP: requests per second of 1 client and of 32 concurrent clients against real
``omni serve`` processes with no batching flag (the default) and with ``--max-num-seqs`` 1, 4, 8 and 16.

    .venv/bin/python bench/serve_batching.py [--model shapes] [--clients 32] [--rounds 3] [--seqs 1 4 8 16]
                                             [--size 32x32] [--steps 20]

All servers are started first (default options otherwise: step execution off, warm-up on) and measured
interleaved: each round runs, on every server in turn (the order rotates by round), one client sending
``--clients`` requests one after another, then ``--clients`` clients sending one request each at once. Prints
the median requests/s of each setting and the two ratios the default must hold (issue #37): 32 clients over 1
client on the default server (>= 2x), and the default over the best explicit setting at 32 clients (>= 0.9x),
each the median over rounds of the ratio within a round (load drift on a shared machine hits a round alike).
The load average is printed before and after. The clients run in this process at a lower priority (``nice``)
than the servers, as clients on other hosts would not take the server's cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_cost_bound import start_server, wait_idle  # noqa: E402 - the shared server starter


def start(model: str, seqs: int | None):
    """``omni serve MODEL`` with ``--max-num-seqs seqs`` (None: no flag)."""
    return start_server(model, *(() if seqs is None else ("--max-num-seqs", str(seqs))))


#: request fields every request of the run carries besides prompt and seed (``--size``, ``--steps``)
EXTRA: dict = {}


def post(url: str, seed: int) -> None:
    import httpx

    body = {"prompt": "a red circle in the top left", "seed": seed, "response_format": "b64_json", **EXTRA}
    httpx.post(f"{url}/v1/images/generations", json=body, timeout=600).raise_for_status()


def rps_one_client(url: str, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        post(url, i)
    return n / (time.perf_counter() - t)


def rps_concurrent(url: str, n: int) -> float:
    with cf.ThreadPoolExecutor(n) as pool:
        t = time.perf_counter()
        list(pool.map(lambda i: post(url, i), range(n)))
        return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--size", default=None, help="WxH of every request (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="num_inference_steps of every request (default: the model's)")
    args = p.parse_args()
    if args.size:
        EXTRA["size"] = args.size
    if args.steps:
        EXTRA["num_inference_steps"] = args.steps
    settings: list[int | None] = [None, *args.seqs]
    name = {s: "default" if s is None else f"--max-num-seqs {s}" for s in settings}
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    servers = {s: start(args.model, s) for s in settings}
    os.nice(10)  # the servers keep their priority; the clients yield to them
    one: dict = {s: [] for s in settings}
    many: dict = {s: [] for s in settings}
    try:
        for url in (u for _, u in servers.values()):
            post(url, 0)  # first request after the warm-up: steady state
        for r in range(args.rounds):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            for s in order:
                url = servers[s][1]
                wait_idle(url)
                one[s].append(rps_one_client(url, args.clients))
                wait_idle(url)
                many[s].append(rps_concurrent(url, args.clients))
            print(f"round {r + 1}: " + ", ".join(f"{name[s]} {one[s][-1]:.2f}/{many[s][-1]:.2f}" for s in settings),
                  flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=60)
    shape = ", ".join(f"{k}={v}" for k, v in EXTRA.items()) or "the model's default request"
    print(f"\nmodel {args.model}, {shape}, requests/s (median of {args.rounds} rounds)")
    print(f"| setting | 1 client | {args.clients} clients |\n|---|---|---|")
    for s in settings:
        print(f"| {name[s]} | {statistics.median(one[s]):.2f} | {statistics.median(many[s]):.2f} |")
    scale = statistics.median(m / o for m, o in zip(many[None], one[None]))
    explicit = [s for s in settings if s is not None]
    best = max(explicit, key=lambda s: statistics.median(many[s]))
    vs_best = statistics.median(d / b for d, b in zip(many[None], many[best]))
    print(f"\ndefault, {args.clients} clients / 1 client: {scale:.2f}x (bar >= 2x)")
    print(f"default / best explicit ({name[best]}) at {args.clients} clients: {vs_best:.2f}x (bar >= 0.9x)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
