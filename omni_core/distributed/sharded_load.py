"""Loading a denoiser for tensor parallelism: each rank reads only its shard of the weights, and the load plan's
``parallel`` step splits every declared denoiser of a pipeline (:func:`apply_tensor_parallel_to_pipeline`).

Why our own reader: diffusers' ``from_pretrained`` reads whole tensors; a rank of a model that does not fit one
device must never hold the whole weight, so the denoiser is built on ``meta`` (as diffusers' low-memory loading
does), split by :mod:`omni_core.distributed.tensor_parallel`, then filled from the safetensors with
``safe_open(...).get_slice`` reads of this rank's rows or columns only.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from omni_core.distributed.tensor_parallel import ParamShard, apply_tensor_parallel
from omni_core.errors import ConfigError


def _weight_files(folder: str) -> list[str]:
    """The safetensors files of a diffusers model folder (single file or sharded with an index)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    index = [n for n in os.listdir(folder) if n.endswith(".safetensors.index.json")]
    if index:
        with open(os.path.join(folder, index[0])) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    if not names:
        raise ConfigError(f"tensor parallelism reads safetensors shards, but {folder} has no *.safetensors file",
                          field="model")
    return [os.path.join(folder, n) for n in names]


def read_shards(module: nn.Module, folder: str, shards: Mapping[str, ParamShard], rank: int, tp: int, *,
                dtype: Any = None, device: Any = "cpu",
                observe: Callable[[str, tuple[int, ...]], None] | None = None) -> None:
    """Fill ``module`` (split by :func:`apply_tensor_parallel` while on ``meta``) from the safetensors in
    ``folder``: a split parameter reads only this rank's slice (``safe_open(...).get_slice``), never the whole
    tensor. ``observe(name, shape)`` sees every tensor as read. Missing or unexpected names are an error."""
    from safetensors import safe_open

    wanted = dict(module.state_dict(keep_vars=True))
    loaded: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in wanted:
                    continue
                shard = shards.get(key)
                if shard is None:
                    tensor = f.get_tensor(key)
                else:
                    view = f.get_slice(key)
                    pieces = []
                    for start, length in shard.ranges(rank, tp):
                        index = [slice(None)] * len(view.get_shape())
                        index[shard.dim] = slice(start, start + length)
                        pieces.append(view[tuple(index)])
                    tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=shard.dim)
                if observe is not None:
                    observe(key, tuple(tensor.shape))
                target = wanted[key]
                tensor = tensor.to(device=device, dtype=dtype if (dtype is not None and tensor.is_floating_point())
                                   else target.dtype if target.is_floating_point() else tensor.dtype)
                loaded[key] = tensor
    missing = [k for k, v in wanted.items() if k not in loaded and v.device.type == "meta"]
    if missing:
        raise ConfigError(f"the weights in {folder} lack {len(missing)} tensor(s) the model needs, e.g. "
                          f"{missing[:3]}", field="model")
    module.load_state_dict(loaded, strict=False, assign=True)
    for sub in module.modules():  # assign=True replaced parameters: keep them out of autograd as loaded ones are
        for p in sub.parameters(recurse=False):
            p.requires_grad_(False)


def build_on_meta(model_cls: Any, folder: str, dtype: Any = None) -> nn.Module:
    """``model_cls`` from the folder's ``config.json`` with parameters on ``meta`` and buffers real (computed
    tables such as rotary frequencies stay correct), the way diffusers' low-memory loading builds it."""
    from accelerate import init_empty_weights

    config = model_cls.load_config(folder)
    with init_empty_weights(include_buffers=False):
        module = model_cls.from_config(config)
    if dtype is not None:
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is not None and buf.is_floating_point() and buf.device.type != "meta":
                    sub._buffers[name] = buf.to(dtype)
    return module.eval()


