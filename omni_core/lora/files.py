"""Adapter files: where a request's ``lora`` points, what the file holds, and whether it fits the model.

Parsing and format conversion are diffusers' own (``<Pipeline>.lora_state_dict``, which runs its kohya /
non-diffusers converters for the model family), so a file Omni accepts is exactly one diffusers'
``load_lora_weights`` accepts. What diffusers does not do, and this module does, is refuse early: a file that
is not safetensors, targets modules the model does not have (a LoRA for another model), or has a rank above
``max_lora_rank`` is a :class:`~omni_core.errors.ConfigError` naming the field, raised in the engine process
before the request is queued. The model's module names are read from the folder's safetensors headers (a JSON
read; no weights, no model build).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping

import attrs

from omni_core.errors import ConfigError

#: the file name diffusers' ``save_lora_weights`` writes (a folder holding it may be named instead of the file)
WEIGHT_NAME = "pytorch_lora_weights.safetensors"


@attrs.frozen
class LoraInfo:
    """What an adapter file holds, after diffusers' conversion to its own naming."""

    path: str
    #: "diffusers/peft" (``lora_A``/``lora_B`` names) or "kohya" (``lora_down``/``lora_up``, converted by diffusers)
    format: str
    #: the largest rank of its layers
    rank: int
    #: ``lora_alpha`` from the file's metadata, or None (diffusers then uses alpha = rank)
    alpha: float | None
    #: the model components it targets (``transformer``) and their module paths, in file order
    components: tuple[str, ...]
    targets: tuple[str, ...]
    size_bytes: int

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "rank": self.rank, "alpha": self.alpha,
                "components": list(self.components), "num_targets": len(self.targets),
                "target_modules": sorted({_short(t) for t in self.targets}),
                "size_mb": round(self.size_bytes / 2**20, 3)}


def _short(module: str) -> str:
    """``transformer.blocks.0.attn.to_out.0`` -> ``to_out.0``; ``...attn.to_q`` -> ``to_q``."""
    parts = module.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]


def _header_keys(path: str) -> dict[str, Any]:
    """The tensor entries of a safetensors file's JSON header (name -> {dtype, shape, ...}); no tensor is read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError("its header is implausibly large")
        header = json.loads(f.read(n))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def resolve_lora_path(lora: str, loras: Mapping[str, str], field: str = "lora") -> str:
    """The adapter file ``lora`` means: a name of the engine's ``loras``, else a path (a ``.safetensors`` file,
    or a folder holding ``pytorch_lora_weights.safetensors``). Anything else is a ConfigError naming ``field``."""
    if lora in loras:
        path = os.fspath(loras[lora])
    elif os.sep in lora or lora.endswith(".safetensors") or os.path.exists(lora):
        path = lora
    else:
        known = ", ".join(sorted(loras)) or "none"
        raise ConfigError(f"{field}={lora!r} is not a known adapter (loaded by name: {known}) nor a path to a "
                          f".safetensors file", field=field)
    if os.path.isdir(path):
        path = os.path.join(path, WEIGHT_NAME)
    if not path.endswith(".safetensors"):
        raise ConfigError(f"{field}={lora!r}: {path!r} is not a .safetensors file (only safetensors adapters are "
                          f"loaded)", field=field)
    if not os.path.isfile(path):
        raise ConfigError(f"{field}={lora!r}: no such file {path!r}", field=field)
    return os.path.abspath(path)


def diffusers_loader(pipeline_cls: Any) -> Any:
    """The diffusers pipeline class whose LoRA loader (``lora_state_dict`` / ``load_lora_weights``) reads this
    model's adapters, or None: not diffusers-based, or diffusers has no loader for the family (HunyuanVideo 1.5)."""
    name = getattr(pipeline_cls, "diffusers_class", "")
    if not name:
        return None
    import diffusers

    klass = getattr(diffusers, name, None)
    return klass if hasattr(klass, "load_lora_weights") else None


def lora_supported(pipeline_cls: Any, model_path: str | None = None) -> bool:
    """Whether the model's pipeline loads LoRA: a diffusers-based pipeline whose diffusers class has diffusers'
    LoRA loader, or whose denoisers (in ``model_path``) take PEFT adapters themselves (diffusers'
    ``PeftAdapterMixin``: a family diffusers ships no loader for still loads adapters in diffusers' own naming)."""
    if diffusers_loader(pipeline_cls) is not None:
        return True
    return bool(getattr(pipeline_cls, "diffusers_class", "")) and denoisers_take_adapters(pipeline_cls, model_path)


