"""``Omni``: the blocking Python API.

    with Omni("shapes") as omni:
        out = omni.generate("a red circle in the top left", seed=0)[0]
        out.images[0].save("out.png")
"""

from __future__ import annotations

import threading
from typing import Any

from omni_core.engine.client import EngineClient, start_engine
from omni_core.entrypoints.common import as_prompt_list, build_config, build_requests, build_sampling_params_list
from omni_core.errors import RequestFailedError
from omni_core.outputs import DiffusionOutput


class Omni:
    def __init__(self, model: str, **config: Any) -> None:
        self.config = build_config(model, config)
        #: the engine, used only through its client interface
        self.engine: EngineClient = start_engine(self.config)

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True,
                 **sampling_kwargs: Any) -> list[DiffusionOutput]:
        """One output per prompt, in order. Every request is validated before any is queued.

        ``sampling_params``: one ``SamplingParams`` (or dict) for every prompt, or -- vLLM's convention -- a list
        with one per prompt (different seeds, sizes or LoRA adapters in one call; compatible ones share a
        wave). Keyword arguments (``seed=0``) apply to every prompt."""
        prompts = as_prompt_list(prompts)
        params = build_sampling_params_list(sampling_params, sampling_kwargs, len(prompts))
        # validated here, once (submit does not check a prepared request again): the bar needs their step counts
        requests = [self.engine.prepare_request(r) for r in build_requests(prompts, params)]
        bar = _progress_bar(requests, use_tqdm)
        try:  # all at once, so compatible prompts share a wave
            handles = self.engine.submit(requests, on_progress=bar.step if bar is not None else None)
            outputs = [h.result() for h in handles]
        except BaseException:
            self.engine.abort([r.request_id for r in requests])
            raise
        finally:
            if bar is not None:
                bar.close()
        failed = [o for o in outputs if o.status == "error"]
        if failed:
            raise RequestFailedError("; ".join(f"request {o.request_id} failed: {o.error}" for o in failed), outputs)
        return outputs

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # ------------------------------------------------------------------ weights (RL trainers: docs/rollouts.md)
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
        :meth:`resume_memory`. Returns the bytes released (rank 0's)."""
        gate = self.engine.weights
        gate.released = True  # from now on a submission is refused, never run on released tensors
        try:
            return self.engine.weight_call("release_memory", in_flight=in_flight)[0]
        except BaseException:
            gate.released = False
            raise

    def resume_memory(self) -> int:
        """Put the model back where it ran; returns the bytes restored (rank 0's)."""
        restored = self.engine.collective_rpc("resume_memory")[0]
        self.engine.weights.released = False  # only once every rank has its tensors back
        return restored

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _agreed(per_rank: list) -> Any:
    """The one value every rank returned (a checksum); ranks that disagree are an error naming them."""
    if len(set(per_rank)) != 1:
        raise RuntimeError(f"the model's ranks disagree: {per_rank}")
    return per_rank[0]


class _Bar:
    """A tqdm bar over the denoising steps of every request of one ``generate`` call."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="denoising", unit="step")
        self._lock = threading.Lock()

    def step(self, request_id: str, step: int, total: int) -> None:
        with self._lock:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _progress_bar(requests: list, enabled: bool) -> _Bar | None:
    if not enabled:
        return None
    try:
        return _Bar(sum(r.sampling_params.num_inference_steps or 0 for r in requests))
    except ImportError:
        return None
