"""The weight operations of the Python API (``Omni`` binds them as methods; ``AsyncOmni`` awaits them in a thread):
what an RL trainer calls between rollout phases (docs/rollouts.md). ``self`` is the entry point; only its ``engine``
is used."""

from __future__ import annotations

from typing import Any

from omni_core.entrypoints.common import build_sampling_params_list


def _agreed(per_rank: list) -> Any:
    """The one value every rank returned (a checksum); ranks that disagree are an error naming them."""
    if len(set(per_rank)) != 1:
        raise RuntimeError(f"the model's ranks disagree: {per_rank}")
    return per_rank[0]


def update_weights(self, source: Any, target: str = "transformer", *, strict: bool = True,
                   in_flight: str = "finish", timeout: float | None = None) -> str:
    """Replace ``target``'s weights without a restart, all or nothing, from ``{name: tensor}`` or a safetensors
    file or folder; returns the new checksum. Requests held finish on the old weights (``in_flight="finish"``)
    or are aborted (``"abort"``); a refused update (an unknown name, a wrong shape, a missing tensor of a full
    update) leaves the old weights serving."""
    return _agreed(self.engine.weight_call("update_weights", (source, target, strict), in_flight=in_flight,
                                           timeout=timeout))


def update_lora(self, name: str, source: Any, *, in_flight: str = "finish", timeout: float | None = None) -> str:
    """LoRA-only sync: the adapter the engine knows as ``name`` (``loras``) becomes ``source`` (``{name:
    tensor}`` in diffusers' LoRA layout, or a safetensors file), loaded before it replaces the old one;
    returns its checksum. Requests asking for ``lora=name`` afterwards use it."""
    return _agreed(self.engine.weight_call("update_lora", (name, source), in_flight=in_flight, timeout=timeout))


def encode(self, prompt: str, negative_prompt: str | None = None, **sampling: Any) -> dict:
    """The model's text encodings of ``prompt`` (``prompt_embeds``, ``prompt_mask`` and, where the request runs
    CFG, the negative ones), computed as a request with these sampling fields would compute them."""
    from omni_core.request import OmniDiffusionRequest

    params = build_sampling_params_list(None, sampling, 1)[0]
    request = self.engine.prepare_request(OmniDiffusionRequest(prompt=prompt, negative_prompt=negative_prompt,
                                                               sampling_params=params))
    return self.engine.collective_rpc("encode_prompt", (request,))[0]


def weights_checksum(self, target: str = "transformer") -> str:
    """SHA-256 of ``target``'s tensors (every rank's must agree)."""
    return _agreed(self.engine.collective_rpc("weights_checksum", (target,)))


def release_memory(self, *, in_flight: str = "finish") -> int:
    """Free the model's memory between rollout phases (weights kept on the host); submissions are refused until
    :func:`resume_memory`. Returns the bytes released (rank 0's)."""
    return self.engine.release_memory(in_flight=in_flight)[0]


def resume_memory(self) -> int:
    """Put the model back where it ran; returns the bytes restored (rank 0's)."""
    return self.engine.resume_memory()[0]


__all__ = ["encode", "release_memory", "resume_memory", "update_lora", "update_weights", "weights_checksum"]
