"""Ulysses and Ring for the diffusers backend, through diffusers' own context parallelism.

A diffusers transformer that declares a ``_cp_plan`` (FLUX.1, Wan, Qwen-Image, LTX-Video, ...) shards its token
sequence and runs attention over the shards by hooks diffusers installs (``apply_context_parallel``); Omni maps its
``ulysses_degree`` / ``ring_degree`` onto diffusers' ``ContextParallelConfig`` and lets every rank of the replica
run the same call. Nothing here computes attention.

Why not only ``ModelMixin.enable_parallelism``: in diffusers 0.42 it places the model on
``torch.device(accelerator, rank % torch.accelerator.device_count())``, which divides by zero on a machine with no
accelerator. With an accelerator we call it as is; without one (gloo on CPU, where Omni's tests run) we take the
same steps it takes, on a CPU device mesh: record the config on the model and its attention processors, then
``apply_context_parallel`` with the model's plan.
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError
from omni_model_diffusers.folder import component_config, denoiser_of


def _transformer_class(model_path: str) -> Any:
    """The diffusers class of the folder's transformer, or None (a UNet pipeline, a class diffusers lacks)."""
    import diffusers

    from omni_core.utils.diffusers_folder import read_model_index

    if denoiser_of(model_path) != "transformer":
        return None
    entry = (read_model_index(model_path) or {}).get("transformer")
    return getattr(diffusers, entry[1], None) if isinstance(entry, list) and len(entry) == 2 else None


def check_context_parallel(parallel_config: Any, model_path: str | None, pipeline: str) -> None:
    """Refuse, before any worker starts, Ulysses or Ring for a folder whose denoiser has no ``_cp_plan`` (a UNet,
    a transformer diffusers has not planned), and a Ulysses degree that does not divide its heads."""
    from omni_core.distributed import validate_parallel_config

    wanted = [s for s in ("ulysses", "ring") if s in parallel_config.requested_strategies()]
    if not wanted or model_path is None:
        return
    field = "ulysses_degree" if "ulysses" in wanted else "ring_degree"
    cls = _transformer_class(model_path)
    if cls is None or getattr(cls, "_cp_plan", None) is None:
        what = (f"its transformer {cls.__name__} declares no _cp_plan" if cls is not None else
                f"its denoiser is a {denoiser_of(model_path) or 'missing component'}, not a diffusers transformer")
        raise ConfigError(f"{field}: {pipeline} runs Ulysses and Ring through diffusers' context parallelism, and "
                          f"{what}; run it on one process (ulysses_degree=1, ring_degree=1) or with "
                          f"data_parallel_size", field=field)
    heads = component_config(model_path, "transformer").get("num_attention_heads")
    validate_parallel_config(parallel_config, num_heads=heads, model=f"{pipeline} ({cls.__name__})")


def enable_context_parallel(module: Any, parallel_config: Any) -> None:
    """Shard ``module`` (a diffusers transformer with a ``_cp_plan``) over this replica's ranks: Ulysses and Ring
    degrees as configured. Every rank of the replica must call it, and then run the same calls."""
    import torch
    from diffusers.models._modeling_parallel import ContextParallelConfig

    cp = ContextParallelConfig(ulysses_degree=parallel_config.ulysses_degree,
                               ring_degree=parallel_config.ring_degree)
    if torch.accelerator.is_available() and torch.accelerator.device_count() > 0:
        module.enable_parallelism(config=cp)  # diffusers checks the attention backend itself
        return
    _enable_on_cpu(module, cp)


def _enable_on_cpu(module: Any, cp: Any) -> None:
    """``enable_parallelism``'s steps with a CPU mesh (see the module's docstring for why)."""
    import torch
    import torch.distributed as dist
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    world = dist.get_world_size()
    if cp.ulysses_degree * cp.ring_degree != world:
        raise ConfigError(f"ulysses_degree x ring_degree must be this replica's world size ({world}) on the "
                          f"diffusers backend (cfg parallelism is not mapped)", field="parallel_config")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape=cp.mesh_shape,
                                                          mesh_dim_names=cp.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), world, torch.device("cpu"), mesh=mesh)
    module._parallel_config = config
    processors = [m.processor for m in module.modules() if getattr(m, "processor", None) is not None
                  and hasattr(m.processor, "_parallel_config")]
    for processor in processors:
        backend = getattr(processor, "_attention_backend", None)
        backend = (AttentionBackendName(backend) if backend is not None
                   else _AttentionBackendRegistry.get_active_backend()[0])
        if not _AttentionBackendRegistry._is_context_parallel_available(backend):
            raise ConfigError(f"attention backend {backend.value!r} of {type(module).__name__} has no context "
                              f"parallel path in diffusers; use attention_backend='sdpa'", field="attention_backend")
        if cp.ring_degree > 1 and backend == AttentionBackendName.NATIVE:
            raise ConfigError(f"ring_degree={cp.ring_degree}: diffusers' ring attention merges partial results by "
                              f"their log-sum-exp, which its native (sdpa) kernel does not return; use Ulysses "
                              f"(ulysses_degree) here, or a flash / cudnn / sage attention_backend on a GPU",
                              field="ring_degree")
        processor._parallel_config = config
    apply_context_parallel(module, cp, module._cp_plan)


def context_parallel_metrics(module: Any) -> dict:
    """What diffusers installed on ``module``, read back from it (a request's metrics carry it): the degrees its
    recorded config holds and how many of its modules shard their input (diffusers' ``cp_input`` hooks)."""
    config = getattr(module, "_parallel_config", None)
    cp = getattr(config, "context_parallel_config", None)
    if cp is None:
        return {}
    hooks = 0
    for sub in module.modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hooks += sum(name.startswith("cp_input---") for name in getattr(registry, "hooks", {}))
    return {"ulysses_degree": cp.ulysses_degree, "ring_degree": cp.ring_degree, "cp_sharded_inputs": hooks}


__all__ = ["check_context_parallel", "context_parallel_metrics", "enable_context_parallel"]