def read_later(model_path: str, names: Any, model_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The denoiser components a pipeline's ``load`` should leave unread because tensor parallelism will read
    only this rank's shard of them (:func:`apply_tensor_parallel_to_pipeline`): every named component the
    folder has, when this process's ``tp`` group has several ranks and the caller did not pass it itself."""
    from omni_core.distributed.parallel_state import get_tp_group

    if get_tp_group().world_size == 1:
        return []
    return [n for n in names if os.path.isfile(os.path.join(model_path, n, "config.json"))
            and n not in (model_kwargs or {})]


def meta_component(model_path: str, name: str, dtype: Any = None) -> nn.Module:
    """Component ``name`` of a diffusers folder built from its config with its parameters on ``meta``
    (the class from ``model_index.json``), for :func:`read_shards` to fill."""
    import importlib

    with open(os.path.join(model_path, "model_index.json")) as f:
        library, class_name = json.load(f)[name]
    model_cls = getattr(importlib.import_module(library), class_name)
    return build_on_meta(model_cls, os.path.join(model_path, name), dtype)


def apply_tensor_parallel_to_pipeline(pipeline: Any, config: Any = None, device: Any = "cpu", dtype: Any = None,
                                      observe: Callable[[str, tuple[int, ...]], None] | None = None) -> dict:
    """Split every declared denoiser over this process's ``tp`` group (the load plan's ``parallel`` step, after
    ``init_parallel_state`` and the pipeline's ``load``): a denoiser the load left on ``meta``
    (:func:`read_later`) reads its shard from ``<model folder>/<denoiser name>``; one already read is sliced.
    Returns ``{denoiser: {"tp_size", "parameter_bytes" (this rank's), "largest_read": [name, elements] (None: it
    was sliced after a full read)}}``; ``{}`` without tensor parallelism."""
    from omni_core.distributed.parallel_state import get_tp_group
    from omni_core.utils.denoisers import denoisers_of

    group = get_tp_group()
    if group.world_size == 1:
        return {}
    out = {}
    for spec in denoisers_of(pipeline):
        module = spec.module
        if spec.tp_plan is None:
            raise ConfigError(f"{type(pipeline).__name__}'s denoiser {spec.name!r} declares no tp_plan, so "
                              f"tensor_parallel_size={group.world_size} cannot split it; allowed: 1",
                              field="parallel_config.tensor_parallel_size")
        shards = apply_tensor_parallel(module, spec.tp_plan, group)
        largest: list = [None, 0]

        def seen(name: str, shape: tuple[int, ...]) -> None:
            numel = int(torch.Size(shape).numel())
            if numel > largest[1]:
                largest[:] = [name, numel]
            if observe is not None:
                observe(name, shape)

        read = any(p.device.type == "meta" for p in module.parameters())
        elements = 0
        if read:
            component, prefix = _folder_component(pipeline, spec)
            folder = os.path.join(getattr(pipeline, "omni_model_path", None) or "", spec.name)
            read_shards(component, folder, {k[len(prefix):]: v for k, v in shards.items() if k.startswith(prefix)},
                        group.rank_in_group, group.world_size, dtype=dtype, device=device, observe=seen)
            elements = sum(p.numel() for p in component.parameters())
        out[spec.name] = {"tp_size": group.world_size, "parameter_bytes": parameter_bytes(module),
                          "largest_read": largest if read else None, "elements": elements}
    return out


def _folder_component(pipeline: Any, spec: Any) -> tuple[nn.Module, str]:
    """The module whose weights are the folder's ``<spec.name>/`` files, and its path prefix inside
    ``spec.module``: the spec's module itself, or the diffusers component it wraps (Z-Image's denoiser wraps
    ``pipe.transformer``)."""
    component = getattr(getattr(pipeline, "pipe", None), spec.name, None)
    if component is None or component is spec.module:
        return spec.module, ""
    for path, sub in spec.module.named_modules():
        if sub is component:
            return component, f"{path}."
    return spec.module, ""


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers as this rank holds them."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


__all__ = ["apply_tensor_parallel_to_pipeline", "build_on_meta", "meta_component", "parameter_bytes", "read_later",
           "read_shards"]
