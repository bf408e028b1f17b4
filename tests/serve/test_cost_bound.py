"""The cost bound (docs/serving.md, "Cost limits"): under the default limits, a client that sends the largest
allowed request and leaves delays a small request by at most one step of that request -- measured through a
real ``omni serve shapes`` with the functions of ``bench/serve_cost_bound.py``."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("omni_model_shapes", reason="the shapes demo model (omni-model-shapes) is not installed")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve_cost_bound.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_cost_bound", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _aborted(url: str) -> int:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(re.search(r'^omni_engine_requests_total\{[^}]*outcome="aborted"\} (\d+)$', text, re.M).group(1))


def test_a_gone_max_size_client_delays_a_small_request_by_at_most_about_one_of_its_steps(bench):
    large = bench.largest_request("shapes")
    assert large["size"] == "64x64" and large["n"] == 4 and large["num_inference_steps"] == 200  # the defaults
    small = {"prompt": "a blue square in the center", "num_inference_steps": 4, "seed": 1}
    proc, url = bench.start_server("shapes")
    try:
        first, gaps = bench.step_times(url, large, steps=4)
        step = max(first, *gaps)  # the longest wave of the largest request (the first includes text encoding)
        bench.wait_idle(url)
        idle = min(bench.timed_post(url, small) for _ in range(2))
        aborted = _aborted(url)
        bench.send_and_leave(url, large, after_steps=2, after_s=0.0)
        before = bench.queue_time_sum(url)
        latency = bench.timed_post(url, small)
        queued = bench.queue_time_sum(url) - before
        assert _aborted(url) == aborted + 1  # the large request was aborted, not run to its end
    finally:
        proc.terminate()
        proc.wait(60)
    # a large request left running would hold the small one for ~200 steps (about a minute here); the margins
    # absorb a loaded 2-core machine
    assert queued <= 2 * step + 1.0, f"waited {queued:.2f} s in the queue; one large step is {step:.2f} s"
    assert latency <= idle + 2 * step + 3.0, \
        f"small request took {latency:.2f} s (idle {idle:.2f} s, step {step:.2f} s)"
