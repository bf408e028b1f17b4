"""LoRA adapters per request, with different adapters in one batch (docs/lora.md).

* :mod:`omni_core.lora.files` -- reading an adapter file through diffusers' own ``lora_state_dict`` (and its
  kohya/other-format converters), what it targets, its rank, and whether it fits a model folder; the checks the
  engine runs on a request before any work (:func:`check_request_lora`).
* :mod:`omni_core.lora.manager` -- the worker side: an LRU cache of at most ``max_loras`` adapters loaded onto
  the denoiser with diffusers' ``load_lora_weights`` (peft layers), pinned while a request uses them, and the
  per-row application (each row of a batched denoiser call gets its own adapter and scale).

Importing this package imports neither torch nor diffusers; the functions do, when called.
"""

from __future__ import annotations

from omni_core.lora.files import (LoraInfo, check_engine_loras, check_request_lora, inspect_lora, lora_supported,
                                  resolve_lora_path)

__all__ = ["LoraInfo", "check_engine_loras", "check_request_lora", "inspect_lora", "lora_supported",
           "resolve_lora_path"]
