"""LoRA traffic: 16 concurrent requests over 4 adapters, and the per-step cost of an unmerged adapter.

    python bench/lora.py [--n 16] [--adapters 4] [--rank 16] [--size 32 --steps 4] [--heads 8] [--repeats 3]

One engine (request mode, ``max_num_seqs=--n``) on a tiny random Qwen-Image folder with ``--adapters`` rank
``--rank`` adapters made by peft (every attention projection). Measured interleaved, ``--repeats`` rounds, the
median shown:

* mixed: all ``--n`` requests (adapters round-robin) submitted at once -> one wave, each row its own adapter
  (what Omni does);
* grouped: one wave per adapter, one after the other (what engines that batch only same-adapter requests do);
* one at a time: each request alone (what engines that switch one adapter for the whole server do);
* per-step cost: a wave of ``--n`` requests all with one adapter (unmerged: the per-row path) against the
  same wave with no adapter, denoise seconds per step from the engine's own timing.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import _common

os.environ.setdefault("HF_HUB_OFFLINE", "1")
QWEN_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--heads", type=int, default=8, help="attention heads of the tiny model (width = 16 x heads; "
                   "default 8: a rank-16 adapter is 1/8 of a projection, as in real models' proportions or more)")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(size=32, steps=4)
    args = p.parse_args()

    from omni_core import Omni, SamplingParams
    from omni_core.lora.testing import make_lora
    from omni_core.request import OmniDiffusionRequest
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    root = tempfile.mkdtemp(prefix="omni-bench-lora-")
    model = args.model or build_tiny_qwen_image(os.path.join(root, "qwen"), num_heads=args.heads)
    loras = {f"l{i}": make_lora(model, os.path.join(root, f"l{i}"), rank=args.rank, seed=i, targets=QWEN_TARGETS)
             for i in range(args.adapters)}
    names = list(loras)
    omni = Omni(model, dtype="float32", max_num_seqs=args.n, loras=loras, max_loras=args.adapters,
                max_lora_rank=args.rank, **_common.engine_config(args))
    engine = omni.engine

    def requests(adapters):
        return [engine.prepare_request(OmniDiffusionRequest(
            prompt=f"prompt {i}", sampling_params=_common.sampling(args, seed=i, output_type="latent", lora=a)))
            for i, a in enumerate(adapters)]

    def wave(adapters) -> None:
        for h in engine.submit(requests(adapters)):
            out = h.result()
            assert out.error is None, out.error

    mixed_adapters = [names[i % len(names)] for i in range(args.n)]

    def mixed() -> None:
        wave(mixed_adapters)

    def grouped() -> None:
        for name in names:
            wave([a for a in mixed_adapters if a == name])

    def one_at_a_time() -> None:
        for a in mixed_adapters:
            wave([a])

    def step_cost(adapter) -> float:
        t = engine.stats()["timing"]
        wave([adapter] * args.n)
        t2 = engine.stats()["timing"]
        return (t2["denoise_s"] - t["denoise_s"]) / args.steps

    rows = {"mixed": mixed, "grouped by adapter": grouped, "one at a time": one_at_a_time}
    times: dict[str, list[float]] = {k: [] for k in rows}
    costs: dict[str, list[float]] = {"no adapter": [], "rank-16 adapter": []}
    mixed()  # warm every adapter and shape
    for _ in range(args.repeats):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        for _ in range(2):  # alternated, so drift hits both alike
            costs["no adapter"].append(step_cost(None))
            costs["rank-16 adapter"].append(step_cost(names[0]))
    omni.close()

    rps = {k: args.n / statistics.median(v) for k, v in times.items()}
    print(f"# bench/lora.py: {args.n} requests over {args.adapters} rank-{args.rank} adapters, tiny Qwen-Image "
          f"(heads={args.heads}), {args.size}x{args.size}, {args.steps} steps; {_common.thread_header(args)}")
    print(f"{'setting':<22}{'req/s':>9}{'vs one at a time':>18}")
    for k, v in rps.items():
        print(f"{k:<22}{v:>9.2f}{v / rps['one at a time']:>17.2f}x")
    print(f"mixed / grouped: {rps['mixed'] / rps['grouped by adapter']:.2f}x")
    base, lora = (statistics.median(costs[k]) for k in costs)
    print(f"per-step denoise, wave of {args.n}: no adapter {base * 1000:.1f} ms, rank-{args.rank} adapter (unmerged, "
          f"per-row) {lora * 1000:.1f} ms: overhead {100 * (lora / base - 1):+.1f}%")


if __name__ == "__main__":
    main()
