"""The process half of the stage contract (``encode_workers`` / ``decode_workers``; :mod:`omni_core.worker.stages`
runs the stage processes): the payload a finished request carries to the decode stage, and a stage's model bytes.
The pipeline half (which components each stage needs, the config checks, loading one side of the split) is
:mod:`omni_core.pipelines.stages`; its names are importable here too."""

from __future__ import annotations

import itertools
import os
from typing import Any

import attrs

from omni_core.pipelines.stages import (DECODE, DENOISE, ENCODE, STAGES, check_stage_config,  # noqa: F401
                                        config_only_component, declared_stages, diffusers_stage_kwargs,
                                        drop_stage_components, stage_device, stages_apart)


def model_bytes_of_stage(pipeline: Any) -> dict[str, int]:
    """``stats()["model_bytes"]`` of a split process: its components less the config-only stand-ins."""
    from omni_core.optimize.components import components_of, module_bytes

    return {name: module_bytes(m) for name, m in components_of(pipeline).items()
            if not getattr(m, "omni_config_only", False)}


# ---------------------------------------------------------------------------------------------- the payload
def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@attrs.define
class DecodePayload:
    """What the decode stage needs of a finished request: its final latents, request and plain state fields.
    Rides sealed in ``DiffusionOutput.tensor`` from the model process through the engine (pending decode, never
    opened there) to the decode stage; ``group`` and
    ``group_size`` keep the requests one ``post_decode_batch`` call decoded together in line together."""

    request: Any
    latents: Any
    step_index: int
    num_steps: int
    extra: dict
    group: str = ""
    group_size: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @classmethod
    def of(cls, state: Any, group: str, group_size: int) -> DecodePayload:
        latents = state.latents.detach().to("cpu") if state.latents is not None else None
        request = state.request
        if getattr(request, "text_encodings", None) is not None:  # the decode process does not need them
            request = attrs.evolve(request, text_encodings=None)
        return cls(request=request, latents=latents, step_index=state.step_index, num_steps=state.num_steps,
                   extra={k: v for k, v in state.extra.items() if _plain(v)}, group=group, group_size=group_size)

    def state(self, device: Any) -> Any:
        from omni_core.pipelines.state import StepState

        latents = self.latents.to(device) if self.latents is not None else None
        return StepState(request=self.request, latents=latents, step_index=self.step_index,
                         num_steps=self.num_steps, extra=dict(self.extra))


_groups = itertools.count()


def defer_decode(pipeline: Any, by_value: bool = False, mode: Any = None) -> None:
    """Make ``pipeline``'s decode hand back payloads (both execution modes go through ``post_decode_batch``), each
    :class:`~omni_core.worker.transport.Sealed` here: the engine passes it to the decode stage without rebuilding
    its latents (``mode``: the executor's :class:`~omni_core.worker.transport.SealMode`, shared memory by default;
    ``by_value``: the tensors' bytes)."""
    from omni_core.outputs import DiffusionOutput
    from omni_core.worker.transport import Sealed

    def post_decode_batch(states: list) -> list:
        group = f"{os.getpid()}-{next(_groups)}"
        return [DiffusionOutput(request_id=s.request_id, finished=True, step_index=s.step_index,
                                num_steps=s.num_steps,
                                tensor=Sealed.seal(DecodePayload.of(s, group, len(states)), by_value=by_value,
                                                   mode=mode, decode=True, group=group, request_id=s.request_id))
                for s in states]

    pipeline.post_decode_batch = post_decode_batch
    pipeline.post_decode = lambda state: post_decode_batch([state])[0]


def pending_decode(out: Any) -> bool:
    """Whether a runner's output is a sealed decode payload (the decode stage makes the pixels)."""
    from omni_core.worker.transport import Sealed

    tensor = getattr(out, "tensor", None)
    return isinstance(tensor, Sealed) and tensor.meta.get("decode", False)


__all__ = ["DECODE", "DENOISE", "ENCODE", "STAGES", "DecodePayload", "check_stage_config", "config_only_component",
           "declared_stages", "defer_decode", "diffusers_stage_kwargs", "drop_stage_components", "model_bytes_of_stage",
           "pending_decode", "stage_device", "stages_apart"]
