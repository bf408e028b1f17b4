"""Memory and speed options on a small Qwen-Image folder, every option and combination measured in one run and
printed as one table.

    python bench/memory_speed.py                    # CPU: a 4-block, 256-wide Qwen-Image transformer, 64x64
    python bench/memory_speed.py --device cuda      # adds the GPU-only rows (fp8, group offload with streams)
    python bench/memory_speed.py --model DIR        # any Qwen-Image folder

Each row loads the folder through Omni's loader with the row's options (``omni_core.optimize``), runs one warm-up
request (compiles, for ``compile``), then ``--repeats`` requests of ``--steps`` steps with the same prompt and
seed. Columns:

* ``model MB``: ``stats()["model_bytes"]`` of the row (parameters and buffers per component, after quantization),
  the denoiser and the total;
* ``step``: the fastest per-step time of the denoiser (``denoise_step``) over the timed requests (the least
  disturbed by other work on a shared machine), and its ratio to the plain row (>1 = faster);
* ``PSNR``: dB of the row's image against the plain row's image (same prompt and seed; inf = identical).

On CPU, quantized weights are dequantized per matmul: they save memory and are *not* faster (torchao int8 ran
at ~0.9x on this machine); offload saves nothing (host and device memory are the same). GPU claims come only
from ``--device cuda`` rows.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

PROMPT = "a red fox jumping over a lazy dog in a snowy forest"


def build_folder(path: str) -> str:
    """A Qwen-Image folder whose transformer is big enough for timings (4 blocks, 4 heads x 64) and whose
    widths split into GGUF's 32-blocks; the rest as in the tiny test folders."""
    import torch
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from omni_model_qwen_image.testing import tiny_qwen_image_components

    parts = tiny_qwen_image_components()
    torch.manual_seed(0)
    parts["transformer"] = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=64, num_attention_heads=4,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(16, 24, 24))
    QwenImagePipeline(**parts).save_pretrained(path, safe_serialization=True)
    return path


def rows(device: str, gguf_path: str) -> list[tuple[str, dict, bool]]:
    """(name, options, gpu_only)."""
    small_tiles = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_sample_stride_height": 24,
                   "tile_sample_stride_width": 24}
    return [
        ("plain", {}, False),
        ("int8", {"quantization": "int8"}, False),
        ("int8 + text_encoder", {"quantization": "int8", "quantize_components": ["denoiser", "text_encoder"]}, False),
        ("fp8", {"quantization": "fp8"}, False),
        ("gguf Q8_0", {"denoiser_weights": gguf_path}, False),
        ("vae_slicing", {"vae_slicing": True}, False),
        ("vae_tiling (32px tiles)", {"vae_tiling": small_tiles}, False),
        ("compile", {"compile": True}, False),
        ("offload=model", {"offload": "model"}, False),
        ("offload=group", {"offload": "group"}, False),
        ("int8 + compile", {"quantization": "int8", "compile": True}, False),
        ("int8 + vae tiling + slicing", {"quantization": "int8", "vae_tiling": small_tiles, "vae_slicing": True},
         False),
        ("int8 + offload=group", {"quantization": "int8", "offload": "group"}, True),
    ]


def measure(folder: str, options: dict, device: str, args) -> dict:
    import torch

    from omni_core.config import OmniDiffusionConfig, SamplingParams
    from omni_core.optimize.components import model_bytes
    from omni_core.pipelines import StepState, load_pipeline, resolve_model
    from omni_core.request import OmniDiffusionRequest

    config = OmniDiffusionConfig(model=folder, dtype="float32", **options)
    pipe = load_pipeline(resolve_model(folder), config, device, torch.float32)
    times: list[float] = []
    inner = pipe.denoise_step

    def timed(states):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = inner(states)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    pipe.denoise_step = timed

    def once():
        sp = type(pipe).check_sampling_params(SamplingParams(seed=3, height=args.size, width=args.size,
                                                             num_inference_steps=args.steps, output_type="pt"), folder)
        state = StepState(request=OmniDiffusionRequest(prompt=PROMPT, sampling_params=sp),
                          generator=torch.Generator("cpu").manual_seed(3))
        with torch.inference_mode():
            return pipe.forward([state])[0].tensor.float().cpu()

    once()  # warm-up (compiles)
    times.clear()
    for _ in range(args.repeats):
        image = once()
    mb = model_bytes(pipe)
    failed = getattr(getattr(pipe, "omni_compile", None), "failed", None)
    return {"image": image, "step_s": min(times), "bytes": mb, "compile_failed": failed}


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds the GPU-only rows)")
    p.add_argument("--repeats", type=int, default=2, help="timed requests per row (fastest step time)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.set_defaults(steps=4, size=64)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    from omni_core.optimize.quantize import write_gguf

    tmp = tempfile.mkdtemp(prefix="omni-bench-memory-")
    folder = args.model or build_folder(os.path.join(tmp, "qwen"))
    from diffusers import QwenImageTransformer2DModel

    gguf_path = write_gguf(QwenImageTransformer2DModel.from_pretrained(os.path.join(folder, "transformer")),
                           os.path.join(tmp, "transformer-q8_0.gguf"), arch="qwen_image")
    print(f"memory_speed: {folder}, {args.size}x{args.size}, {args.steps} steps, {args.repeats} timed requests per row, "
          f"device {args.device}, torch {torch.__version__}; {_common.thread_header(args)}")
    results, plain = [], None
    header = f"{'option':<30} {'denoiser MB':>11} {'total MB':>9} {'step ms':>8} {'speed':>6} {'PSNR dB':>8}"
    print(header, flush=True)
    for name, options, gpu_only in rows(args.device, gguf_path):
        if gpu_only and args.device == "cpu":
            results.append({"row": name, "skipped": "GPU-only row (run with --device cuda)"})
            print(line(results[-1]), flush=True)
            continue
        try:
            r = measure(folder, options, args.device, args)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run here says why, the table goes on
            results.append({"row": name, "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"})
            print(line(results[-1]), flush=True)
            continue
        plain = plain or r
        mse = torch.mean((r["image"] - plain["image"]) ** 2).item()
        results.append({"row": name, "denoiser_mb": r["bytes"].get("transformer", 0) / 2**20,
                        "total_mb": sum(r["bytes"].values()) / 2**20, "step_ms": r["step_s"] * 1e3,
                        "speed": plain["step_s"] / r["step_s"],
                        "psnr": float("inf") if mse == 0 else 10 * math.log10(1 / mse),
                        "note": f"compile fell back: {r['compile_failed']}" if r["compile_failed"] else ""})
        print(line(results[-1]), flush=True)  # as measured, so a long run shows its progress
    print("\n" + header)
    for r in results:
        print(line(r))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def line(r: dict) -> str:
    if "skipped" in r:
        return f"{r['row']:<30} skipped: {r['skipped']}"
    return (f"{r['row']:<30} {r['denoiser_mb']:>11.2f} {r['total_mb']:>9.2f} {r['step_ms']:>8.1f} "
            f"{r['speed']:>5.2f}x {r['psnr']:>8.1f} {r['note']}")


if __name__ == "__main__":
    raise SystemExit(main())
