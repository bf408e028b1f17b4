"""Batching: 16 concurrent requests at max_num_seqs 1, 4 and 8, in REQUEST_BATCH and STEP_BATCH modes.

    python bench/batching.py [--model shapes] [--n 16] [--size 64 --steps 10] [--cpu-threads N]
    python bench/batching.py --model shapes --seqs 1 --repeats 15   # step/request at max_num_seqs 1 alone

Every engine runs in a process of its own, as deployed (``_common.EngineProcess``: engines sharing a process share
its OpenMP runtime, which then stops letting idle torch threads spin). All six are loaded first (every one with
the same thread policy), then measured interleaved: each
round runs one burst of ``--n`` concurrent requests on every engine in turn, the two modes of one
``max_num_seqs`` back to back (which goes first alternates by round), so load drift on a shared machine
hits them alike. Prints the median burst time and throughput (requests/s) of each setting, and two paired
ratios, each the median over rounds of the ratio within a round: over serial execution (max_num_seqs=1,
same mode) and step mode against request mode at the same max_num_seqs. Pairing matters on a shared
2-core machine: bursts of one setting vary by +-15% between rounds, more than the differences measured.
"""

from __future__ import annotations

import os
import statistics

import _common

SEQS = (1, 4, 8)
MODES = (("request_batch", False), ("step_batch", True))


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7, help="rounds (medians over rounds are shown)")
    p.add_argument("--seqs", type=int, nargs="+", default=list(SEQS),
                   help="max_num_seqs values (default 1 4 8; 1 is always run: the ratios are over it)")
    args = p.parse_args()
    model = _common.resolve(args)
    params = _common.sampling(args)
    seqs_list = sorted({1, *args.seqs})

    def go() -> dict:
        engines = {}
        try:
            for mode, step in MODES:
                for seqs in seqs_list:
                    engines[(mode, seqs)] = _common.EngineProcess(
                        model, _common.engine_config(args, max_num_seqs=seqs, step_execution=step))
            for engine in engines.values():
                engine.wait_ready()
            times: dict = {key: [] for key in engines}
            for engine in engines.values():
                engine.burst(min(args.n, 4), params)  # warm up
            for r in range(args.repeats):
                for seqs in seqs_list:
                    for mode, _ in (MODES if r % 2 == 0 else MODES[::-1]):
                        times[(mode, seqs)].append(engines[(mode, seqs)].burst(args.n, params))
        finally:
            for engine in engines.values():
                engine.close()
        return times

    print(f"model={args.model or 'tiny test pipeline'} concurrent requests={args.n}; {_common.thread_header(args)}; "
          f"one engine process per row")
    times = go()

    def paired(num: tuple, den: tuple) -> float:
        """Median over rounds of times[num] / times[den] within a round (a throughput ratio den over num)."""
        return statistics.median(a / b for a, b in zip(times[num], times[den]))

    print(f"{'mode':14} {'max_num_seqs':>12} {'seconds':>8} {'req/s':>7} {'vs serial':>10} {'step/request':>13}")
    for mode, _ in MODES:
        for seqs in seqs_list:
            s = statistics.median(times[(mode, seqs)])
            print(f"{mode:14} {seqs:12d} {s:8.2f} {args.n / s:7.1f} {paired((mode, 1), (mode, seqs)):9.2f}x "
                  f"{paired(('request_batch', seqs), (mode, seqs)):12.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
