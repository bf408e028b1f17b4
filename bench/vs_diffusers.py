"""Omni vs diffusers on the same tiny model: one request's latency, and throughput for 8 concurrent requests.

    .venv/bin/python bench/vs_diffusers.py                    # every family, tiny random folders
    .venv/bin/python bench/vs_diffusers.py --model wan flux --steps 8 --repeats 5
    .venv/bin/python bench/vs_diffusers.py --folder /models/Qwen-Image --height 512 --width 512

For each model it prints, side by side:

* latency: the median wall time of one request through ``Omni(model=<folder>)`` (``Omni.generate``, engine,
  scheduler and executor included) over the median of diffusers' pipeline ``__call__`` on the same folder;
* throughput: 8 requests submitted together to Omni (``max_num_seqs=8``, request mode by default, so they run
  as one batch; ``--mode step`` for step waves) over diffusers running the same 8 requests one after another
  (requests per second, higher is better).

Both sides use float32 on the CPU (or ``--device``), the same prompts, seeds, size and steps, CFG on.
The tiny folders are built in a temp dir with the plugins' own builders (random weights; no download).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import attrs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a red fox jumping over a lazy dog in a snowy forest", "a cat", "an astronaut riding a horse on the moon",
           "a bowl of fruit on a wooden table", "city skyline at night, neon", "a lighthouse in a storm",
           "portrait of an old sailor", "a field of sunflowers under a blue sky"]
NEG = "blurry, low quality"


@attrs.frozen
class Family:
    """One model family as the bench runs it: its tiny folder builder, its size, and the keyword arguments both
    ``Omni.generate`` and diffusers' pipeline take (CFG on, as each family turns it on)."""

    label: str
    pipeline: str  # the diffusers class name of its folders (``--folder`` picks the family by it)
    builder: str  # "module:function(path, **builder_kwargs) -> folder"
    size: int
    call: dict
    builder_kwargs: dict = attrs.field(factory=dict)
    video: bool = False
    #: the family takes an input image (edit, image-to-video): both sides get the same PIL image
    image: bool = False
    #: "module:function(folder) -> dict" of extra ``from_pretrained`` kwargs for diffusers' side
    reference_kwargs: str | None = None


FAMILIES = {
    "qwen": Family("Qwen-Image (tiny)", "QwenImagePipeline", "omni_model_qwen_image.testing:build_tiny_qwen_image",
                   64, {"true_cfg_scale": 4.0}),
    "wan": Family("Wan 2.2 2-expert (tiny)", "WanPipeline", "omni_model_wan.testing:build_tiny_wan", 32,
                  {"guidance_scale": 5.0}, {"two_experts": True}, video=True),
    "flux": Family("FLUX.1-dev (tiny)", "FluxPipeline", "omni_model_flux.testing:build_tiny_flux", 64,
                   {"guidance_scale": 3.5, "true_cfg_scale": 2.0, "max_sequence_length": 64}),
    "z-image": Family("Z-Image (tiny)", "ZImagePipeline", "omni_model_z_image.testing:build_tiny_z_image", 64,
                      {"guidance_scale": 5.0, "max_sequence_length": 128}),
    "qwen-edit": Family("Qwen-Image-Edit (tiny)", "QwenImageEditPipeline",
                        "omni_model_qwen_image.testing:build_tiny_qwen_image_edit", 64, {"true_cfg_scale": 4.0},
                        image=True, reference_kwargs="omni_model_qwen_image.testing:diffusers_reference_kwargs"),
    "wan-i2v": Family("Wan 2.2 I2V 2-expert (tiny)", "WanImageToVideoPipeline",
                      "omni_model_wan.testing:build_tiny_wan_i2v", 32, {"guidance_scale": 5.0}, {"wan22": True},
                      video=True, image=True),
}


def load(ref: str):
    import importlib

    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def build_folder(family: Family, root: str) -> str:
    return load(family.builder)(os.path.join(root, family.builder.split(":")[1]), **family.builder_kwargs)


def call_kwargs(family: Family, args: argparse.Namespace) -> dict:
    """Keyword arguments valid for both ``Omni.generate`` and the diffusers pipeline."""
    common = {"height": args.height, "width": args.width, "num_inference_steps": args.steps, **family.call}
    return {**common, "num_frames": args.frames} if family.video else common


