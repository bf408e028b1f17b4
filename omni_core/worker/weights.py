"""Weight operations of a model process, reached through the engine's collective call (``Omni.update_weights``,
``weights_checksum``, ``release_memory``, ``resume_memory``; issue #52): what an RL trainer needs between rollout
phases without restarting the engine.

* **Update, all or nothing.** New values for a component's parameters and buffers (in-process tensors, or a
  safetensors file or folder) are checked in full against the loaded module first (every name known, every shape
  equal; a name missing from a full update, when ``strict``) and only then copied in place, so a refused update
  leaves the previous weights serving. Copying into the existing tensors keeps every hook, compiled region and
  tensor-parallel shard layout as it was.
* **A checksum** of a component (SHA-256 over its tensors in name order, as stored), which the trainer compares
  with its own.
* **Release and resume.** ``release_memory`` moves the model's tensors to host copies and frees their device
  storage (on the CPU: the process's own tensors are swapped for the copies, so what "device memory" the engine
  counts goes to zero); ``resume_memory`` puts them back. Outputs after a resume equal those before.

Why not diffusers' ``load_state_dict``: it replaces tensors (breaking hooks and shards) and checks nothing before it
writes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from omni_core.errors import ConfigError


def _read(source: Any) -> dict:
    """``{name: tensor}`` of ``source``: a mapping as given, tensors another process shared
    (:class:`~omni_core.utils.shared_tensors.SharedTensors`), or a ``.safetensors`` file, or a folder of them."""
    from omni_core.utils.shared_tensors import SharedTensors, open_tensors

    if isinstance(source, dict):
        return source
    if isinstance(source, SharedTensors):
        return open_tensors(source)
    from safetensors.torch import load_file

    path = str(source)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ConfigError(f"update_weights: {path!r} holds no .safetensors file", field="source")
        out: dict = {}
        for name in files:
            out.update(load_file(os.path.join(path, name)))
        return out
    if not os.path.isfile(path):
        raise ConfigError(f"update_weights: {path!r} is neither a folder nor a file", field="source")
    return load_file(path)


def _checksum(tensors: dict) -> str:
    """SHA-256 over ``{name: tensor}`` in name order: names, dtypes, shapes and bytes (what a trainer recomputes)."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


