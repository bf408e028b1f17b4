"""Weight-only quantization (torchao int8 / fp8) and GGUF single-file denoiser weights.

Built on torchao's ``quantize_`` and diffusers' GGUF loader, never on our own kernels. ``quantize_`` is applied to
the loaded modules, the same call for every model (a diffusers folder or ``shapes``), instead of diffusers'
``TorchAoConfig``: for int configs diffusers forces bfloat16 on the whole component (cpu-notes §11), which would
change the dtype the user asked for; ``quantize_`` on the loaded module is the same torchao path without that.

A method is checked before any model is loaded (:func:`method_status`): torchao must import and a tiny
quantized ``Linear`` must run on the device (fp8 on CUDA also needs compute capability 8.9), so a method that
cannot run here is refused at start-up with the reason, and ``omni env`` lists what is usable.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from omni_core.errors import ConfigError

logger = logging.getLogger("omni_core.optimize")

#: ``quantization=`` values -> torchao config class (weight-only)
METHODS = {"int8": "Int8WeightOnlyConfig", "fp8": "Float8WeightOnlyConfig"}
#: ``quantize_components`` alias for every denoiser the pipeline declares
DENOISER = "denoiser"
INSTALL_HINT = "pip install 'omni-core[quant]' (torchao, gguf)"


def torchao_config(method: str) -> Any:
    import torchao.quantization as tq

    return getattr(tq, METHODS[method])()


@functools.lru_cache(maxsize=None)
def method_status(method: str, device_type: str = "cpu") -> tuple[bool, str]:
    """``(usable, reason)`` for a quantization method on a device type: torchao imports, and a quantized
    ``Linear(32, 32)`` runs a forward there (the probe finds a dtype or kernel the device lacks).

    On an accelerator whose runtime this process has not initialised (the engine's process), the probe runs in
    a child process (:func:`~omni_core.optimize.device_probe.device_facts`), so asking creates no device
    context here."""
    if method not in METHODS:
        return False, f"unknown method (allowed: {', '.join(METHODS)})"
    try:
        import torch
        import torchao  # noqa: F401
    except ImportError as exc:
        return False, f"torchao is not installed ({exc}); {INSTALL_HINT}"
    from omni_core.optimize.device_probe import device_facts, probe_here

    if not probe_here(device_type):
        facts = device_facts(device_type)
        if "error" in facts:
            return False, f"cannot probe {device_type}: {facts['error']}"
        ok, why = facts["methods"].get(method, (False, f"the {device_type} probe did not report {method}"))
        return bool(ok), str(why)
    if method == "fp8" and device_type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            return False, f"fp8 needs compute capability >= 8.9 (Ada/Hopper); this GPU has {cap[0]}.{cap[1]}"
    try:
        from torchao.quantization import quantize_

        lin = torch.nn.Linear(32, 32).to(device_type)
        quantize_(lin, torchao_config(method))
        with torch.no_grad():
            lin(torch.randn(2, 32, device=device_type))
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot run here, say why
        return False, f"torchao {METHODS[method]} does not run on {device_type}: {type(exc).__name__}: {exc}"
    note = " (memory only: dequantized per matmul, not faster on CPU)" if device_type == "cpu" else ""
    return True, f"torchao {METHODS[method]}{note}"


def gguf_status() -> tuple[bool, str]:
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        return False, f"the gguf reader is not installed ({exc}); {INSTALL_HINT}"
    return True, "diffusers GGUFQuantizationConfig (Q8_0, Q4_0, ... dequantized per forward)"


def check_quantization(config: Any, device_type: str) -> None:
    """Refuse, before loading, a quantization method or GGUF file that cannot be used here, with the reason."""
    method = config.quantization
    if method not in (None, "none"):
        ok, why = method_status(method, device_type)
        if not ok:
            raise ConfigError(f"quantization={method!r} cannot run here: {why}. Usable here: "
                              f"{', '.join(m for m in METHODS if method_status(m, device_type)[0]) or 'none'}",
                              field="quantization")
    path = config.denoiser_weights
    if path is not None:
        if not path.endswith(".gguf") or not os.path.isfile(path):
            raise ConfigError(f"denoiser_weights={path!r} must be an existing .gguf file", field="denoiser_weights")
        ok, why = gguf_status()
        if not ok:
            raise ConfigError(f"denoiser_weights={path!r} cannot be read: {why}", field="denoiser_weights")


def resolve_components(names: Any, pipeline: Any, components: dict[str, Any]) -> list[str]:
    """Component names to quantize: ``"denoiser"`` stands for every declared denoiser; an unknown name is a
    ConfigError listing the pipeline's components."""
    from omni_core.utils.denoisers import denoiser_components

    out: list[str] = []
    for name in names:
        wanted = denoiser_components(pipeline) if name == DENOISER else [name]
        for w in wanted:
            if w not in components:
                raise ConfigError(f"quantize_components names {w!r}, which {type(pipeline).__name__} does not have; "
                                  f"its components: {', '.join(components)} (or {DENOISER!r})",
                                  field="quantize_components")
            if w not in out:
                out.append(w)
    return out


def quantize_pipeline(pipeline: Any, method: str, names: Any, device: Any = None) -> list[str]:
    """``torchao.quantize_`` (weight-only ``method``) on each named component's ``Linear`` layers; returns the
    names quantized. With ``device``, torchao moves each ``Linear`` there just before quantizing it, so the
    float weights never all sit on the device at once (the load plan's "quantize on the way" step); the rest of
    the component (norms, embeddings) is moved by the plan's placement step."""
    from torchao.quantization import quantize_

    from omni_core.optimize.components import components_of

    components = components_of(pipeline)
    done = resolve_components(names, pipeline, components)
    for name in done:
        quantize_(components[name], torchao_config(method), device=device)
    return done


# ------------------------------------------------------------------------------------------ GGUF
def gguf_denoiser_kwargs(pipeline_cls: Any, model_path: str, path: str, dtype: Any) -> dict[str, Any]:
    """``{denoiser name: module}`` loaded from a GGUF file by diffusers' ``from_single_file`` with
    ``GGUFQuantizationConfig`` (the folder's ``<denoiser>/config.json`` gives the architecture, nothing is
    fetched), to hand to ``from_pretrained`` as a component override. Only pipelines that load a diffusers
    folder and name the denoiser with a class that has single-file support can take one."""
    import diffusers
    from diffusers import GGUFQuantizationConfig

    from omni_core.utils.diffusers_folder import read_model_index

    names = list(getattr(pipeline_cls, "denoiser_names", ()) or ())
    index = read_model_index(model_path) or {}
    entry = index.get(names[0]) if names else None
    cls = getattr(diffusers, entry[1], None) if isinstance(entry, list) and entry[0] == "diffusers" else None
    if cls is None or not hasattr(cls, "from_single_file"):
        raise ConfigError(f"denoiser_weights: {pipeline_cls.__name__} does not load its denoiser with a diffusers "
                          f"class that has single-file (GGUF) support ({entry!r} in model_index.json); GGUF weights "
                          f"work for diffusers-folder models such as Qwen-Image, Wan, FLUX", field="denoiser_weights")
    module = cls.from_single_file(path, config=os.path.join(model_path, names[0]),
                                  quantization_config=GGUFQuantizationConfig(compute_dtype=dtype), torch_dtype=dtype)
    logger.info("denoiser %r loaded from GGUF %s (%s)", names[0], path, cls.__name__)
    return {names[0]: module}


def write_gguf(module: Any, path: str, arch: str, qtype: str = "Q8_0") -> str:
    """Write a module's state dict as a GGUF file with gguf-py (2-D weights whose rows split into blocks in
    ``qtype``, the rest F32), keys as diffusers names them (identity mapping, e.g. Qwen-Image): a way to make a
    GGUF file from a folder for tests, and for users whose model has no published GGUF."""
    import gguf

    q = getattr(gguf.GGMLQuantizationType, qtype)
    block = gguf.GGML_QUANT_SIZES[q][0]
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, tensor in module.state_dict().items():
        a = tensor.detach().float().cpu().numpy()
        if a.ndim == 2 and a.shape[1] % block == 0:
            writer.add_tensor(key, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            writer.add_tensor(key, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
