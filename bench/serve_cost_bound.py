"""The cost bound of ``omni serve``: how long a client that sends the largest allowed request and leaves can
delay a small request (docs/serving.md, "Cost limits").

    .venv/bin/python bench/serve_cost_bound.py [--model shapes] [--trials 5]

Starts a real ``omni serve MODEL`` (default limits, default options) and measures, through HTTP:

* the time of one denoising step of the largest allowed request (``max_pixels`` as a square, ``max_steps``,
  ``max_outputs``), from the gaps between its streamed previews;
* the latency of a small request (default size, 10 steps) on an idle server;
* the latency of the same small request sent right after a client sent the largest request and disconnected
  at a random point of its first wave (admission, text encoding, step 1) or of a later step: the extra
  latency over the idle one is what the large request cost it.

The bound to hold: extra <= one step of the largest allowed request (plus scheduling noise). The machine's
load average is printed too: on a shared machine wall times include waiting for a core.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import select
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def start_server(model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    script = Path(sys.executable).parent / "omni"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "omni_core.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    proc = subprocess.Popen([*cmd, "serve", model, "--port", "0", "--log-level", "warning", *flags], stdout=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            m = re.search(r"on (http://\S+) ", proc.stdout.readline())
            if m:
                return proc, m.group(1)
    proc.kill()
    raise SystemExit("omni serve did not start")


def largest_request(model: str) -> dict:
    """The largest request the model's default limits allow (a square of max_pixels, on the model's multiple)."""
    from omni_core.pipelines.loader import resolve_model

    cls = resolve_model(model).pipeline_cls()
    limits = cls.request_limits()
    side = math.isqrt(limits.max_pixels)
    multiple = getattr(cls, "size_multiple", 8) or 8
    side -= side % multiple
    return {"prompt": "a red circle in the top left", "size": f"{side}x{side}", "n": limits.max_outputs,
            "num_inference_steps": limits.max_steps, "seed": 0}


def step_times(url: str, body: dict, steps: int = 8) -> tuple[float, list[float]]:
    """The time to the first streamed preview of ``body`` (its first wave: admission, text encoding and one
    step) and the gaps between the next ``steps`` previews (then the client leaves)."""
    import httpx

    stamps = [time.perf_counter()]
    with httpx.stream("POST", f"{url}/v1/images/generations", json={**body, "stream": True, "step_previews": True},
                      timeout=600) as s:
        for line in s.iter_lines():
            if line.startswith("event: image_generation.partial_image"):
                stamps.append(time.perf_counter())
                if len(stamps) > steps + 1:
                    break
    return stamps[1] - stamps[0], [b - a for a, b in zip(stamps[1:], stamps[2:])]


def wait_idle(url: str, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=30).json()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the server is still busy: {h}")
        time.sleep(0.05)


def timed_post(url: str, body: dict) -> float:
    import httpx

    t = time.perf_counter()
    r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t


def queue_time_sum(url: str) -> float:
    """Seconds completed requests waited in the engine queue, in all (a histogram's sum in /metrics)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^omni_request_queue_time_seconds_sum\{[^}]*\} (\S+)$", text, re.M).group(1))


def steps_done(url: str) -> int:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(re.search(r"^omni_denoise_steps_total\{[^}]*\} (\d+)$", text, re.M).group(1))


def send_and_leave(url: str, body: dict, after_steps: int, after_s: float) -> None:
    """Send ``body`` on a raw socket, wait until it runs (and has run ``after_steps`` steps) plus ``after_s``,
    then disconnect."""
    import httpx

    base = steps_done(url)
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=30).json()["running"] != 1:
        if time.monotonic() > deadline:
            raise SystemExit("the large request never ran")
        time.sleep(0.01)
    while steps_done(url) < base + after_steps:
        if time.monotonic() > deadline:
            raise SystemExit("the large request did not step")
        time.sleep(0.02)
    time.sleep(after_s)
    sock.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="shapes")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    large = largest_request(args.model)
    small = {"prompt": "a blue square in the center", "num_inference_steps": 10, "seed": 1}
    proc, url = start_server(args.model)
    try:
        first, gaps = step_times(url, large)
        wait_idle(url)
        step_med, step_max = statistics.median(gaps), max(gaps)
        idle = [timed_post(url, small) for _ in range(args.trials)]
        idle_med = statistics.median(idle)
        rng = random.Random(0)
        extras: dict[str, list[float]] = {"in its first wave": [], "after 2 steps": []}
        queued: dict[str, list[float]] = {k: [] for k in extras}
        for _ in range(args.trials):
            for where, after_steps in (("in its first wave", 0), ("after 2 steps", 2)):
                wait_idle(url)
                send_and_leave(url, large, after_steps, rng.uniform(0, step_med))
                before = queue_time_sum(url)
                extras[where].append(timed_post(url, small) - idle_med)
                queued[where].append(queue_time_sum(url) - before)  # only the small request completed
        print(f"model {args.model}, largest allowed request {large['size']} x n={large['n']} x "
              f"{large['num_inference_steps']} steps; load average {os.getloadavg()[0]:.2f} on "
              f"{len(os.sched_getaffinity(0))} cores")
        print(f"one step of the largest request: median {step_med * 1e3:.0f} ms, max {step_max * 1e3:.0f} ms "
              f"({len(gaps)} steps; its first wave, with admission and text encoding: {first * 1e3:.0f} ms); "
              f"small request alone: median {idle_med * 1e3:.0f} ms (from {min(idle) * 1e3:.0f} to "
              f"{max(idle) * 1e3:.0f} ms)")
        for where, values in extras.items():
            print(f"the large client left {where}: the small request waited in the queue "
                  f"{', '.join(f'{q * 1e3:.0f}' for q in queued[where])} ms (max {max(queued[where]) * 1e3:.0f} ms); "
                  f"its latency over the idle median: {', '.join(f'{e * 1e3:.0f}' for e in values)} ms")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
