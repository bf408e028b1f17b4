"""Omni's ``QwenImagePipeline``: text-to-image with true CFG, batched across requests, step by step.

Components come from a diffusers-format folder through diffusers' own loader (``from_pretrained``,
safetensors only, no remote code). A real ``diffusers.QwenImagePipeline`` object is kept for its helpers
(``encode_prompt``, ``prepare_latents``, ``_unpack_latents``, the image processor); the denoise loop is
Omni's: one scheduler per request, and one transformer call per CFG branch for a batch of requests that may
be at different steps and have prompts of different token lengths (text padded, key-padding mask).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar

import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.forward_context import forward_context, use_config, use_forward_context
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines import OmniPipeline, StepState
from omni_core.pipelines.diffusers_folder import check_model_index, dtype_kwarg
from omni_core.pipelines.diffusers_folder import read_json as _read_json

#: libraries a model folder may name in model_index.json (anything else could be remote code)
DEFAULT_MAX_SEQUENCE_LENGTH = 512
#: diffusers' ``QwenImagePipeline.default_sample_size`` (latent pixels)
DEFAULT_SAMPLE_SIZE = 128
MAX_SEQUENCE_LENGTH_LIMIT = 1024

#: sequence-parallel plan of diffusers' ``QwenImageTransformer2DModel`` (checked against its forward): the
#: packed latents enter as ``hidden_states [B, S, C]`` and are sharded on the token dim; the image half of the
#: rotary table (``pos_embed`` returns ``(image [S, D/2], text)``) is sharded the same way; the text stream
#: stays whole on every rank and joins each joint attention in front of the image tokens; the output
#: ``[B, S, C']`` is gathered on dim 1.
SP_PLAN = {"shard": {"hidden_states": 1}, "shard_after": {"pos_embed": {0: 0}}, "gather": 1,
           "joint_text": "encoder_hidden_states"}


def vae_scale_factor(model_path: str | None) -> int:
    """diffusers: ``2 ** len(vae.temperal_downsample)`` (8 for Qwen-Image); 8 when the folder is unknown."""
    cfg = _read_json(os.path.join(model_path, "vae", "config.json")) if model_path else None
    if cfg and "temperal_downsample" in cfg:
        return 2 ** len(cfg["temperal_downsample"])
    return 8


class QwenImagePipeline(OmniPipeline):
    """Qwen-Image text-to-image (diffusers ``QwenImagePipeline`` semantics, float-exact denoise math)."""

    supports_request_batch = True
    supports_step_execution = True
    supported_parallel: ClassVar[tuple[str, ...]] = ("ulysses", "ring", "cfg")
    size_multiple = 16
    default_height = 1024
    default_width = 1024
    default_num_inference_steps = 50
    default_true_cfg_scale = 4.0
    #: Qwen-Image's published sizes reach 1664x928 / 1328x1328 (1.8 MP); 2048x2048 (4x the default area) leaves
    #: headroom without letting one request take minutes per step
    default_limits: ClassVar[dict] = {"max_pixels": 2048 * 2048}

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__``; height/width must be multiples of vae_scale_factor * 2 (the
        2x2 latent packing), i.e. 16 for Qwen-Image."""
        vsf = vae_scale_factor(model_path)
        multiple = vsf * 2
        default_size = DEFAULT_SAMPLE_SIZE * vsf  # diffusers: default_sample_size * vae_scale_factor (1024)
        changes: dict[str, Any] = {}
        for name, default in (("height", default_size), ("width", default_size),
                              ("num_inference_steps", cls.default_num_inference_steps),
                              ("true_cfg_scale", cls.default_true_cfg_scale),
                              ("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)):
            if getattr(params, name) is None:
                changes[name] = default
        params = params.replace(**changes) if changes else params
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % multiple:
                lo, hi = value // multiple * multiple, (value // multiple + 1) * multiple
                raise ConfigError(
                    f"{name}={value} is not allowed for {cls.__name__}: height and width must be multiples of "
                    f"{multiple} (VAE scale factor {vsf} x 2 for latent packing), e.g. {lo or multiple} or {hi}",
                    field=name)
        if params.num_frames not in (None, 1):
            raise ConfigError(f"num_frames={params.num_frames} is not allowed: {cls.__name__} makes images "
                              f"(leave num_frames unset or 1)", field="num_frames")
        if params.max_sequence_length > MAX_SEQUENCE_LENGTH_LIMIT:
            raise ConfigError(f"max_sequence_length={params.max_sequence_length} is not allowed for {cls.__name__}: "
                              f"at most {MAX_SEQUENCE_LENGTH_LIMIT}", field="max_sequence_length")
        if params.guidance_scale_2 is not None:
            raise ConfigError(f"guidance_scale_2 is not used by {cls.__name__} (it is Wan 2.2's second-expert "
                              f"scale); use true_cfg_scale with a negative prompt for CFG", field="guidance_scale_2")
        tcfg = _read_json(os.path.join(model_path, "transformer", "config.json")) if model_path else None
        if tcfg and tcfg.get("guidance_embeds") and params.guidance_scale is None:
            raise ConfigError(f"this {cls.__name__} is guidance-distilled (guidance_embeds): guidance_scale is "
                              f"required", field="guidance_scale")
        return params

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Ulysses splits attention heads: its degree must divide the transformer's head count (read from the
        folder, so the engine refuses before starting workers)."""
        from omni_core.distributed import validate_parallel_config

        tcfg = _read_json(os.path.join(model_path, "transformer", "config.json")) if model_path else None
        validate_parallel_config(parallel_config, num_heads=(tcfg or {}).get("num_attention_heads"),
                                 supported=(*cls.supported_parallel, "data"), model=cls.__name__)

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = device
        self.dtype = dtype
        #: the Omni ``Attention`` layers every joint-attention call of the transformer goes through
        self.attention_layers = layers

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> QwenImagePipeline:
        import diffusers

        from omni_model_qwen_image.attention import install_omni_attention

        check_model_index(model_path, "QwenImagePipeline")
        dtype = dtype or torch.float32
        kwargs = dict(getattr(config, "model_kwargs", None) or {})
        pipe = diffusers.QwenImagePipeline.from_pretrained(model_path, **dtype_kwarg(dtype), use_safetensors=True,
                                                           **kwargs)
        pipe.set_progress_bar_config(disable=True)
        device = torch.device(device)
        pipe.to(device)
        with use_config(config) if config is not None else contextlib.nullcontext():
            layers = install_omni_attention(pipe.transformer)
        setup_parallel(cls, pipe.transformer, config)
        return cls(pipe, device, dtype, layers)

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe, sp, req = self.pipe, state.sampling_params, state.request
        n = sp.num_outputs_per_prompt
        true_cfg = sp.true_cfg_scale if sp.true_cfg_scale is not None else self.default_true_cfg_scale
        msl = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        with torch.no_grad():
            state.prompt_embeds, state.prompt_mask = pipe.encode_prompt(
                prompt=[req.prompt], device=self.device, num_images_per_prompt=1, max_sequence_length=msl)
            do_cfg = true_cfg > 1 and req.negative_prompt is not None
            if do_cfg:
                state.negative_prompt_embeds, state.negative_prompt_mask = pipe.encode_prompt(
                    prompt=[req.negative_prompt], device=self.device, num_images_per_prompt=1,
                    max_sequence_length=msl)
        if state.generator is None and sp.seed is not None:
            state.generator = torch.Generator(self.device).manual_seed(sp.seed)
        height, width = sp.height, sp.width
        state.latents = pipe.prepare_latents(n, self.transformer.config.in_channels // 4, height, width,
                                             state.prompt_embeds.dtype, self.device, state.generator)
        steps = sp.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        cfg = pipe.scheduler.config
        mu = calculate_shift(state.latents.shape[1], cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        scheduler = type(pipe.scheduler).from_config(cfg)
        state.timesteps, state.num_steps = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.step_index = 0
        state.extra.update(do_cfg=do_cfg, true_cfg_scale=true_cfg, height=height, width=width, rows=n)
        return state

    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """One cond call (and one uncond call for the CFG requests) per group of same-size requests."""
        preds: dict[int, torch.Tensor] = {}
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault((s.extra["height"], s.extra["width"], s.latents.dtype), []).append(i)
        with torch.no_grad():
            for (height, width, _), idx in groups.items():
                group = [states[i] for i in idx]
                cond, uncond_of = self._branches(group, height, width)
                for i, s, noise_pred in zip(idx, group, cond):
                    if s.extra["do_cfg"]:
                        neg = uncond_of[id(s)]
                        comb = neg + s.extra["true_cfg_scale"] * (noise_pred - neg)
                        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                        noise_norm = torch.norm(comb, dim=-1, keepdim=True)
                        noise_pred = comb * (cond_norm / noise_norm)
                    preds[i] = noise_pred
        return [preds[i] for i in range(len(states))]

    def _branches(self, group: list[StepState], height: int, width: int) -> tuple[list, dict]:
        """(cond prediction per state, {id(state): uncond prediction} for the CFG states).

        With a cfg group of two ranks the CFG states' cond and uncond calls run on cfg ranks 0 and 1 at the
        same time and are exchanged (``cfg_parallel_predict``); states without CFG run on both ranks."""
        from omni_core.distributed import cfg_parallel_predict, get_cfg_group

        cfg_states = [s for s in group if s.extra["do_cfg"]]
        if get_cfg_group().world_size == 1 or not cfg_states:
            cond = self._run_branch(group, "cond", height, width)
            uncond = self._run_branch(cfg_states, "uncond", height, width) if cfg_states else []
            return cond, dict(zip(map(id, cfg_states), uncond))
        rows = [s.latents.shape[0] for s in cfg_states]
        pos, neg = cfg_parallel_predict(lambda: torch.cat(self._run_branch(cfg_states, "cond", height, width)),
                                        lambda: torch.cat(self._run_branch(cfg_states, "uncond", height, width)))
        cond_of = dict(zip(map(id, cfg_states), pos.split(rows)))
        plain = [s for s in group if not s.extra["do_cfg"]]
        cond_of.update(zip(map(id, plain), self._run_branch(plain, "cond", height, width) if plain else []))
        return [cond_of[id(s)] for s in group], dict(zip(map(id, cfg_states), neg.split(rows)))

    def _run_branch(self, states: list[StepState], branch: str, height: int, width: int) -> list[torch.Tensor]:
        """One transformer call over every row of ``states``; returns each state's noise prediction."""
        negative = branch == "uncond"
        rows = [s.latents.shape[0] for s in states]
        latents = torch.cat([s.latents for s in states])
        embeds = [s.negative_prompt_embeds if negative else s.prompt_embeds for s in states]
        masks = [s.negative_prompt_mask if negative else s.prompt_mask for s in states]
        text, text_mask = _pad_text(embeds, masks, rows)
        timestep = torch.cat([s.timesteps[s.step_index].expand(r) for s, r in zip(states, rows)]).to(latents.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.cat([torch.full([r], s.sampling_params.guidance_scale, device=self.device,
                                             dtype=torch.float32) for s, r in zip(states, rows)])
        vsf = self.pipe.vae_scale_factor
        img_shapes = [[(1, height // vsf // 2, width // vsf // 2)]] * latents.shape[0]
        extras = {"branch": branch, "states": states, "rows": rows}
        with use_forward_context(extras={**forward_context().extras, **extras}), \
                self.transformer.cache_context(branch):
            out = self.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                                   encoder_hidden_states_mask=text_mask, encoder_hidden_states=text,
                                   img_shapes=img_shapes, attention_kwargs={}, return_dict=False)[0]
        return list(out.split(rows))

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        t = state.timesteps[state.step_index]
        with torch.no_grad():
            state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]
        state.step_index += 1

    def post_decode(self, state: StepState) -> DiffusionOutput:
        pipe, sp = self.pipe, state.sampling_params
        out = DiffusionOutput(request_id=state.request_id, finished=True, step_index=state.step_index,
                              num_steps=state.num_steps)
        if sp.output_type == "latent":
            out.tensor = state.latents
            return out
        with torch.no_grad():
            latents = pipe._unpack_latents(state.latents, state.extra["height"], state.extra["width"],
                                           pipe.vae_scale_factor).to(pipe.vae.dtype)
            vcfg = pipe.vae.config
            mean = torch.tensor(vcfg.latents_mean).view(1, vcfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
            std = 1.0 / torch.tensor(vcfg.latents_std).view(1, vcfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
            latents = latents / std + mean
            image = pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]
            out.tensor = pipe.image_processor.postprocess(image, output_type="pt")
        return out

    def preview(self, state: StepState) -> torch.Tensor | None:
        """Cheap RGB of the current latents (first three latent channels, min-max scaled; no VAE)."""
        if state.latents is None:
            return None
        lat = self.pipe._unpack_latents(state.latents[:1], state.extra["height"], state.extra["width"],
                                        self.pipe.vae_scale_factor)[0, :, 0].float()
        return latents_to_rgb(lat)


def setup_parallel(cls: type, transformer: torch.nn.Module, config: Any) -> None:
    """Check the parallel config against the denoiser (heads, supported strategies) and install the SP plan's
    hooks when the sp group has more than one rank. Runs in each worker after ``init_parallel_state``."""
    from omni_core.attention.parallel import apply_sequence_parallel
    from omni_core.distributed import get_sp_group, validate_parallel_config

    pc = getattr(config, "parallel_config", None)
    validate_parallel_config(pc, num_heads=transformer.config.num_attention_heads,
                             supported=(*cls.supported_parallel, "data"), model=cls.__name__)
    transformer._sp_plan = SP_PLAN
    if get_sp_group().world_size > 1:
        if getattr(transformer.config, "zero_cond_t", False):
            raise ConfigError(f"{cls.__name__}: sequence parallelism does not support zero_cond_t transformers "
                              f"(per-token modulation index); use cfg or data parallelism", field="parallel_config")
        apply_sequence_parallel(transformer)


def latents_to_rgb(lat: torch.Tensor) -> torch.Tensor:
    """``[C, h, w]`` latents -> ``[3, h, w]`` in [0, 1]: channels 0..2 (repeated when fewer), each min-max scaled."""
    rgb = lat[:3] if lat.shape[0] >= 3 else lat[:1].expand(3, -1, -1)
    lo = rgb.amin(dim=(1, 2), keepdim=True)
    hi = rgb.amax(dim=(1, 2), keepdim=True)
    return ((rgb - lo) / (hi - lo).clamp_min(1e-6)).cpu()


def _pad_text(embeds: list[torch.Tensor], masks: list[torch.Tensor | None], rows: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack ``[1, L_i, D]`` prompt embeddings into ``[sum(rows), max L, D]`` with zero padding, and the
    key-padding mask (None when nothing is padded, as diffusers passes for a single prompt)."""
    longest = max(e.shape[1] for e in embeds)
    parts, mask_parts = [], []
    for e, m, r in zip(embeds, masks, rows):
        length = e.shape[1]
        valid = m.bool() if m is not None else torch.ones(e.shape[:2], dtype=torch.bool, device=e.device)
        if length < longest:
            e = torch.cat([e, e.new_zeros(e.shape[0], longest - length, e.shape[2])], dim=1)
            valid = torch.cat([valid, valid.new_zeros(valid.shape[0], longest - length)], dim=1)
        parts.append(e.expand(r, -1, -1))
        mask_parts.append(valid.expand(r, -1))
    mask = torch.cat(mask_parts)
    return torch.cat(parts), (None if bool(mask.all()) else mask)
