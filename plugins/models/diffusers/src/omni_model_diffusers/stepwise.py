"""Step mode of the diffusers backend (tier 2): the request's own run through diffusers' modular blocks
(:mod:`omni_model_diffusers.modular`) on Omni's step-wise contract, mixed into the pipeline class. The encode and
decode stages apart split the same blocks (the text blocks, the blocks after the loop)."""

from __future__ import annotations

import contextlib
from typing import Any

from omni_core.outputs import DiffusionOutput
from omni_model_diffusers.modular import ModularRun


class ModularSteps:
    """What step mode adds to :class:`~omni_model_diffusers.pipeline.DiffusersCallPipeline`."""

    #: diffusers' modular pipeline over the same components (step mode only), or None
    modular: Any = None

    def modular_inputs(self, state: Any) -> dict[str, Any]:
        """The request as the modular pipeline's inputs (only those its blocks take)."""
        sp, request = state.sampling_params, state.request
        accepted = set(self.modular.blocks.input_names)
        inputs: dict[str, Any] = {"prompt": request.prompt, "generator": state.generator, "output_type": "pt"}
        if request.negative_prompt is not None:
            inputs["negative_prompt"] = request.negative_prompt
        for name, field in (("height", "height"), ("width", "width"), ("num_inference_steps", "num_inference_steps"),
                            ("num_frames", "num_frames"), ("max_sequence_length", "max_sequence_length"),
                            ("guidance_scale", "guidance_scale")):
            if getattr(sp, field) is not None:
                inputs[name] = getattr(sp, field)
        if (sp.num_outputs_per_prompt or 1) > 1 and self.per_prompt_outputs:
            inputs[self.per_prompt_outputs] = sp.num_outputs_per_prompt
        if request.images:
            from PIL import Image

            inputs["image"] = Image.fromarray(request.images[0].permute(1, 2, 0).contiguous().numpy())
        refused = [k for k in sp.extra_args if k not in accepted]
        if refused:
            raise ValueError(f"extra_args {refused} are not inputs of {type(self.modular).__name__}'s blocks (step "
                             f"mode); they take: {', '.join(sorted(accepted))}")
        inputs.update(sp.extra_args)
        return {k: v for k, v in inputs.items() if k in accepted or k == "generator"}

    def modular_run(self, state: Any, encodings: dict | None = None) -> ModularRun:
        return ModularRun(self.modular, self.modular_inputs(state), state.sampling_params.guidance_scale, encodings)

    @contextlib.contextmanager
    def encoded_prompts(self, states: list):
        """Step mode: each request's text blocks, run here (in line, or in the encode stage's process) or read from
        what the encode stage carried (``request.text_encodings``); ``prepare_encode`` then skips them."""
        if self.modular is None:
            yield None
            return
        from omni_core.pipelines.embedding_cache import carried_encodings

        memo = carried_encodings(states, self.device)
        if memo is None:
            memo = {}
            for state in states:
                run = self.modular_run(state)
                memo.setdefault(run.text_key(state.sampling_params.guidance_scale), run.encode())
        for state in states:
            key = self.modular_run(state).text_key(state.sampling_params.guidance_scale)
            state.text_encodings = {key: memo[key]} if key in memo else {}
        yield memo

    def prepare_encode(self, state: Any) -> Any:
        encodings = next(iter((getattr(state, "text_encodings", None) or {}).values()), None)
        run = self.modular_run(state, encodings)
        state.num_steps = run.prepare()
        state.step_index = 0
        state.extra["modular"] = run
        return state

    def denoise_step(self, states: list) -> list:
        """One loop step of each request's own blocks (each its own denoiser call)."""
        for state in states:
            state.latents = state.extra["modular"].step(state.step_index)
        return [None] * len(states)

    def step_scheduler(self, state: Any, noise_pred: Any) -> None:
        state.step_index += 1  # the loop step advanced the latents with the request's own scheduler

    def post_decode(self, state: Any) -> DiffusionOutput:
        run = state.extra.pop("modular", None)
        # state.latents stay: the last step's preview reads them. No run here: the decode stage's process
        tensor = run.finish() if run is not None else self.modular_run(state).decode(state.latents)
        return DiffusionOutput(request_id=state.request_id, tensor=tensor, finished=True,
                               step_index=state.step_index, num_steps=state.num_steps)

    def preview_latents(self, state: Any) -> Any:
        """The first row of the step's latents as a latent image (``[C, h, w]``, a video's ``[C, F, h, w]``);
        packed latents (FLUX's ``[seq, C * 4]``) unpacked by the pipeline's own ``_unpack_latents``; None when
        the layout is not one of these."""
        latents = state.latents
        if latents is None:
            return None
        if latents.dim() == 3:  # packed: [rows, seq, channels]
            unpack = getattr(self.pipe, "_unpack_latents", None)
            scale = getattr(self.pipe, "vae_scale_factor", None)
            if unpack is None or scale is None:
                return None
            sp = state.sampling_params
            try:
                latents = unpack(latents[:1], sp.height, sp.width, scale)
            except Exception:  # noqa: BLE001 - an unpacker of another signature: no preview, never a failure
                return None
            if latents.dim() == 5 and latents.shape[2] == 1:  # Qwen-Image's [B, C, 1, h, w]
                latents = latents[:, :, 0]
        return latents[0] if latents.dim() in (4, 5) else None


__all__ = ["ModularSteps"]
