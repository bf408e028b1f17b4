"""Batching: 16 concurrent requests at max_num_seqs 1, 4 and 8, in REQUEST_BATCH and STEP_BATCH modes.

    python bench/batching.py [--model shapes] [--n 16] [--size 64 --steps 10]

Prints throughput (requests/s) of each setting and its ratio over serial execution (max_num_seqs=1, same
mode), measured side by side in one run.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import _common


async def burst(omni, params, n: int) -> float:
    async def one(i):
        async for _ in omni.generate(f"prompt {i}", params.replace(seed=i)):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0


def run(model: str, params, n: int, repeats: int, **config) -> float:
    """Median wall time of ``repeats`` bursts of ``n`` concurrent requests on one engine."""
    from omni_core import AsyncOmni

    async def go():
        omni = AsyncOmni(model, **config)
        try:
            await burst(omni, params, min(n, 4))  # warm up
            return statistics.median([await burst(omni, params, n) for _ in range(repeats)])
        finally:
            await omni.close()

    return asyncio.run(go())


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="bursts per setting (the median is shown)")
    args = p.parse_args()
    model = _common.resolve(args)
    params = _common.sampling(args)
    print(f"model={args.model or 'tiny test pipeline'} concurrent requests={args.n}; {_common.thread_header(args)}")
    print(f"{'mode':14} {'max_num_seqs':>12} {'seconds':>8} {'req/s':>7} {'vs serial':>10}")
    for mode, step in (("request_batch", False), ("step_batch", True)):
        serial = None
        for seqs in (1, 4, 8):
            sec = run(model, params, args.n, args.repeats,
                      **_common.engine_config(args, max_num_seqs=seqs, step_execution=step))
            serial = serial or sec
            print(f"{mode:14} {seqs:12d} {sec:8.2f} {args.n / sec:7.1f} {serial / sec:9.2f}x")


if __name__ == "__main__":
    main()
