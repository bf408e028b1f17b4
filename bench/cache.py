"""Cache backends on the ``shapes`` demo model: denoiser evaluations saved, wall-clock speedup, image fidelity and
prompt adherence, every configuration measured in one run and printed as one table.

    python bench/cache.py                      # 120 prompts (every colour x shape x position), 50 steps
    python bench/cache.py --n 48 --repeats 2 --json out.json

For each configuration an ``Omni("shapes", cache_backend=..., cache_config=...)`` engine generates the same
prompts with the same seeds (request batches of ``--batch``). Columns:

* ``evals``: denoiser evaluations (one per step and CFG branch) whose transformer blocks ran, as a fraction
  of the uncached run, and the reduction factor; ``blocks`` is the fraction of transformer-block evaluations
  that ran (cache-dit still runs its Fn/Bn blocks on a reused step);
* ``speedup``: wall-clock time of the uncached run / this run (generation only, engine already loaded;
  configurations are timed in interleaved rounds, in a rotated order each round, and each keeps its best
  round, so a slow spell on a shared machine does not single one out);
* ``PSNR``: mean over images of the PSNR (dB, pixels in [0, 1]) against the uncached image of the same
  prompt and seed;
* ``acc``: the shapes evaluator's accuracy (colour, shape and position all right; ``omni_model_shapes.judge``)
  and its difference from the uncached run in points.

The target line checks ``Omni(model="shapes", cache_backend="tea_cache")`` with its default settings against
>= 1.9x fewer evaluations, >= 1.7x wall speedup, PSNR >= 30 dB and accuracy within 2 points of uncached.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: (label, cache_backend, cache_config)
CONFIGS: list[tuple[str, str, dict]] = [
    ("no cache", "none", {}),
    ("tea_cache default", "tea_cache", {}),
    ("tea_cache thr 0.1", "tea_cache", {"rel_l1_thresh": 0.1}),
    ("tea_cache thr 0.3", "tea_cache", {"rel_l1_thresh": 0.3}),
    ("tea_cache thr 0.6", "tea_cache", {"rel_l1_thresh": 0.6}),
    ("cache_dit F1B0 W4 MC3 R0.24", "cache_dit", {}),
    ("cache_dit F1B0 W4 MC3 R0.12", "cache_dit", {"residual_diff_threshold": 0.12}),
    ("cache_dit F1B0 W4 R0.24 +TaylorSeer", "cache_dit", {"max_continuous_cached_steps": -1,
                                                          "enable_taylorseer": True}),
    ("cache_dit F1B1 W4 SCM fast static", "cache_dit", {"Bn_compute_blocks": 1, "scm_steps_mask_policy": "fast",
                                                        "scm_steps_policy": "static"}),
]
TARGET = {"evals_factor": 1.9, "speedup": 1.7, "psnr": 30.0, "acc_points": 2.0}


def psnr(a, b) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return 99.0 if mse == 0 else min(99.0, 10 * math.log10(1.0 / mse))


def generate(omni, prompts: list[str], seeds: list[int], steps: int) -> list:
    """One request per prompt with its own seed (as the shapes evaluator does), all queued at once."""
    from omni_core.config import SamplingParams
    from omni_core.request import OmniDiffusionRequest

    handles = omni.engine.submit([OmniDiffusionRequest(prompt=p, sampling_params=SamplingParams(
        seed=s, num_inference_steps=steps, output_type="pt")) for p, s in zip(prompts, seeds)])
    outs = []
    for handle in handles:
        out = handle.result()
        if out.status != "completed":
            raise RuntimeError(f"request {out.request_id} {out.status}: {out.error}")
        outs.append(out)
    return outs


def num_layers(model: str) -> int:
    from omni_core.pipelines import resolve_model

    with open(os.path.join(resolve_model(model).model_path, "transformer", "config.json")) as f:
        return json.load(f)["num_layers"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shapes")
    p.add_argument("--n", type=int, default=120, help="prompts (cycling through every colour x shape x position)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=1, help="max_num_seqs: requests per wave (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per configuration (best is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--only", default=None, help="comma-separated substrings: run only matching configurations")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    import torch

    from omni_core import Omni
    from omni_model_shapes import evaluate, judge

    if args.threads:
        torch.set_num_threads(args.threads)
    scenes = evaluate.eval_scenes(args.n)
    prompts = [s.prompt for s in scenes]
    seeds = list(range(args.n))  # image i uses seed i, as the shapes evaluator does
    configs = CONFIGS
    if args.only:
        keys = [k.strip() for k in args.only.split(",")]
        configs = [CONFIGS[0]] + [c for c in CONFIGS[1:] if any(k in c[0] for k in keys)]

    engines = {}
    for label, backend, config in configs:
        engines[label] = Omni(args.model, max_num_seqs=args.batch, warmup=False, cache_backend=backend,
                              cache_config=config)
    try:
        for omni in engines.values():  # untimed: first-call costs (imports, allocator)
            generate(omni, prompts[:args.batch], seeds[:args.batch], args.steps)
        best: dict[str, float] = {}
        outs: dict[str, list] = {}
        labels = list(engines)
        for r in range(args.repeats):
            # rotate the order every round, so a slow spell on the machine does not always hit the same ones
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                t0 = time.perf_counter()
                res = generate(engines[label], prompts, seeds, args.steps)
                dt = time.perf_counter() - t0
                best[label] = min(best.get(label, float("inf")), dt)
                outs[label] = res
    finally:
        for omni in engines.values():
            omni.close()

    base_label = configs[0][0]
    base_imgs = [o.images[0] for o in outs[base_label]]
    rows = []
    for label, backend, config in configs:
        res = outs[label]
        imgs = [o.images[0] for o in res]
        computed = sum(o.metrics.get("steps_computed", 0) for o in res)
        reused = sum(o.metrics.get("steps_reused", 0) for o in res)
        total = computed + reused
        evals = computed / total if total else 1.0
        blocks = evals
        if backend == "cache_dit" and total:
            layers = num_layers(args.model)
            fn = config.get("Fn_compute_blocks", 1) + config.get("Bn_compute_blocks", 0)
            blocks = (computed * layers + reused * fn) / (total * layers)
        scores, _ = judge.score(torch.stack(imgs), scenes)
        rows.append({
            "config": label, "backend": backend, "cache_config": config,
            "evals_fraction": round(evals, 4), "evals_factor": round(1 / evals, 3) if evals else None,
            "blocks_fraction": round(blocks, 4), "seconds": round(best[label], 3),
            "speedup": round(best[base_label] / best[label], 3),
            "psnr": round(sum(psnr(a, b) for a, b in zip(imgs, base_imgs)) / len(imgs), 2),
            "psnr_min": round(min(psnr(a, b) for a, b in zip(imgs, base_imgs)), 2),
            "accuracy": round(100 * scores.all, 2),
        })
    base_acc = rows[0]["accuracy"]
    for r in rows:
        r["acc_points"] = round(r["accuracy"] - base_acc, 2)

    print(f"bench/cache.py: model {args.model}, {args.n} prompts, {args.steps} steps, batch {args.batch}, "
          f"best of {args.repeats} round(s), torch threads {torch.get_num_threads()}")
    head = (f"{'configuration':<38} {'evals':>6} {'fewer':>6} {'blocks':>6} {'time s':>7} {'speedup':>7} "
            f"{'PSNR dB':>7} {'min':>5} {'acc %':>6} {'d acc':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        psnr_s = "inf" if r["psnr"] >= 99 else f"{r['psnr']:.1f}"
        min_s = "inf" if r["psnr_min"] >= 99 else f"{r['psnr_min']:.1f}"
        print(f"{r['config']:<38} {r['evals_fraction']:>6.1%} {r['evals_factor']:>5.2f}x {r['blocks_fraction']:>6.1%} "
              f"{r['seconds']:>7.2f} {r['speedup']:>6.2f}x {psnr_s:>7} {min_s:>5} {r['accuracy']:>6.1f} "
              f"{r['acc_points']:>+6.1f}")
    default = next((r for r in rows if r["config"] == "tea_cache default"), None)
    if default is not None:
        ok = (default["evals_factor"] >= TARGET["evals_factor"] and default["speedup"] >= TARGET["speedup"]
              and default["psnr"] >= TARGET["psnr"] and abs(default["acc_points"]) <= TARGET["acc_points"])
        print(f"target (tea_cache default: >= {TARGET['evals_factor']}x fewer evals, >= {TARGET['speedup']}x "
              f"speedup, PSNR >= {TARGET['psnr']:.0f} dB, accuracy within {TARGET['acc_points']:.0f} points): "
              f"{'MET' if ok else 'NOT MET'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
