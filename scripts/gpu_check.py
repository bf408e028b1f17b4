"""The Python half of ``scripts/gpu_check.sh`` (issue #36): probes of the GPU defects and a benchmark, one JSON
section each, printed as ``GPUCHECK {json}`` lines that the shell script gathers into ``$OUT/gpu_check.json``.

``python scripts/gpu_check.py probes`` / ``bench``; ``DEVICE=cpu`` dry-runs everything on the CPU at a shrunken
size (what CI runs, so the script cannot rot). Every section catches its own failure and reports it, so one broken
part never hides the others' results.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable

DEVICE = os.environ.get("DEVICE", "cuda")
DRY = DEVICE == "cpu"
#: the Qwen-Image transformer's published configuration (Qwen/Qwen-Image, transformer/config.json)
QWEN_IMAGE = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
              "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
              "axes_dims_rope": (16, 56, 56)}
#: the dry run's shrunken one (same code path, seconds on a CPU)
TINY = {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 2, "joint_attention_dim": 32, "guidance_embeds": False, "axes_dims_rope": (8, 4, 4)}


def emit(section: str, result: dict) -> None:
    print("GPUCHECK " + json.dumps({"section": section, **result}, default=str), flush=True)


def guarded(section: str, fn: Callable[[], dict]) -> None:
    t0 = time.monotonic()
    try:
        result = {"ok": True, **fn()}
    except Exception as exc:  # noqa: BLE001 - report and go on with the next section
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - t0, 2)
    emit(section, result)


def _platform() -> str:
    return "cpu" if DRY else "cuda"


# ------------------------------------------------------------------------------------------ probes
def probe_engine_process() -> dict:
    """No CUDA context in the engine's process (mp executor, start to first output to close), and outputs
    arrive as host tensors."""
    import torch

    from omni_core import Omni

    with Omni("shapes", executor="mp", platform=_platform(), warmup=False) as omni:
        (out,) = omni.generate("a red circle in the top left", num_inference_steps=2, seed=0, output_type="pt")
        initialised_mid = torch.cuda.is_initialized()
    return {"status": out.status, "error": out.error, "engine_cuda_initialised": initialised_mid
            or torch.cuda.is_initialized(), "output_device": str(out.tensor.device),
            "expect": {"engine_cuda_initialised": False, "output_device": "cpu"}}


def probe_peak_memory_per_request() -> dict:
    """``peak_memory_mb`` of a large request, then a small one: the small one reports its own peak."""
    from omni_core import Omni

    peaks = {}
    with Omni("shapes", executor="uni", platform=_platform(), warmup=False) as omni:
        for label, n in (("large", 4), ("small", 1)):  # 4: the shapes model's max_outputs
            (out,) = omni.generate("a blue square in the center", num_inference_steps=2, seed=0,
                                   num_outputs_per_prompt=n, output_type="pt")
            peaks[label] = out.metrics.get("peak_memory_mb")
    return {"peak_memory_mb": peaks, "per_request": DRY or peaks["small"] < peaks["large"],
            "note": "on the CPU the peak is the process's resident high-water mark (cannot be reset)"}


def probe_kernels() -> dict:
    """The GPU, and whether each attention backend and quantization method is usable here, with the reason
    (FA3 now accepted on sm8x, Sage's table with sm121)."""
    import torch

    from omni_core.plugins.availability import check_component
    from omni_core.plugins.manager import get_plugin_manager

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not DRY:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    pm = get_plugin_manager()
    info["attention"] = {}
    for name in sorted(pm.components("attention")):
        av = check_component("attention", name)
        info["attention"][name] = {"usable": av.ok, "reason": av.reason}
    from omni_core.optimize.quantize import METHODS, method_status

    info["quantization"] = {m: list(method_status(m, DEVICE)) for m in METHODS}
    return info


# ------------------------------------------------------------------------------------------ benchmark
def _qwen_inputs(cfg: dict, side: int, dtype: Any, device: Any) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    h = w = side // 16  # VAE /8, then 2x2 patches
    txt = 64
    return {"hidden_states": torch.randn(1, h * w, cfg["in_channels"], generator=g).to(device, dtype),
            "encoder_hidden_states": torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(device, dtype),
            "encoder_hidden_states_mask": torch.ones(1, txt, dtype=torch.bool, device=device),
            "img_shapes": [[(1, h, w)]]}


def bench_qwen_transformer() -> dict:
    """The Qwen-Image transformer at its published configuration with random bf16 weights, 1024x1024, 20
    steps: diffusers' own attention processor against Omni's attention layer with TORCH_SDPA and each installed
    faster kernel, on the same weights. Seconds per step, peak memory, and the output difference to diffusers.
    (The transformer is >95% of a step; the text encoder and VAE run once per request and are not timed.)"""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from omni_core.config import OmniDiffusionConfig
    from omni_core.forward_context import use_config
    from omni_model_qwen_image.attention import install_omni_attention

    cfg, side, steps = (TINY, 64, 2) if DRY else (QWEN_IMAGE, 1024, 20)
    dtype = torch.float32 if DRY else torch.bfloat16
    device = torch.device(DEVICE, 0) if not DRY else torch.device("cpu")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # random init directly in bf16 on the device (no fp32 copy of 20B weights)
    try:
        with torch.device(device):
            model = QwenImageTransformer2DModel(**cfg).eval()
    finally:
        torch.set_default_dtype(default)
    params = sum(p.numel() for p in model.parameters())
    inputs = _qwen_inputs(cfg, side, dtype, device)
    originals = {n: m.processor for n, m in model.named_modules()
                 if hasattr(m, "set_processor") and hasattr(m, "add_q_proj")}

    def sync() -> None:
        if not DRY:
            torch.cuda.synchronize()

    def run(label: str) -> tuple[dict, Any]:
        if not DRY:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        out = None
        with torch.inference_mode():
            model(timestep=torch.tensor([1000.0], device=device, dtype=dtype), return_dict=False, **inputs)  # warm
            sync()
            t0 = time.perf_counter()
            for i in range(steps):
                t = torch.tensor([1000.0 * (1 - i / steps)], device=device, dtype=dtype)
                out = model(timestep=t, return_dict=False, **inputs)[0]
            sync()
        per_step = (time.perf_counter() - t0) / steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if not DRY else 0.0
        return {"s_per_step": round(per_step, 4), "peak_gib": round(peak, 2)}, out.float()

    rows: dict[str, Any] = {}
    rows["diffusers"], ref = run("diffusers")
    from omni_core.plugins.availability import check_component
    from omni_core.plugins.manager import get_plugin_manager

    for name in sorted(get_plugin_manager().components("attention")):
        av = check_component("attention", name)
        if not av.ok:
            rows[f"omni {name}"] = {"skipped": av.reason}
            continue
        try:
            with use_config(OmniDiffusionConfig.from_kwargs(model="shapes", attention_backend=name)):
                install_omni_attention(model)
                rows[f"omni {name}"], got = run(name)
            rows[f"omni {name}"]["max_abs_diff_vs_diffusers"] = float((got - ref).abs().max())
        except Exception as exc:  # noqa: BLE001 - one kernel failing must not hide the others
            rows[f"omni {name}"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for n, m in model.named_modules():
                if n in originals:
                    m.set_processor(originals[n])
    return {"model": "QwenImageTransformer2DModel " + ("(shrunken, dry run)" if DRY else "(published config)"),
            "params": params, "dtype": str(dtype), "size": f"{side}x{side}", "steps": steps, "rows": rows}


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "all"
    if what in ("probes", "all"):
        guarded("probe_kernels", probe_kernels)
        guarded("probe_engine_process", probe_engine_process)
        guarded("probe_peak_memory_per_request", probe_peak_memory_per_request)
    if what in ("bench", "all"):
        guarded("bench_qwen_transformer", bench_qwen_transformer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
