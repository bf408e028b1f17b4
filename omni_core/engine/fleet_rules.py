"""The rules a ``ModelFleet`` applies, apart from its state: what a model is estimated to hold before its first
load, which executor a fleet's model runs on, when an engine is idle, and the words of its refusals."""

from __future__ import annotations

import logging
import os
from typing import Any

from omni_core.config.fleet import FleetModel
from omni_core.errors import ConfigError, ResidencyError

logger = logging.getLogger("omni_core.engine.fleet")

#: suffixes of weight files counted by the estimate made before a model's first load
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weight_file_bytes(folder: str) -> int:
    """Bytes of the weight files under ``folder`` (0 for a model without a folder, such as a built-in one)."""
    total = 0
    if not folder or not os.path.isdir(folder):
        return 0
    for root, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(WEIGHT_SUFFIXES))
    return total



def own_process(entry: FleetModel, served: int) -> str:
    """The executor of a fleet's model: one that runs it in processes of its own (``mp`` unless another is named).

    Why not in the server's process: a load patches torch process-wide while it runs (diffusers' ``no_init_weights``
    and accelerate's ``init_empty_weights`` replace ``torch.nn.init`` and ``Module.register_parameter``), so loading
    one model beside another that computes in the same process corrupts the other (seen: meta tensors in a running
    model); and one model's crash must not take the others down."""
    executor = entry.options.get("executor") or "mp"
    if executor == "uni" and served > 1:
        raise ConfigError(f"model {entry.name!r}: executor='uni' runs the model in the server's process, which several "
                          f"models cannot share (a load patches torch process-wide while another model computes, and "
                          f"one model's crash would end the others); leave executor out (each model then runs in "
                          f"processes of its own: 'mp') or name a multi-process executor", field="executor")
    return executor


def is_idle(engine: Any) -> bool:
    try:
        stats = engine.stats()
    except Exception:  # noqa: BLE001 - a dead or closed engine runs nothing
        return True
    return not stats.get("tracked_requests") and not stats.get("waiting") and not stats.get("running")


def close_quietly(engine: Any) -> None:
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - a dead engine's close may complain; it is gone either way
        logger.debug("closing an engine failed", exc_info=True)


def too_big(slot: Any, budget: int, source: str) -> str:
    return (f"model {slot.name!r} cannot fit the device budget alone: {slot.weight_bytes} bytes of weights "
            f"({source}) + {slot.working_bytes} working = {slot.charge} > device_budget={budget}")


def contention_error(slot: Any, holders: list[str], residency: Any) -> ResidencyError:
    how = ("at once (contention='fail')" if residency.contention == "fail"
           else f"within wait_timeout_s={residency.wait_timeout_s:g}")
    return ResidencyError(f"model {slot.name!r} cannot be brought onto the device {how}: the device budget "
                          f"({residency.device_budget} bytes) is held by models with work in flight or pinned: "
                          f"{', '.join(holders) or '(none)'}", model=slot.name, holders=holders)


__all__ = ["WEIGHT_SUFFIXES", "close_quietly", "contention_error", "is_idle", "own_process", "too_big",
           "weight_file_bytes"]
