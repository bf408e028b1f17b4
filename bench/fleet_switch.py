"""Switching models within a device budget: to a model kept in host memory against one loaded cold.

    .venv/bin/python bench/fleet_switch.py [--rounds 5] [--layers 4] [--heads 8]

Two models (the same random-weight Qwen-Image folder twice, its transformer widened to ``--heads`` x 128 and
``--layers`` blocks so the weights are not trivial) behind one ``ModelFleet`` whose device budget holds one. A
switch is the time for the other model's lease (what a request to it waits before it is admitted): the resident
one is evicted and the other brought in. Two fleets, paired per round (order alternating):

* **host**: the evicted model keeps host copies (``host_budget`` unlimited), so a switch is a copy back
  (``resume_memory``), no process start, no disk read;
* **cold**: ``host_budget=0``, so an evicted model is unloaded and a switch loads the other from disk (its
  processes start, diffusers reads the weights).

Prints each row's median, the ratio (the bar in issue #53: host at least 5x faster than cold), and the load average
before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_folder(path: str, layers: int, heads: int) -> str:
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    import torch

    from omni_core.testing.diffusers_folders import tiny_qwen_image_components

    parts = tiny_qwen_image_components()
    torch.manual_seed(0)
    parts["transformer"] = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=layers, attention_head_dim=128,
        num_attention_heads=heads, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    QwenImagePipeline(**parts).save_pretrained(path, safe_serialization=True)
    return path


def switch_s(fleet, name: str) -> float:
    started = time.perf_counter()
    with fleet.lease(name):
        pass
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    args = p.parse_args()

    from omni_core.config.fleet import FleetConfig
    from omni_core.engine.client import start_fleet

    load_before = os.getloadavg()
    folder = build_folder(tempfile.mkdtemp(prefix="omni-bench-fleet-"), args.layers, args.heads)
    common = {"warmup": False}
    fleets = {}
    for row, host_budget in (("host", None), ("cold", 0)):
        probe = FleetConfig.from_specs([f"a={folder}", f"b={folder}"], common=common)
        fleet = start_fleet(FleetConfig(models=probe.models, residency={"host_budget": host_budget}))
        (estimated, _) = fleet.states()  # from the weight files
        with fleet.lease("a"):
            pass
        (a, _) = fleet.states()
        fleet.close()
        budget = max(s["weight_bytes"] + s["working_bytes"] for s in (estimated, a)) + 1  # one fits, two do not
        fleet = start_fleet(FleetConfig(models=probe.models, residency={"host_budget": host_budget,
                                                                        "device_budget": budget}))
        switch_s(fleet, "a")
        switch_s(fleet, "b")  # both loaded once: host keeps a's copy now
        fleets[row] = fleet
    weights_mb = a["weight_bytes"] / 1e6
    times: dict[str, list[float]] = {"host": [], "cold": []}
    for r in range(args.rounds):
        order = ("host", "cold") if r % 2 == 0 else ("cold", "host")
        for row in order:
            times[row].append(switch_s(fleets[row], "a" if r % 2 == 0 else "b"))
    for fleet in fleets.values():
        fleet.close()
    host, cold = statistics.median(times["host"]), statistics.median(times["cold"])
    print(f"model: Qwen-Image, transformer {args.layers} blocks x {args.heads} heads; pipeline {weights_mb:.0f} MB")
    print(f"{'row':<6} {'median switch s':>16}   all")
    for row in ("host", "cold"):
        print(f"{row:<6} {statistics.median(times[row]):>16.3f}   {', '.join(f'{t:.3f}' for t in times[row])}")
    print(f"cold / host: {cold / host:.1f}x (bar: >= 5x)")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
