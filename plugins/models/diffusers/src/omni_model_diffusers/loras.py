"""LoRA adapters for the diffusers backend: one adapter (or none) per call, through diffusers' own loader.

Omni's per-row LoRA (:mod:`omni_core.lora.manager`) mixes adapters inside one denoiser call because a native
pipeline tells it which rows belong to which request; a diffusers pipeline's own call folds its rows (CFG and all)
where Omni cannot see them, so here the requests of one call share its adapter (the call key includes it) and the
pipeline is switched per call with diffusers' ``set_adapters`` / ``disable_lora``. Adapters load on first use
(``loras`` preloaded at start), least recently used ones unload beyond ``max_loras``.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

from omni_core.lora.files import resolve_lora_path

logger = logging.getLogger("omni_model_diffusers")


class CallLoras:
    def __init__(self, pipe: Any, config: Any) -> None:
        self.pipe, self.config = pipe, config
        #: adapter file -> adapter name in the pipeline, least recently used first
        self.loaded: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._count = 0
        self._active: tuple[str, float] | None = None

    def preload(self) -> None:
        for name in list(getattr(self.config, "loras", {}) or {})[: self.config.max_loras]:
            self._load(resolve_lora_path(name, self.config.loras, "loras"))

    def use(self, lora: str | None, scale: float) -> None:
        """Make the next call run with adapter ``lora`` at ``scale`` (None: no adapter)."""
        if lora is None:
            if self.loaded and self._active is not None:
                self.pipe.disable_lora()
                self._active = None
            return
        name = self._load(resolve_lora_path(lora, self.config.loras))
        if self._active != (name, scale):
            self.pipe.enable_lora()
            self.pipe.set_adapters([name], adapter_weights=[scale])
            self._active = (name, scale)

    def _load(self, path: str) -> str:
        import torch

        if path in self.loaded:
            self.loaded.move_to_end(path)
            return self.loaded[path]
        while len(self.loaded) >= self.config.max_loras:
            old_path, old = self.loaded.popitem(last=False)
            self.pipe.delete_adapters(old)
            if self._active is not None and self._active[0] == old:
                self._active = None
            logger.info("LoRA %s unloaded (LRU, max_loras=%d)", old_path, self.config.max_loras)
        self._count += 1
        name = f"omni_lora_{self._count}"
        with torch.inference_mode(False):  # the runner calls in inference mode; diffusers' loader copies weights
            self.pipe.load_lora_weights(os.path.dirname(path), weight_name=os.path.basename(path), adapter_name=name)
        self.loaded[path] = name
        self._active = (name, None)  # diffusers activates a loaded adapter: the next call sets or disables it
        logger.info("LoRA %s loaded as %s", path, name)
        return name


__all__ = ["CallLoras"]