def denoisers_take_adapters(pipeline_cls: Any, model_path: str | None) -> bool:
    """Whether the folder's denoiser components are diffusers models with the PEFT adapter mixin."""
    import importlib

    from omni_core.utils.diffusers_folder import library_module, read_model_index

    index = (read_model_index(model_path) or {}) if model_path else {}
    classes = []
    for name in getattr(pipeline_cls, "denoiser_names", ("transformer",)):
        entry = index.get(name)
        module = library_module(entry[0]) if isinstance(entry, list) and len(entry) == 2 else None
        if module is not None:
            classes.append(getattr(importlib.import_module(module), entry[1], None))
    if not classes:
        return False
    from diffusers.loaders.peft import PeftAdapterMixin

    return all(isinstance(c, type) and issubclass(c, PeftAdapterMixin) for c in classes)


def load_state_dict(path: str, pipeline_cls: Any) -> tuple[dict, dict | None]:
    """The adapter's state dict in diffusers' naming (``transformer.<module>.lora_A.weight``) and its metadata,
    through the model's own ``lora_state_dict`` (which converts kohya and other formats). A family diffusers has no
    loader for takes diffusers' own naming as its models write it (``save_lora_adapter``: no component prefix;
    ``save_lora_weights``: ``transformer.``; PEFT's ``base_model.model.``), read here."""
    loader = diffusers_loader(pipeline_cls)
    if loader is not None:
        # DiT loaders return (state_dict, metadata); the UNet ones (SD, SDXL) also the kohya alphas in between
        result = loader.lora_state_dict(path, return_lora_metadata=True)
        return dict(result[0]), result[-1]
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        state_dict = {k.removeprefix("base_model.model."): f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    components = tuple(getattr(pipeline_cls, "denoiser_names", ("transformer",)))
    if not any(k.split(".", 1)[0] in components for k in state_dict):
        state_dict = {f"{components[0]}.{k}": v for k, v in state_dict.items()}
    metadata = json.loads(meta["lora_adapter_metadata"]) if "lora_adapter_metadata" in meta else None
    return state_dict, metadata


def _model_modules(model_path: str, component: str) -> set[str] | None:
    """Module paths of ``component``'s weights in the folder (from the safetensors headers); None without files."""
    folder = os.path.join(model_path, component)
    if not os.path.isdir(folder):
        return None
    names: set[str] = set()
    index = [f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")]
    if index:
        with open(os.path.join(folder, index[0])) as f:
            names.update(json.load(f)["weight_map"])
    else:
        for f in os.listdir(folder):
            if f.endswith(".safetensors"):
                names.update(_header_keys(os.path.join(folder, f)))
    return {n.rsplit(".", 1)[0] for n in names} if names else None


_INFO_CACHE: dict[tuple, LoraInfo] = {}


def inspect_lora(path: str, pipeline_cls: Any, field: str = "lora") -> LoraInfo:
    """Read ``path`` (a resolved .safetensors file) with diffusers' converters -> :class:`LoraInfo`; a file that
    holds no LoRA layers is a ConfigError naming ``field``. Cached by path, size and modification time."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns, getattr(pipeline_cls, "diffusers_class", ""))
    if key in _INFO_CACHE:
        return _INFO_CACHE[key]
    try:
        raw = _header_keys(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: {path!r} is not a readable safetensors file ({exc})", field=field) from exc
    if any("lora_down" in k or k.startswith("lora_unet_") for k in raw):
        fmt = "kohya"
        if diffusers_loader(pipeline_cls) is None:
            raise ConfigError(f"{field}: {path!r} is a kohya-format LoRA; diffusers has no converter for "
                              f"{getattr(pipeline_cls, 'diffusers_class', pipeline_cls)} (it takes adapters in "
                              f"diffusers' own naming: lora_A/lora_B)", field=field)
    elif any("lora_A" in k or "lora.down" in k or "lora_B" in k for k in raw):
        fmt = "diffusers/peft"
    else:
        raise ConfigError(f"{field}: {path!r} holds no LoRA layers (no lora_A/lora_B or lora_down/lora_up "
                          f"tensors)", field=field)
    try:
        state_dict, metadata = load_state_dict(path, pipeline_cls)
    except Exception as exc:  # noqa: BLE001 - diffusers' converter refused the file
        raise ConfigError(f"{field}: {path!r} is not a LoRA diffusers can read for "
                          f"{pipeline_cls.diffusers_class}: {type(exc).__name__}: {exc}", field=field) from exc
    targets, components, rank = [], [], 0
    for k, v in state_dict.items():
        if ".lora_A." in k:
            module = k.split(".lora_A.")[0]
            component, _, rest = module.partition(".")
            if component not in components:
                components.append(component)
            targets.append(module)
            rank = max(rank, int(v.shape[0]))
    if not targets:
        raise ConfigError(f"{field}: {path!r} has no LoRA layers after diffusers' conversion for "
                          f"{pipeline_cls.diffusers_class}", field=field)
    alpha = None
    if isinstance(metadata, dict):  # diffusers flattens it as "<component>.lora_alpha"
        alpha = next((v for k, v in metadata.items() if k == "lora_alpha" or k.endswith(".lora_alpha")), None)
    info = LoraInfo(path=path, format=fmt, rank=rank, alpha=alpha, components=tuple(components),
                    targets=tuple(targets), size_bytes=st.st_size)
    _INFO_CACHE[key] = info
    return info


def fit_problems(info: LoraInfo, model_path: str | None, denoisers: tuple[str, ...]) -> list[str]:
    """Why the adapter does not fit the model folder (empty: it fits): components that are not denoisers, and
    target modules the denoiser's weights do not have."""
    problems = []
    for component in info.components:
        if component not in denoisers:
            problems.append(f"it targets {component!r}, not a denoiser of this model ({', '.join(denoisers)}): only "
                            f"denoiser adapters are applied")
            continue
        modules = _model_modules(model_path, component) if model_path else None
        if modules is None:
            continue
        missing = [t for t in info.targets if t.startswith(component + ".") and t[len(component) + 1:] not in modules]
        if missing:
            shown = ", ".join(m[len(component) + 1:] for m in missing[:3])
            problems.append(f"{len(missing)} of its {len(info.targets)} target modules are not in this model's "
                            f"{component} (e.g. {shown}): is it a LoRA for another model?")
    return problems


def check_lora_file(lora: str, loras: Mapping[str, str], pipeline_cls: Any, model_path: str | None,
                    max_lora_rank: int, field: str = "lora") -> LoraInfo:
    """Resolve, read and check one adapter against the model (every refusal a ConfigError naming ``field``)."""
    if not lora_supported(pipeline_cls, model_path):
        raise ConfigError(f"{field}={lora!r}: model {getattr(pipeline_cls, '__name__', pipeline_cls)} does not "
                          f"load LoRA adapters (only diffusers-based pipelines with diffusers' LoRA loader, or whose "
                          f"denoisers take PEFT adapters, do)", field=field)
    info = inspect_lora(resolve_lora_path(lora, loras, field), pipeline_cls, field)
    if info.rank > max_lora_rank:
        raise ConfigError(f"{field}={lora!r} has rank {info.rank}, above max_lora_rank={max_lora_rank} (start the "
                          f"engine with a larger max_lora_rank to accept it)", field=field)
    problems = fit_problems(info, model_path, tuple(getattr(pipeline_cls, "denoiser_names", ("transformer",))))
    if problems:
        raise ConfigError(f"{field}={lora!r} does not fit model {pipeline_cls.__name__}: " + "; ".join(problems),
                          field=field)
    return info


def check_engine_loras(config: Any, pipeline_cls: Any, model_path: str | None) -> None:
    """The engine's preloaded ``loras`` (before any worker starts): names are plain strings, files fit."""
    for name, path in config.loras.items():
        if not isinstance(name, str) or not name or os.sep in name or not isinstance(path, (str, os.PathLike)):
            raise ConfigError(f"loras: {name!r}: {path!r} is invalid: expected {{name: path}} with a plain name "
                              f"and a path", field="loras")
        check_lora_file(name, config.loras, pipeline_cls, model_path, config.max_lora_rank, field="loras")


def check_request_lora(params: Any, config: Any, pipeline_cls: Any, model_path: str | None) -> None:
    """A request's ``lora`` (engine process, before the request is queued); ``lora_scale``'s range is checked
    when ``SamplingParams`` is built."""
    if params.lora is None:
        return
    from omni_core.combinations import TENSOR_PARALLEL_LORA, tensor_parallel

    if tensor_parallel(config):
        raise ConfigError(f"lora={params.lora!r} cannot be used with parallel_config.tensor_parallel_size > 1: "
                          f"{TENSOR_PARALLEL_LORA}", field="lora")
    check_lora_file(params.lora, config.loras, pipeline_cls, model_path, config.max_lora_rank)
