"""``offload="model"``: whole components brought to the execution device in turn, in a ring.

An ``offload``-stage :class:`ModelOffload` hook (:mod:`omni_core.hooks`' registry, named
:data:`MODEL_OFFLOAD_HOOK`) on each component brings it in before its ``forward`` and evicts the component that
ran before it (:class:`OffloadRing`). This is accelerate's ``CpuOffload`` logic (what diffusers'
``enable_model_cpu_offload`` uses) written as our hook, because accelerate's hooks are not ours to keep:
diffusers' ``load_lora_weights`` strips every accelerate offload hook and re-enables its own
``enable_model_cpu_offload()`` without a device (GPU 0 on rank N; on CPU it raises and leaves none), so a LoRA
loaded at run time would break offload. The hook is also the component's ``_hf_hook``, the protocol diffusers'
``apply_forward_hook`` follows for ``vae.encode`` / ``vae.decode`` (which do not go through ``forward``); it is
neither a ``CpuOffload`` nor an ``AlignDevicesHook``, so diffusers' LoRA loader leaves it in place.
"""

from __future__ import annotations

from typing import Any

from omni_core.hooks import STAGES, ModuleHook

#: the registry name of the model-offload hook on every component
MODEL_OFFLOAD_HOOK = "offload.model"


class OffloadRing:
    """Which component is on the execution device now: bringing one in sends the previous one home."""

    def __init__(self, device: Any) -> None:
        import threading

        import torch

        self.device = torch.device(device)
        self.current: Any = None
        self._lock = threading.Lock()

    def bring_in(self, module: Any) -> None:
        import torch

        # outside inference mode: the runner calls in inference mode, where moving a tensor-subclass weight
        # (torchao's int8) fails ("Couldn't swap Linear.weight": an inference tensor has no version counter)
        with self._lock, torch.inference_mode(False):
            if self.current is module:
                return
            if self.current is not None:
                self.current.to("cpu")
                if self.device.type != "cpu":
                    getattr(torch, self.device.type).empty_cache()  # what accelerate's clear_device_cache does
            module.to(self.device)
            self.current = module


class ModelOffload(ModuleHook):
    """``offload``-stage hook of ``"model"`` offload: the component comes in before it runs (``forward``, and
    ``encode``/``decode`` through ``_hf_hook``), its tensor arguments with it; the ring evicts the previous one."""

    order = STAGES["offload"]

    def __init__(self, ring: OffloadRing) -> None:
        super().__init__()
        self.ring = ring

    def initialize_hook(self, module: Any) -> Any:
        module.to("cpu")
        module._hf_hook = self  # diffusers' apply_forward_hook (vae.encode/decode) calls _hf_hook.pre_forward
        return module

    def deinitalize_hook(self, module: Any) -> Any:  # (sic: diffusers' spelling)
        if module.__dict__.get("_hf_hook") is self:
            del module._hf_hook
        return module

    def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        from accelerate.utils import send_to_device

        self.ring.bring_in(module)
        device = self.ring.device
        return send_to_device(args, device), send_to_device(kwargs, device)


__all__ = ["MODEL_OFFLOAD_HOOK", "ModelOffload", "OffloadRing"]
