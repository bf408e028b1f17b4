"""A tiny pure-torch DiT text-to-image pipeline, for the tests of the core and of plugins that need a model.

Cache and attention plugins test against a real pipeline without depending on a model plugin (no plugin may
import another): this one ships inside ``omni_core.testing``. It is what a model plugin is, small:

* ``TinyDiTTransformer``: patchify -> ``blocks[i](hidden, temb, context, context_mask)`` (adaLN self-attention,
  cross-attention to the text, MLP) -> unpatchify; every attention goes through
  :class:`omni_core.attention.Attention`;
* ``TinyTextEncoder`` with a closed toy tokenizer (words hashed into a 64-entry vocabulary; no downloads);
* ``TinyDiTPipeline``: per-request noise and ``FlowMatchEulerDiscreteScheduler``, CFG (cond and uncond rows in
  one batched call inside ``use_denoise_call``), previews, and a ``DenoiserSpec`` with ``sp_plan`` and
  tea_cache defaults, so every cache backend and sequence parallelism reach it by declaration alone.

``build_tiny_dit(path)`` saves a random-weight safetensors folder; the ``tiny_dit_model`` fixture of the
``omni_core.testing`` pytest plugin builds one per session and registers the pipeline (component
``"OmniTinyDiTPipeline"``, model name ``"tiny-dit"``).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from omni_core.attention import Attention
from omni_core.errors import ConfigError
from omni_core.forward_context import use_denoise_call
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines import OmniPipeline, StepState
from omni_core.pipelines.base import read_model_index
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_folder import dtype_kwarg, refuse_pickled_weights
from omni_core.pipelines.state import flow_clean_estimate, remember_flow_step
from omni_core.testing.tiny_dit_plugin import CONTEXT_SCALE, SAMPLING_FIELDS

#: the pipeline component name (``model_index.json``'s ``_class_name``) and the short model name
PIPELINE_NAME = "OmniTinyDiTPipeline"
MODEL_NAME = "tiny-dit"

#: sequence parallelism: shard the image tokens after the patch embedding, gather after the output projection
#: (the text context stays whole on every rank; cross-attention needs no exchange)
SP_PLAN = {"shard_after": {"x_embed": 1}, "gather_after": {"proj_out": 1}, "gather": None}

#: TeaCache defaults. Not calibrated (the weights are random): the identity polynomial uses the relative L1
#: change of block 0's modulated input itself as the estimate; 0.1 skips some steps of a 4-8 step schedule
TEA_CACHE_DEFAULTS = {"coefficients": (0.0, 0.0, 0.0, 1.0, 0.0), "rel_l1_thresh": 0.1, "warmup_steps": 1}


class TinyTokenizer:
    """Lower-cased words hashed (crc32) into a fixed vocabulary: closed, deterministic, no files needed."""

    PAD, UNK, BOS = 0, 1, 2

    def __init__(self, vocab_size: int = 64, max_length: int = 8) -> None:
        self.vocab_size, self.max_length = vocab_size, max_length

    def __call__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``([1, max_length] ids, [1, max_length] bool mask)``; sequences start with BOS."""
        words = prompt.lower().split()[: self.max_length - 1]
        ids = [self.BOS] + [3 + zlib.crc32(w.encode()) % (self.vocab_size - 3) for w in words]
        mask = [True] * len(ids) + [False] * (self.max_length - len(ids))
        ids = ids + [self.PAD] * (self.max_length - len(ids))
        return torch.tensor([ids]), torch.tensor([mask])


class TinyTextEncoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, vocab_size: int = 64, max_length: int = 8, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_length, dim))
        self.proj = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(input_ids) + self.pos[:, : input_ids.shape[1]])


