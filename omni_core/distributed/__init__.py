"""Parallel process groups (rank layout tp-sp-pp-cfg-dp), collectives and the CFG-parallel helper.

Worker integration::

    torch.distributed.init_process_group(backend, rank=rank, world_size=world_size, ...)
    init_parallel_state(config.parallel_config)        # creates every group; accessors below work
    ...
    destroy_parallel_state(); torch.distributed.destroy_process_group()

Importing this package does not import torch; the names below load on first access.
"""

from __future__ import annotations

from omni_core.utils.lazy import lazy_dir, lazy_exports

_LAZY = {
    "RankLayout": "omni_core.distributed.parallel_state:RankLayout",
    "validate_parallel_config": "omni_core.distributed.parallel_state:validate_parallel_config",
    "init_parallel_state": "omni_core.distributed.parallel_state:init_parallel_state",
    "destroy_parallel_state": "omni_core.distributed.parallel_state:destroy_parallel_state",
    "is_initialized": "omni_core.distributed.parallel_state:is_initialized",
    "get_world_group": "omni_core.distributed.parallel_state:get_world_group",
    "get_tp_group": "omni_core.distributed.parallel_state:get_tp_group",
    "get_sp_group": "omni_core.distributed.parallel_state:get_sp_group",
    "get_ulysses_group": "omni_core.distributed.parallel_state:get_ulysses_group",
    "get_ring_group": "omni_core.distributed.parallel_state:get_ring_group",
    "get_pp_group": "omni_core.distributed.parallel_state:get_pp_group",
    "get_cfg_group": "omni_core.distributed.parallel_state:get_cfg_group",
    "get_dp_group": "omni_core.distributed.parallel_state:get_dp_group",
    "get_group": "omni_core.distributed.parallel_state:get_group",
    "get_rank_layout": "omni_core.distributed.parallel_state:get_rank_layout",
    "get_parallel_config": "omni_core.distributed.parallel_state:get_parallel_config",
    "communication_stats": "omni_core.distributed.parallel_state:communication_stats",
    "reset_communication_stats": "omni_core.distributed.parallel_state:reset_communication_stats",
    "GroupCoordinator": "omni_core.distributed.group_coordinator:GroupCoordinator",
    "cfg_parallel_predict": "omni_core.distributed.cfg_parallel:cfg_parallel_predict",
    "cfg_combine": "omni_core.distributed.cfg_parallel:cfg_combine",
    "cfg_parallel_guidance": "omni_core.distributed.cfg_parallel:cfg_parallel_guidance",
    "spawn_workers": "omni_core.distributed.launch:spawn_workers",
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_exports(__name__, _LAZY)
__dir__ = lazy_dir(__name__, _LAZY)
