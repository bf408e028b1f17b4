"""The executors side by side on one model: start-up, per-request latency, 16-request throughput; and how a
result's tensors best travel back from a Ray actor.

    .venv/bin/python bench/executors.py [--model shapes] [--steps 4] [--size 32] [--requests 16]
                                        [--parallel-config '{"data_parallel_size": 2}'] [--ray-address auto]

Each executor (``uni``, ``mp``, ``ray``; ``uni`` only for one process) starts its own engine on the same model
with the same thread policy, in the same run. Reported per row: start-up (``Omni(...)`` until ready; for
``ray`` including ``ray.init`` of a local Ray when ``--ray-address`` is not given, also shown alone), the
median latency of 5 lone requests, and the throughput of ``--requests`` requests submitted at once
(``max_num_seqs=4``), with the ratio to ``uni`` (or ``mp``).

The transport table times one result's trip from a Ray actor to the driver (median of 20 ``ray.get``), for
output images of several sizes, sent three ways: the ``mp`` transport (``pack_outputs``: tensors up to
1 MiB as bytes, larger ones as tensors that Ray pickles), raw tensors (Ray pickles them), and numpy arrays
(Ray's zero-copy path for numpy buffers, copied once on arrival: ``omni_executor_ray.transport``, what the
``ray`` executor uses).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from _common import engine_config, parser, thread_header  # noqa: E402


def _requests(n: int, args, seed0: int = 0):
    from omni_core import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    return [OmniDiffusionRequest(prompt=f"a red circle number {i}", sampling_params=SamplingParams(
        num_inference_steps=args.steps, height=args.size, width=args.size, seed=seed0 + i)) for i in range(n)]


def _wait(streams) -> None:
    for s in streams:
        while not (out := s.get(timeout=600)).finished:
            pass
        assert out.status == "completed", out.error


def run_executor(name: str, args, parallel: dict) -> dict:
    from omni_core import Omni

    extra = {"ray_address": args.ray_address} if name == "ray" else {}
    t0 = time.perf_counter()
    omni = Omni(args.model, executor=name, parallel_config=parallel, max_num_seqs=4, warmup=True,
                **engine_config(args), **extra)
    start = time.perf_counter() - t0
    try:
        _wait(omni.engine.submit(_requests(1, args, 1000)))  # one untimed request
        lat = []
        for i in range(5):
            t = time.perf_counter()
            _wait(omni.engine.submit(_requests(1, args, i)))
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        _wait(omni.engine.submit(_requests(args.requests, args, 100)))
        thr = args.requests / (time.perf_counter() - t)
    finally:
        omni.close()
    return {"start": start, "latency": statistics.median(lat), "throughput": thr}


def transport_table() -> list[tuple]:
    import ray
    import torch

    from omni_core.waves import RunnerOutput
    from omni_core.worker.transport import pack_outputs, unpack_outputs

    @ray.remote(num_cpus=0)
    class Sender:
        def make(self, size: int, how: str):
            self.size, self.how = size, how

        def send(self):
            from omni_core.outputs import DiffusionOutput

            img = torch.rand(4, 3, self.size, self.size)
            out = RunnerOutput(outputs={"r": DiffusionOutput(request_id="r", tensor=img)})
            if self.how == "pack_outputs":
                return pack_outputs(out)
            if self.how == "numpy":
                from omni_executor_ray.transport import pack_for_ray

                return pack_for_ray(out)
            return out

    sender = Sender.remote()
    rows = []
    for size in (32, 256, 512, 1024):
        row = [f"4x3x{size}x{size} float32 ({4 * 3 * size * size * 4 / 2**20:.2f} MiB)"]
        for how in ("pack_outputs", "tensor", "numpy"):
            ray.get(sender.make.remote(size, how))
            times = []
            for _ in range(20):
                t = time.perf_counter()
                out = ray.get(sender.send.remote())
                unpack_outputs(out)
                if how == "numpy":
                    from omni_executor_ray.transport import unpack_from_ray

                    unpack_from_ray(out)
                assert isinstance(out.outputs["r"].tensor, torch.Tensor)
                times.append(time.perf_counter() - t)
            row.append(statistics.median(times) * 1e3)
        rows.append(tuple(row))
    ray.kill(sender)
    return rows


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(model="shapes", steps=4, size=32)
    p.add_argument("--requests", type=int, default=16, help="requests submitted at once for the throughput row")
    p.add_argument("--parallel-config", default="{}", help="JSON ParallelConfig for every row (uni: only when 1)")
    p.add_argument("--ray-address", default=None, help="Ray cluster for the ray row (default: start a local Ray)")
    p.add_argument("--only", default="uni,mp,ray", help="executors to run, comma separated")
    args = p.parse_args()
    parallel = json.loads(args.parallel_config)
    from omni_core.config import ParallelConfig

    world = ParallelConfig.coerce(parallel).world_size
    names = [n for n in args.only.split(",") if n != "uni" or world == 1]
    print(f"# {args.model}, {args.steps} steps, {args.size}x{args.size}, parallel_config={parallel}; "
          f"{thread_header(args)}")
    import ray

    t = time.perf_counter()
    if "ray" in names and not ray.is_initialized():
        ray.init(address=args.ray_address, include_dashboard=False, configure_logging=False)
    ray_init = time.perf_counter() - t
    results = {}
    for name in names:
        results[name] = run_executor(name, args, parallel)
    base = results.get("uni") or results.get("mp")
    print(f"\n| executor | start-up s | latency s (median of 5) | {args.requests}-request throughput req/s "
          f"| latency vs {'uni' if 'uni' in results else 'mp'} | throughput vs it |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        start = r["start"] + (ray_init if name == "ray" else 0.0)
        print(f"| {name} | {start:.2f}{f' (ray.init {ray_init:.2f})' if name == 'ray' else ''} | {r['latency']:.3f} "
              f"| {r['throughput']:.2f} | {r['latency'] / base['latency']:.2f}x | {r['throughput'] / base['throughput']:.2f}x |")
    if "ray" in names:
        print("\n| result of one wave | pack_outputs (mp's) ms | raw tensor ms | numpy (ray executor's) ms |")
        print("|---|---|---|---|")
        for row in transport_table():
            print(f"| {row[0]} | {row[1]:.2f} | {row[2]:.2f} | {row[3]:.2f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