def input_image(size: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(family: Family, folder: str, args: argparse.Namespace) -> list[tuple[str, float, float, str]]:
    import torch

    from omni_core import Omni

    kwargs = call_kwargs(family, args)
    image = {"image": input_image(args.height)} if family.image else {}

    from diffusers import DiffusionPipeline

    extra = load(family.reference_kwargs)(folder) if family.reference_kwargs else {}
    ref = DiffusionPipeline.from_pretrained(folder, use_safetensors=True, **extra).to(args.device)
    ref.set_progress_bar_config(disable=True)

    def run_diffusers(prompt: str, seed: int):
        ref(prompt=prompt, negative_prompt=NEG, generator=torch.Generator(args.device).manual_seed(seed),
            output_type="pil", **image, **kwargs)

    n = len(PROMPTS)
    with Omni(folder, dtype="float32", warmup=False, max_num_seqs=n, step_execution=args.mode == "step") as omni:
        def run_omni(prompts: list[str], seed: int):
            omni.generate([{"prompt": p, "negative_prompt": NEG, **image} for p in prompts], seed=seed,
                          use_tqdm=False, **kwargs)

        run_omni(PROMPTS[:1], 0)  # warm both sides up (first-call allocations, lazy imports)
        run_omni(PROMPTS, 0)
        run_diffusers(PROMPTS[0], 0)
        lat_o, lat_d, thr_o, thr_d = [], [], [], []
        for r in range(args.repeats):  # interleaved, so drift in machine load hits both sides alike
            lat_o.append(timed(lambda: run_omni(PROMPTS[:1], r)))
            lat_d.append(timed(lambda: run_diffusers(PROMPTS[0], r)))
            thr_o.append(n / timed(lambda: run_omni(PROMPTS, r)))
            thr_d.append(n / timed(lambda: [run_diffusers(p, r) for p in PROMPTS]))
    lo, ld = statistics.median(lat_o), statistics.median(lat_d)
    to, td = statistics.median(thr_o), statistics.median(thr_d)
    return [("latency, 1 request (s, lower is better)", lo, ld, f"{lo / ld:.2f}x"),
            (f"throughput, {n} concurrent (req/s, higher is better)", to, td, f"{to / td:.2f}x")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", choices=(*FAMILIES, "all"), default=["all"],
                        help="families to run (default: all)")
    parser.add_argument("--folder", help="benchmark this diffusers folder instead of a tiny random one")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--height", type=int, default=None, help="default: the family's (64 for images, 32 for video)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=("request", "step"), default="request",
                        help="Omni's execution mode: whole requests per wave (default) or step waves")
    args = parser.parse_args(argv)

    import torch

    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads on both sides (torch's default: "
          f"{os.cpu_count()} cores), device {args.device}, {args.steps} steps, {args.repeats} repeats (medians), "
          f"interleaved, Omni in {args.mode} mode; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        kinds = list(FAMILIES) if "all" in args.model else list(dict.fromkeys(args.model))
        if args.folder is not None:
            from omni_core.pipelines.base import read_model_index

            name = (read_model_index(args.folder) or {}).get("_class_name")
            kinds = [next((k for k, f in FAMILIES.items() if f.pipeline == name), "qwen")]
        for kind in kinds:
            family = FAMILIES[kind]
            folder = args.folder or build_folder(family, root)
            a = argparse.Namespace(**{**vars(args), "height": args.height or family.size,
                                      "width": args.width or family.size})
            name = args.folder or family.label
            shape = f"{a.height}x{a.width}" + (f"x{a.frames}f" if family.video else "")
            for metric, omni, diff, ratio in bench(family, folder, a):
                rows.append((f"{name} {shape}", metric, omni, diff, ratio))
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)")
    print(f"\n{'model':<34} {'metric':<52} {'omni':>9} {'diffusers':>10} {'omni/diffusers':>15}")
    for model, metric, omni, diff, ratio in rows:
        print(f"{model:<34} {metric:<52} {omni:>9.3f} {diff:>10.3f} {ratio:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