def per_row(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for per-row vectors ``[B, D]``, one row at a time: CPU GEMM kernels take another code path
    for very few rows, so a batched call would make an image depend (by ~1e-7) on its batch. Token-level
    matmuls (>= 16 rows per image) need no such care. Keeps "alone == batched" bit-exact for the contracts."""
    return module(x) if x.shape[0] == 1 else torch.cat([module(row) for row in x.split(1)])


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class TinyAttention(nn.Module):
    """q/k/v projections around an Omni ``Attention`` layer (``context`` given: cross-attention)."""

    def __init__(self, dim: int, heads: int, role: str) -> None:
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.attn = Attention(heads, self.hd, role=role)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        context = x if context is None else context
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, self.hd)
        k = self.to_k(context).view(b, context.shape[1], self.heads, self.hd)
        v = self.to_v(context).view(b, context.shape[1], self.heads, self.hd)
        return self.to_out(self.attn(q, k, v, mask).reshape(b, n, -1))


class TinyDiTBlock(nn.Module):
    """adaLN self-attention over image tokens, cross-attention to the text (key-padding mask), MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn1 = TinyAttention(dim, heads, "self")
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = TinyAttention(dim, heads, "cross")
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def modulated(self, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The self-attention's modulated input (TeaCache's per-row signal)."""
        shift, scale = per_row(self.adaLN, temb).chunk(6, dim=1)[:2]
        return modulate(self.norm1(hidden), shift, scale)

    def forward(self, hidden: torch.Tensor, temb: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = per_row(self.adaLN, temb).chunk(6, dim=1)
        hidden = hidden + gate1[:, None] * self.attn1(modulate(self.norm1(hidden), shift1, scale1))
        hidden = hidden + self.attn2(self.norm2(hidden), context, context_mask)
        return hidden + gate2[:, None] * self.mlp(modulate(self.norm3(hidden), shift2, scale2))


class TinyPatchEmbed(nn.Module):
    """Image ``[B, C, H, W]`` -> tokens ``[B, N, dim]`` with a fixed sin-cos position embedding added, so
    everything per-token leaves this one module (the SP plan shards its output)."""

    def __init__(self, in_channels: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.p, self.dim = patch_size, dim
        self.proj = nn.Linear(in_channels * patch_size * patch_size, dim)
        self.pos_scale = nn.Parameter(torch.ones(dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = images.shape
        p = self.p
        gh, gw = hh // p, ww // p
        patches = images.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * p * p)
        ys, xs = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32),
                                indexing="ij")
        freqs = torch.arange(1, self.dim // 4 + 1, dtype=torch.float32)
        pos = torch.cat([f(v.reshape(-1, 1) * freqs) for v in (ys, xs) for f in (torch.sin, torch.cos)], 1)
        return self.proj(patches) + (pos.to(patches.device, patches.dtype) * self.pos_scale)[None]


class TinyDiTTransformer(ModelMixin, ConfigMixin):
    """``forward(hidden_states [B, C, H, W], timestep [B], encoder_hidden_states [B, L, text_dim],
    encoder_mask [B, L] bool)`` -> the flow-matching velocity ``[B, C, H, W]``."""

    @register_to_config
    def __init__(self, in_channels: int = 3, patch_size: int = 2, dim: int = 32, num_heads: int = 2,
                 num_layers: int = 2, text_dim: int = 16) -> None:
        super().__init__()
        p = patch_size
        self.x_embed = TinyPatchEmbed(in_channels, p, dim)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.text_pool = nn.Linear(text_dim, dim)
        self.context_proj = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList([TinyDiTBlock(dim, num_heads) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, p * p * in_channels)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_mask: torch.Tensor | None = None, context_scale: float = 1.0) -> torch.Tensor:
        b, c, hh, ww = hidden_states.shape
        p = self.config.patch_size
        gh, gw = hh // p, ww // p
        tokens = self.x_embed(hidden_states)
        if encoder_mask is None:
            pooled = encoder_hidden_states.mean(1)
        else:
            m = encoder_mask.to(encoder_hidden_states.dtype)[..., None]
            pooled = (encoder_hidden_states * m).sum(1) / m.sum(1).clamp(min=1)
        t = (timestep.reshape(-1).expand(b).to(tokens.dtype) / 1000.0)[:, None]
        temb = per_row(self.time_embed, t) + per_row(self.text_pool, pooled)
        context = self.context_proj(encoder_hidden_states)
        if context_scale != 1.0:
            context = context * context_scale
        for block in self.blocks:
            tokens = block(tokens, temb, context, encoder_mask)
        out = self.proj_out(self.norm_out(tokens))
        return out.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hh, ww)


def _modulated_input(module: TinyDiTTransformer, block: TinyDiTBlock, args: dict) -> torch.Tensor:
    return block.modulated(args["hidden"], args["temb"])


class TinyDiTPipeline(OmniPipeline):
    """Text -> 16x16 RGB (pixel space), step-wise and request-batched, with CFG."""

    supports_request_batch = True
    supports_step_execution = True
    supported_parallel = ("ulysses", "ring", "cfg")
    size_multiple = 8
    default_height = 16
    default_width = 16
    default_num_inference_steps = 6
    default_guidance_scale = 3.0
    #: ``context_scale``: the model's own knob, also on its record (``tiny_dit_plugin``)
    sampling_fields = SAMPLING_FIELDS
    default_limits: ClassVar[dict] = {"max_pixels": 64 * 64}
    component_names: ClassVar[tuple[str, ...]] = ("transformer", "text_encoder", "scheduler")

    def __init__(self, transformer: TinyDiTTransformer, text_encoder: TinyTextEncoder,
                 scheduler: FlowMatchEulerDiscreteScheduler, device: Any = "cpu", dtype: Any = torch.float32) -> None:
        for model in (transformer, text_encoder):
            model.to(device)
            if model.dtype != dtype:  # from_pretrained already made it ``dtype``: a second cast only warns
                model.to(dtype)
            model.eval()
        self.transformer, self.text_encoder = transformer, text_encoder
        self.tokenizer = TinyTokenizer(text_encoder.config.vocab_size, text_encoder.config.max_length)
        self.scheduler = scheduler
        self.device, self.dtype = torch.device(device), dtype

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> TinyDiTPipeline:
        index = read_model_index(model_path)
        if index is None or index.get("_class_name") != PIPELINE_NAME:
            raise ConfigError(f"{model_path!r} is not an {PIPELINE_NAME} folder", field="model")
        refuse_pickled_weights(model_path, cls.component_names)
        dtype = dtype or torch.float32
        kw = {**dtype_kwarg(dtype), "use_safetensors": True}
        return cls(TinyDiTTransformer.from_pretrained(os.path.join(model_path, "transformer"), **kw),
                   TinyTextEncoder.from_pretrained(os.path.join(model_path, "text_encoder"), **kw),
                   FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(model_path, "scheduler")),
                   device=device, dtype=dtype)

    def denoisers(self) -> list[DenoiserSpec]:
        cfg = self.transformer.config
        return [DenoiserSpec(
            name="transformer", module=self.transformer, blocks_attr="blocks",
            block_params=("hidden", "temb", "context", "context_mask"), carried=("hidden",),
            block_outputs=("hidden",), residual_stream="hidden", side_inputs=("temb", "context", "context_mask"),
            batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_mask"),
            modulated_input=_modulated_input, num_heads=cfg.num_heads, sp_plan=SP_PLAN,
            cache_defaults={"tea_cache": dict(TEA_CACHE_DEFAULTS)})]

    @classmethod
    def example_prompts(cls) -> list[str]:
        return ["a red square", "a blue circle on the left", "two green dots", "a yellow line at the top"]

    @torch.no_grad()
    def encode(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = self.tokenizer(prompt)
        return self.text_encoder(ids.to(self.device)), mask.to(self.device)

    def prepare_encode(self, state: StepState) -> StepState:
        sp = state.sampling_params
        height, width = sp.height or self.default_height, sp.width or self.default_width
        scale = self.default_guidance_scale if sp.guidance_scale is None else sp.guidance_scale
        if state.generator is None:
            state.generator = torch.Generator("cpu")
            if sp.seed is not None:
                state.generator.manual_seed(sp.seed)
            else:
                state.generator.seed()
        noise = torch.randn((sp.num_outputs_per_prompt, 3, height, width), generator=state.generator)
        state.latents = noise.to(self.device, self.dtype)
        state.scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        state.scheduler.set_timesteps(sp.num_inference_steps or self.default_num_inference_steps, device=self.device)
        state.timesteps = state.scheduler.timesteps
        state.num_steps, state.step_index = len(state.timesteps), 0
        state.prompt_embeds, state.prompt_mask = self.encode(state.request.prompt)
        state.extra["guidance_scale"] = float(scale)
        state.extra["context_scale"] = float(sp.model_fields.get("context_scale", CONTEXT_SCALE.default))
        if scale > 1.0:
            state.negative_prompt_embeds, state.negative_prompt_mask = self.encode(state.request.negative_prompt or "")
        return state

    @torch.no_grad()
    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """One transformer call per image size and ``context_scale`` (the scheduler keeps different scales in
        different waves) for every state: all cond rows, then the guided states' uncond rows (CFG batched into
        the same call)."""
        preds: list[Any] = [None] * len(states)
        by_size: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            by_size.setdefault((*s.latents.shape[1:], s.extra.get("context_scale", 1.0)), []).append(i)
        for idx in by_size.values():
            group = [states[i] for i in idx]
            guided = [s for s in group if s.extra["guidance_scale"] > 1.0]
            out = self._run([(s, "cond") for s in group] + [(s, "uncond") for s in guided])
            uncond = dict(zip(map(id, guided), out[len(group):]))
            for i, s, vc in zip(idx, group, out[: len(group)]):
                vu = uncond.get(id(s))
                preds[i] = vc if vu is None else vu + s.extra["guidance_scale"] * (vc - vu)
        return preds

    def _run(self, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        xs, ts, embs, masks, rows = [], [], [], [], []
        for s, branch in segments:
            n = s.latents.shape[0]
            emb, mask = ((s.prompt_embeds, s.prompt_mask) if branch == "cond"
                         else (s.negative_prompt_embeds, s.negative_prompt_mask))
            xs.append(s.latents)
            ts.append(s.timesteps[s.step_index].reshape(1).expand(n))
            embs.append(emb.expand(n, -1, -1))
            masks.append(mask.expand(n, -1))
            rows.append(n)
        mask = torch.cat(masks)
        scale = segments[0][0].extra.get("context_scale", 1.0)
        kwargs = {"context_scale": scale} if scale != 1.0 else {}
        with use_denoise_call([(s, n, b) for (s, b), n in zip(segments, rows)], expert="transformer", text_mask=mask):
            out = self.transformer(torch.cat(xs), torch.cat(ts).to(self.dtype), torch.cat(embs), mask, **kwargs)
        return list(out.float().split(rows))

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        # the step's inputs, for a preview's clean estimate (computed only if someone streams previews)
        remember_flow_step(state, state.latents, state.scheduler.sigmas[state.step_index], noise_pred)
        state.latents = state.scheduler.step(noise_pred, state.timesteps[state.step_index], state.latents.float(),
                                             return_dict=False)[0].to(self.dtype)
        state.step_index += 1

    def post_decode(self, state: StepState) -> DiffusionOutput:
        images = ((state.latents.float() + 1) / 2).clamp(0, 1).cpu()
        return DiffusionOutput(request_id=state.request_id, tensor=images, finished=True,
                               step_index=state.step_index, num_steps=state.num_steps)

    def preview(self, state: StepState) -> torch.Tensor | None:
        x0 = flow_clean_estimate(state)
        return None if x0 is None else ((x0[0] + 1) / 2).clamp(0, 1).cpu()


def build_tiny_dit(path: str | os.PathLike, seed: int = 0, **transformer_kwargs: Any) -> str:
    """Save a random-weight ``OmniTinyDiTPipeline`` folder (safetensors, diffusers layout) at ``path``."""
    path = os.fspath(path)
    torch.manual_seed(seed)
    transformer = TinyDiTTransformer(**transformer_kwargs)
    text_encoder = TinyTextEncoder(dim=transformer.config.text_dim)
    with torch.no_grad():  # no zero-initialised layers: every block and gate contributes
        for module in (transformer, text_encoder):
            for p in module.parameters():
                p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
    os.makedirs(path, exist_ok=True)
    transformer.save_pretrained(os.path.join(path, "transformer"), safe_serialization=True)
    text_encoder.save_pretrained(os.path.join(path, "text_encoder"), safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(os.path.join(path, "scheduler"))
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump({"_class_name": PIPELINE_NAME, "_diffusers_version": "0.35.0",
                   "transformer": [None, "TinyDiTTransformer"], "text_encoder": [None, "TinyTextEncoder"],
                   "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}, f, indent=2)
    return path


__all__ = ["MODEL_NAME", "PIPELINE_NAME", "SP_PLAN", "TEA_CACHE_DEFAULTS", "TinyDiTPipeline", "TinyDiTTransformer",
           "TinyTextEncoder", "TinyTokenizer", "build_tiny_dit"]
