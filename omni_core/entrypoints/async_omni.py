"""``AsyncOmni``: the asyncio Python API (what the HTTP server uses).

    omni = AsyncOmni("shapes", streaming_output=True)
    async for out in omni.generate("a blue square in the center", {"seed": 1}):
        ...  # intermediate previews, then the final output
    await omni.close()
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from omni_core.engine.client import EngineClient
from omni_core.entrypoints import weights
from omni_core.entrypoints.common import (as_prompt_list, build_requests, build_sampling_params_list, engine_for,
                                          start_models)
from omni_core.errors import ConfigError, RequestFailedError
from omni_core.outputs import DiffusionOutput


class AsyncOmni:
    def __init__(self, model: str | None = None, *, models: Any = None, residency: Any = None, **config: Any) -> None:
        #: several models: the ``ModelFleet`` that keeps them within ``residency`` (None for one model)
        self.fleet, self.engines = start_models(model, models, residency, config)
        #: the (first) model's engine, used only through its client interface
        self.engine: EngineClient = engine_for(self.engines, None)
        #: its engine config (``OmniDiffusionConfig``, checked)
        self.config = getattr(self.engine, "config", None)

    async def generate(self, prompt: Any, sampling_params: Any = None, request_id: str | None = None, *,
                       model: str | None = None, **sampling_kwargs: Any) -> AsyncIterator[DiffusionOutput]:
        """Yield intermediate outputs (when streaming) and the final output last.

        ``sampling_params``: a ``SamplingParams``, a dict, None, or a list of one of those (vLLM's one-per-prompt
        convention, as ``Omni.generate`` takes it).

        An aborted request ends with a final output whose ``status`` is ``"aborted"``; a failed one raises
        :class:`RequestFailedError`. Leaving the loop early (or cancelling the task) aborts the request.
        """
        prompts = as_prompt_list(prompt)
        if len(prompts) != 1:
            raise ConfigError(f"AsyncOmni.generate takes one prompt, got a list of {len(prompts)}: call it once per "
                              f"prompt (concurrent requests share the engine's waves), or use Omni.generate",
                              field="prompt")
        # one SamplingParams, or vLLM's one-per-prompt list (here: of one)
        (params,) = build_sampling_params_list(sampling_params, sampling_kwargs, 1)
        (request,) = build_requests(prompts, params, request_id)
        engine = engine_for(self.engines, model)
        engine.prepare_request(request)  # refused before a model moves
        # a fleet's model may be loaded or wait for room first: off the event loop
        (handle,) = (await asyncio.to_thread(engine.submit, [request]) if self.fleet is not None
                     else engine.submit([request]))
        finished = False
        try:
            while not finished:
                out = await handle.aget()
                finished = out.finished
                if finished and out.status == "error":
                    raise RequestFailedError(f"request {handle.request_id} failed: {out.error}", [out])
                yield out
        finally:
            if not finished:  # the consumer left early or was cancelled: abort now, not at garbage collection
                handle.abort()

    async def abort(self, request_id: str, model: str | None = None) -> None:
        engine_for(self.engines, model).abort(request_id)

    def stats(self, model: str | None = None) -> dict[str, Any]:
        return engine_for(self.engines, model).stats()

    # ------------------------------------------------------------------ weights (RL trainers: docs/rollouts.md)
    async def update_weights(self, source: Any, target: str = "transformer", **kwargs: Any) -> str:
        """:meth:`Omni.update_weights`, awaited (the event loop runs on)."""
        return await asyncio.to_thread(weights.update_weights, self, source, target, **kwargs)

    async def update_lora(self, name: str, source: Any, **kwargs: Any) -> str:
        return await asyncio.to_thread(weights.update_lora, self, name, source, **kwargs)

    async def encode(self, prompt: str, negative_prompt: str | None = None, **sampling: Any) -> dict:
        return await asyncio.to_thread(weights.encode, self, prompt, negative_prompt, **sampling)

    async def weights_checksum(self, target: str = "transformer") -> str:
        return await asyncio.to_thread(weights.weights_checksum, self, target)

    async def release_memory(self, **kwargs: Any) -> int:
        return await asyncio.to_thread(weights.release_memory, self, **kwargs)

    async def resume_memory(self) -> int:
        return await asyncio.to_thread(weights.resume_memory, self)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, (self.fleet or self.engine).close)

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
