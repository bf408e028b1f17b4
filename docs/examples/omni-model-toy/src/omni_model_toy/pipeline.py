"""``ToyPipeline``: prompt -> 16x16 RGB image with classifier-free guidance, step-wise and request-batched.

The worker calls ``load`` once, then per request ``prepare_encode``, ``denoise_step`` (with other requests,
possibly at other steps) and ``step_scheduler`` until done, then ``post_decode``; ``denoisers()`` tells
cache backends and sequence parallelism everything they need, so the model gets them by declaration.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_core.errors import ConfigError
from omni_core.forward_context import use_denoise_call
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines import OmniPipeline, StepState
from omni_core.pipelines.base import read_model_index
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.text_window import TextEncodingWindow
from omni_model_toy.model import ToyDiT, ToyTextEncoder

#: prompts are cut or padded to this many words
MAX_WORDS = 16
#: TeaCache defaults for the seeded random weights: the identity polynomial (the relative change of block 0's
#: modulated input is used as is) and a threshold that, at 20 steps, reuses 18 of 40 evaluations at ~53 dB PSNR
TEA_CACHE = {"coefficients": (1.0, 0.0), "rel_l1_thresh": 0.1, "warmup_steps": 2}


class ToyPipeline(TextEncodingWindow, OmniPipeline):
    supported_parallel = ("tensor", "ulysses", "ring")
    # what each stage needs, so `encode_workers=1` / `decode_workers=1` can load them apart; the decode is
    # arithmetic on the latents (no component)
    stage_components = {"encode": ("text_encoder",), "decode": ()}
    size_multiple = 2  # the patch size
    default_height = default_width = 16
    default_num_inference_steps = 20
    default_guidance_scale = 4.0

    def __init__(self, transformer: ToyDiT, text_encoder: ToyTextEncoder,
                 scheduler: FlowMatchEulerDiscreteScheduler, device: Any, dtype: Any) -> None:
        self.transformer = transformer.to(device, dtype).eval()
        self.text_encoder = text_encoder.to(device, dtype).eval()
        self.scheduler = scheduler  # a template: every request gets its own copy
        self.device, self.dtype = torch.device(device), dtype

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """A Ulysses degree must divide the head count, read from the folder before any worker starts."""
        from omni_core.distributed import validate_parallel_config

        heads = None
        if model_path:
            with open(os.path.join(model_path, "transformer", "config.json")) as f:
                heads = json.load(f)["num_heads"]
        validate_parallel_config(parallel_config, num_heads=heads, model=cls.__name__)

    # ------------------------------------------------------------------ worker process
    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> ToyPipeline:
        index = read_model_index(model_path)
        if not index or index.get("_class_name") != "ToyPipeline":
            raise ConfigError(f"{model_path!r} is not a ToyPipeline folder", field="model")
        dtype = dtype or torch.float32
        part = lambda name: os.path.join(model_path, name)  # noqa: E731
        return cls(ToyDiT.from_pretrained(part("transformer"), torch_dtype=dtype, use_safetensors=True),
                   ToyTextEncoder.from_pretrained(part("text_encoder"), torch_dtype=dtype, use_safetensors=True),
                   FlowMatchEulerDiscreteScheduler.from_pretrained(part("scheduler")), device, dtype)

    def denoisers(self) -> list[DenoiserSpec]:
        dit = self.transformer
        return [DenoiserSpec(
            name="transformer", module=dit, blocks_attr="blocks",
            block_params=("x", "cond", "text", "text_mask"), carried="x", block_outputs="x", residual_stream="x",
            side_inputs=("cond", "text", "text_mask"),
            batch_args=("sample", "timestep", "text", "text_mask"),
            modulated_input=lambda module, block, args: block.modulated(args["x"], args["cond"]),
            num_heads=dit.config.num_heads,
            # shard the image tokens after patchify, gather them after the head (the text stays whole)
            sp_plan={"shard_outputs": {"patchify": 1}, "gather_after": {"head": 1}, "gather_output": None},
            # tensor parallelism: q/k/v by heads, the output and the MLP's second layer by input, the modulation's
            # weights split with its output gathered; the attention modules hold local heads
            tp_plan={**{f"blocks.*.{a}.qkv.*": "colwise" for a in ("self_attn", "cross_attn")},
                     **{f"blocks.*.{a}.out": "rowwise" for a in ("self_attn", "cross_attn")},
                     **{f"blocks.*.{a}": "heads" for a in ("self_attn", "cross_attn")},
                     "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise", "blocks.*.ada.1": "colwise_gather"},
            cache_defaults={"tea_cache": TEA_CACHE},
        )]

    @torch.no_grad()
    def encode(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Words -> ids by a stable hash (0 pads) -> ``([1, MAX_WORDS, dim] states, [1, MAX_WORDS] mask)``."""
        words = prompt.lower().split()[:MAX_WORDS] or [""]
        ids = [zlib.crc32(w.encode()) % (self.text_encoder.config.vocab_size - 1) + 1 for w in words]
        ids = torch.tensor([ids + [0] * (MAX_WORDS - len(ids))], device=self.device)
        return self.text_encoder(ids), ids != 0

    # the texts a request encodes and how: the window (TextEncodingWindow) runs them through the embedding cache,
    # or reads what the encode stage computed, and puts them on the state, where encoded_text finds them
    def text_keys(self, state: StepState) -> list:
        guided = state.sampling_params.guidance_scale > 1
        return [state.request.prompt] + ([state.request.negative_prompt or ""] if guided else [])

    def encode_prompts(self, keys: list) -> dict:
        return {text: self.encode(text) for text in keys}

    def _encoded(self, state: StepState, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoded_text(state, text, lambda: self.encode(text))

    def prepare_encode(self, state: StepState) -> StepState:
        sp = state.sampling_params
        if state.generator is None:
            state.generator = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
        shape = (sp.num_outputs_per_prompt, 3, sp.height, sp.width)
        state.latents = torch.randn(shape, generator=state.generator).to(self.device, self.dtype)
        state.scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        state.scheduler.set_timesteps(sp.num_inference_steps, device=self.device)
        state.timesteps, state.num_steps, state.step_index = state.scheduler.timesteps, sp.num_inference_steps, 0
        state.prompt_embeds, state.prompt_mask = self._encoded(state, state.request.prompt)
        state.extra["scale"] = sp.guidance_scale
        if sp.guidance_scale > 1:
            negative = self._encoded(state, state.request.negative_prompt or "")
            state.negative_prompt_embeds, state.negative_prompt_mask = negative
        return state

    @torch.no_grad()
    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """One transformer call per image size: every state's cond rows, then the uncond rows of guided ones."""
        preds: dict[int, torch.Tensor] = {}
        sizes: dict[tuple, list[StepState]] = {}
        for s in states:
            sizes.setdefault(tuple(s.latents.shape[1:]), []).append(s)
        for group in sizes.values():
            guided = [s for s in group if s.extra["scale"] > 1]
            out = self._call([(s, "cond") for s in group] + [(s, "uncond") for s in guided])
            for s, cond in zip(group, out):
                preds[id(s)] = cond
            for s, uncond in zip(guided, out[len(group):]):
                preds[id(s)] = uncond + s.extra["scale"] * (preds[id(s)] - uncond)
        return [preds[id(s)] for s in states]

    def _call(self, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer evaluation over ``(state, branch)`` segments, inside the typed call context."""
        rows = [s.latents.shape[0] for s, _ in segments]
        text = [(s.prompt_embeds, s.prompt_mask) if b == "cond" else (s.negative_prompt_embeds, s.negative_prompt_mask)
                for s, b in segments]
        sample = torch.cat([s.latents for s, _ in segments])
        timestep = torch.cat([s.timesteps[s.step_index].expand(n) for (s, _), n in zip(segments, rows)])
        emb = torch.cat([e.expand(n, -1, -1) for (e, _), n in zip(text, rows)])
        mask = torch.cat([m.expand(n, -1) for (_, m), n in zip(text, rows)])
        with use_denoise_call([(s, n, b) for (s, b), n in zip(segments, rows)], expert="transformer", text_mask=mask):
            out = self.transformer(sample, timestep.to(self.dtype), emb, mask)
        return list(out.float().split(rows))

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        sigma = state.scheduler.sigmas[state.step_index]
        state.extra["x0"] = state.latents.float() - sigma * noise_pred  # the clean estimate, for previews
        state.latents = state.scheduler.step(noise_pred, state.timesteps[state.step_index], state.latents.float(),
                                             return_dict=False)[0].to(self.dtype)
        state.step_index += 1

    def post_decode(self, state: StepState) -> DiffusionOutput:
        return DiffusionOutput(request_id=state.request_id, tensor=((state.latents.float() + 1) / 2).clamp(0, 1).cpu(),
                               finished=True, step_index=state.step_index, num_steps=state.num_steps)

    def preview(self, state: StepState) -> torch.Tensor | None:
        x0 = state.extra.get("x0")
        return None if x0 is None else ((x0[0] + 1) / 2).clamp(0, 1).cpu()