class WeightOps:
    """The model runner's weight operations (mixed into ``ModelRunner``; ``self.pipeline`` is the loaded one)."""

    pipeline: Any

    def _component(self, target: str) -> Any:
        from omni_core.optimize.components import components_of

        found = components_of(self.pipeline)
        if target not in found:
            raise ConfigError(f"update_weights: the pipeline has no component {target!r}; it has: "
                              f"{', '.join(found)}", field="target")
        return found[target]

    def update_weights(self, source: Any, target: str = "transformer", strict: bool = True) -> str:
        """Copy ``source``'s tensors into ``target``'s parameters and buffers, all or nothing; returns the new
        checksum. ``strict``: every tensor of the component must be given (a full update)."""
        import torch

        module = self._component(target)
        current = dict(module.state_dict(keep_vars=True))
        values = _read(source)
        unknown = sorted(set(values) - set(current))
        if unknown:
            raise ConfigError(f"update_weights: {target} has no tensor {unknown[0]!r} ({len(unknown)} unknown); "
                              f"nothing was changed", field="source")
        wrong = [(k, tuple(v.shape), tuple(current[k].shape)) for k, v in values.items()
                 if tuple(v.shape) != tuple(current[k].shape)]
        if wrong:
            name, got, want = wrong[0]
            raise ConfigError(f"update_weights: {target}.{name} has shape {list(want)}, the update gives "
                              f"{list(got)}; nothing was changed", field="source")
        missing = sorted(set(current) - set(values))
        if strict and missing:
            raise ConfigError(f"update_weights: a full update of {target} lacks {missing[0]!r} ({len(missing)} "
                              f"missing; pass strict=False to update some tensors); nothing was changed",
                              field="source")
        with torch.no_grad():
            for name, value in values.items():
                tensor = current[name]
                tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
        return self.weights_checksum(target)

    def update_lora(self, name: str, source: Any) -> str:
        """Replace the adapter the engine knows as ``name`` (``loras``) with ``source`` (``{name: tensor}`` in
        diffusers' LoRA layout, or a safetensors file), loaded before the name moves to it; returns its checksum."""
        import tempfile

        from safetensors.torch import save_file

        manager = getattr(self, "lora", None)
        if manager is None:
            raise ConfigError("update_lora: this pipeline runs no LoRA adapters (a diffusers-based model with peft "
                              "installed does)", field="lora")
        if name not in manager.config.loras:
            raise ConfigError(f"update_lora: {name!r} is not one of the engine's loras (known: "
                              f"{', '.join(sorted(manager.config.loras)) or 'none'})", field="lora")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in _read(source).items()}
        folder = getattr(self, "_lora_dir", None) or tempfile.mkdtemp(prefix="omni-lora-sync-")
        self._lora_dir = folder
        self._lora_versions = getattr(self, "_lora_versions", 0) + 1
        path = os.path.join(folder, f"{name}-{self._lora_versions}.safetensors")
        save_file(tensors, path)
        try:
            manager.replace(name, path)
        except Exception as exc:
            os.remove(path)
            raise ConfigError(f"update_lora: {name!r} could not load the new adapter ({type(exc).__name__}: {exc}); "
                              f"it keeps its previous one", field="source") from exc
        return _checksum(tensors)

    def weights_checksum(self, target: str = "transformer") -> str:
        """SHA-256 of ``target``'s tensors in name order (names, dtypes, shapes and bytes)."""
        return _checksum(self._component(target).state_dict())

    def encode_prompt(self, request: Any) -> dict:
        """The text encodings the model computes for ``request`` (a checked request: ``Omni.encode`` /
        ``POST /encode``), as its ``prepare_encode`` leaves them on the state: ``prompt_embeds``, ``prompt_mask`` and
        the negative ones where the request runs CFG (tensors on the host; None where the model sets none)."""
        import torch

        state = self.new_state(request)
        with torch.inference_mode(), self.pipeline.encoded_prompts([state]):
            self.pipeline.prepare_encode(state)
        names = ("prompt_embeds", "prompt_mask", "negative_prompt_embeds", "negative_prompt_mask")
        return {n: (getattr(state, n).detach().to("cpu") if isinstance(getattr(state, n), torch.Tensor) else None)
                for n in names}

    def memory_held(self) -> int:
        """Bytes the pipeline's components hold on their devices now (each storage once): what a multi-model
        server counts against its device budget (``omni_core.engine.fleet``). A released model holds none."""
        from omni_core.optimize.components import components_of

        seen: set = set()
        held = 0
        for module in components_of(self.pipeline).values():
            for tensor in module.state_dict(keep_vars=True).values():
                if tensor.numel() == 0 or tensor.device.type == "meta":
                    continue
                try:
                    key = (tensor.device, tensor.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):  # a tensor subclass without one plain storage
                    key = id(tensor)
                if key in seen:
                    continue
                seen.add(key)
                held += tensor.numel() * tensor.element_size()
        return held

    def release_memory(self) -> int:
        """Move every model tensor to a host copy and free its storage here; returns the bytes released."""
        from omni_core.optimize.components import components_of

        if getattr(self, "_released", None) is not None:
            return 0
        saved: dict = {}
        freed = 0
        for cname, module in components_of(self.pipeline).items():
            for name, tensor in module.state_dict(keep_vars=True).items():
                if any(t is tensor for t, _, _ in saved.values()):
                    continue  # a tied tensor (one object under two names): once
                saved[(cname, name)] = (tensor, tensor.detach().to("cpu", copy=True), tensor.device)
                freed += tensor.numel() * tensor.element_size()
                tensor.data = tensor.data.new_empty(0)
        self._released = saved
        return freed

    def resume_memory(self) -> int:
        """Put back what :meth:`release_memory` took; returns the bytes restored."""
        saved = getattr(self, "_released", None)
        if saved is None:
            return 0
        restored = 0
        for tensor, host, device in saved.values():
            tensor.data = host.to(device)
            restored += host.numel() * host.element_size()
        self._released = None
        return restored


__all__ = ["WeightOps"]
