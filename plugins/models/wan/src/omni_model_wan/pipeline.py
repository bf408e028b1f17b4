"""Omni's ``WanPipeline``: Wan 2.1 / Wan 2.2 text-to-video, batched across requests, step by step.

Components come from a diffusers-format folder through diffusers' own loader (``from_pretrained``,
safetensors only, no remote code). Wan 2.2 A14B folders carry a second expert (``transformer_2``) and
``boundary_ratio``: steps with ``t >= boundary_ratio * num_train_timesteps`` use ``transformer`` with
``guidance_scale``, later steps ``transformer_2`` with ``guidance_scale_2``. A real ``diffusers.WanPipeline``
object is kept for its helpers (``encode_prompt``, ``prepare_latents``, the video processor); the denoise
loop is Omni's: one scheduler per request, one transformer call per (expert, CFG branch) for a batch of
requests that may be at different steps.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar

import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.forward_context import forward_context, use_config, use_forward_context
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines import OmniPipeline, StepState
from omni_core.pipelines.diffusers_folder import check_model_index, dtype_kwarg
from omni_core.pipelines.diffusers_folder import read_json as _read_json

DEFAULT_MAX_SEQUENCE_LENGTH = 512

#: sequence-parallel plan of diffusers' ``WanTransformer3DModel`` (checked against its forward): the token
#: sequence is built inline (conv patch embedding, flatten, transpose), so the first block's
#: ``hidden_states [B, S, D]`` is sharded on dim 1, and so are both rotary tables ``rope`` returns
#: (``[1, S, 1, d]`` each); cross-attention (role "cross") keeps the text whole and runs locally; the tokens
#: are gathered after ``proj_out``, before the unpatchify reshape.
SP_PLAN = {"shard_before": {"blocks.0": {"hidden_states": 1}}, "shard_after": {"rope": {0: 1, 1: 1}},
           "gather_after": "proj_out", "gather": None}
#: Wan 2.2 TI2V (``expand_timesteps``) passes one timestep per token (``timestep [B, S]``): shard it too, so
#: the per-token modulation matches the sharded tokens
SP_PLAN_EXPANDED = {**SP_PLAN, "shard": {"timestep": 1}}


def size_rules(model_path: str | None) -> tuple[int, int, int, int]:
    """(height multiple, width multiple, temporal VAE factor, spatial VAE factor) read from the folder;
    Wan's (16, 16, 4, 8) when unknown."""
    vae = (_read_json(os.path.join(model_path, "vae", "config.json")) if model_path else None) or {}
    tr = {}
    for sub in ("transformer", "transformer_2"):
        tr = (_read_json(os.path.join(model_path, sub, "config.json")) if model_path else None) or {}
        if tr:
            break
    spatial = vae.get("scale_factor_spatial") or 8
    temporal = vae.get("scale_factor_temporal") or 4
    patch = tr.get("patch_size") or (1, 2, 2)
    return spatial * patch[1], spatial * patch[2], temporal, spatial


class WanPipeline(OmniPipeline):
    """Wan text-to-video (diffusers ``WanPipeline`` semantics, float-exact denoise math)."""

    supports_request_batch = True
    supports_step_execution = True
    supported_parallel: ClassVar[tuple[str, ...]] = ("ulysses", "ring", "cfg")
    is_video = True
    size_multiple = 16
    frame_multiple = 4
    default_height = 480
    default_width = 832
    default_num_frames = 81
    default_num_inference_steps = 50
    #: Wan's largest trained sizes: 720p (1280x720, Wan 2.1/2.2 14B) and 121 frames (Wan 2.2 TI2V-5B, 1280x704)
    default_limits: ClassVar[dict] = {"max_pixels": 1280 * 720, "max_frames": 121}
    default_guidance_scale = 5.0

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__``. height/width must be multiples of the VAE's spatial factor x the
        patch size (16 for Wan) and ``num_frames - 1`` a multiple of the temporal factor (4); diffusers
        silently rounds such sizes, Omni refuses them."""
        hm, wm, temporal, _ = size_rules(model_path)
        changes: dict[str, Any] = {}
        for name, default in (("height", cls.default_height), ("width", cls.default_width),
                              ("num_frames", cls.default_num_frames),
                              ("num_inference_steps", cls.default_num_inference_steps),
                              ("guidance_scale", cls.default_guidance_scale),
                              ("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)):
            if getattr(params, name) is None:
                changes[name] = default
        params = params.replace(**changes) if changes else params
        for name, m in (("height", hm), ("width", wm)):
            value = getattr(params, name)
            if value % m:
                lo, hi = value // m * m, (value // m + 1) * m
                raise ConfigError(f"{name}={value} is not allowed for {cls.__name__}: height must be a multiple of "
                                  f"{hm} and width a multiple of {wm} (VAE spatial factor x patch size), e.g. "
                                  f"{lo or m} or {hi}", field=name)
        if (params.num_frames - 1) % temporal:
            lo = (params.num_frames - 1) // temporal * temporal + 1
            raise ConfigError(f"num_frames={params.num_frames} is not allowed for {cls.__name__}: num_frames - 1 must "
                              f"be a multiple of {temporal} (the VAE's temporal factor), e.g. {lo} or "
                              f"{lo + temporal}", field="num_frames")
        if params.true_cfg_scale is not None:
            raise ConfigError(f"true_cfg_scale is not used by {cls.__name__}; use guidance_scale (and "
                              f"guidance_scale_2 for Wan 2.2's second expert)", field="true_cfg_scale")
        index = (_read_json(os.path.join(model_path, "model_index.json")) if model_path else None) or {}
        if params.guidance_scale_2 is not None and model_path and index.get("boundary_ratio") is None:
            raise ConfigError(f"guidance_scale_2 needs a two-expert Wan 2.2 model (boundary_ratio in "
                              f"model_index.json); {model_path!r} has none", field="guidance_scale_2")
        return params

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Ulysses splits attention heads: its degree must divide every expert's head count (read from the
        folder, so the engine refuses before starting workers)."""
        from omni_core.distributed import validate_parallel_config

        for name in ("transformer", "transformer_2"):
            tcfg = _read_json(os.path.join(model_path, name, "config.json")) if model_path else None
            if tcfg or name == "transformer":
                validate_parallel_config(parallel_config, num_heads=(tcfg or {}).get("num_attention_heads"),
                                         supported=(*cls.supported_parallel, "data"),
                                         model=f"{cls.__name__} ({name})")

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        #: the Omni ``Attention`` layers every attention call of the experts goes through
        self.attention_layers = layers
        #: expert name -> transformer (``transformer_2`` only for Wan 2.2 two-expert folders)
        self.experts = {name: getattr(pipe, name) for name in ("transformer", "transformer_2")
                        if getattr(pipe, name, None) is not None}
        first = next(iter(self.experts.values()))
        self.transformer_dtype = first.dtype
        self.in_channels = first.config.in_channels
        self.patch_size = tuple(first.config.patch_size)
        ratio = pipe.config.boundary_ratio
        self.boundary_timestep = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> WanPipeline:
        import diffusers

        from omni_model_wan.attention import install_omni_attention

        check_model_index(model_path, "WanPipeline")
        dtype = dtype or torch.float32
        kwargs = dict(getattr(config, "model_kwargs", None) or {})
        pipe = diffusers.WanPipeline.from_pretrained(model_path, **dtype_kwarg(dtype), use_safetensors=True, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        device = torch.device(device)
        pipe.to(device)
        layers = []
        with use_config(config) if config is not None else contextlib.nullcontext():
            for name in ("transformer", "transformer_2"):
                if getattr(pipe, name, None) is not None:
                    layers += install_omni_attention(getattr(pipe, name), prefix=f"{name}.")
        pipeline = cls(pipe, device, dtype, layers)
        pipeline.setup_parallel(config)
        return pipeline

    def setup_parallel(self, config: Any) -> None:
        """Check the parallel config against the experts (heads, supported strategies) and install the SP
        plan's hooks on each expert when the sp group has more than one rank (runs after
        ``init_parallel_state``)."""
        from omni_core.attention.parallel import apply_sequence_parallel
        from omni_core.distributed import get_sp_group, validate_parallel_config

        pc = getattr(config, "parallel_config", None)
        for name, model in self.experts.items():
            validate_parallel_config(pc, num_heads=model.config.num_attention_heads,
                                     supported=(*self.supported_parallel, "data"),
                                     model=f"{type(self).__name__} ({name})")
            model._sp_plan = SP_PLAN_EXPANDED if self.expand_timesteps else SP_PLAN
            if get_sp_group().world_size > 1:
                apply_sequence_parallel(model)

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        pipe, sp, req = self.pipe, state.sampling_params, state.request
        n = sp.num_outputs_per_prompt
        guidance_scale = sp.guidance_scale if sp.guidance_scale is not None else self.default_guidance_scale
        guidance_scale_2 = sp.guidance_scale_2
        if self.boundary_timestep is not None and guidance_scale_2 is None:
            guidance_scale_2 = guidance_scale
        do_cfg = guidance_scale > 1.0
        msl = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        with torch.no_grad():
            pe, ne = pipe.encode_prompt(prompt=[req.prompt], negative_prompt=req.negative_prompt,
                                        do_classifier_free_guidance=do_cfg, num_videos_per_prompt=1,
                                        max_sequence_length=msl, device=self.device)
        state.prompt_embeds = pe.to(self.transformer_dtype)
        state.negative_prompt_embeds = ne.to(self.transformer_dtype) if ne is not None else None
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(sp.num_inference_steps, device=self.device)
        state.timesteps = scheduler.timesteps
        state.num_steps = len(state.timesteps)
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.step_index = 0
        if state.generator is None and sp.seed is not None:
            state.generator = torch.Generator(self.device).manual_seed(sp.seed)
        state.latents = pipe.prepare_latents(n, self.in_channels, sp.height, sp.width, sp.num_frames, torch.float32,
                                             self.device, state.generator)
        state.extra.update(do_cfg=do_cfg, guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2)
        return state

    def expert_for(self, state: StepState) -> tuple[str, float]:
        """The expert and guidance scale for the state's current timestep (diffusers' boundary rule)."""
        t = state.timesteps[state.step_index]
        if self.boundary_timestep is None or t >= self.boundary_timestep:
            return "transformer", state.extra["guidance_scale"]
        return "transformer_2", state.extra["guidance_scale_2"]

    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """Per expert and latent shape: one cond call, and one uncond call for the CFG requests."""
        preds: dict[int, torch.Tensor] = {}
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            expert, _ = self.expert_for(s)
            groups.setdefault((expert, tuple(s.latents.shape[1:])), []).append(i)
        with torch.no_grad():
            for (expert, _), idx in groups.items():
                group = [states[i] for i in idx]
                cond, uncond_of = self._branches(expert, group)
                for i, s, noise_pred in zip(idx, group, cond):
                    if s.extra["do_cfg"]:
                        noise_uncond = uncond_of[id(s)]
                        scale = self.expert_for(s)[1]
                        noise_pred = noise_uncond + scale * (noise_pred - noise_uncond)
                    preds[i] = noise_pred
        return [preds[i] for i in range(len(states))]

    def _branches(self, expert: str, group: list[StepState]) -> tuple[list, dict]:
        """(cond prediction per state, {id(state): uncond prediction} for the CFG states).

        With a cfg group of two ranks the CFG states' cond and uncond calls run on cfg ranks 0 and 1 at the
        same time and are exchanged (``cfg_parallel_predict``); states without CFG run on both ranks."""
        from omni_core.distributed import cfg_parallel_predict, get_cfg_group

        cfg_states = [s for s in group if s.extra["do_cfg"]]
        if get_cfg_group().world_size == 1 or not cfg_states:
            cond = self._run_branch(expert, group, "cond")
            uncond = self._run_branch(expert, cfg_states, "uncond") if cfg_states else []
            return cond, dict(zip(map(id, cfg_states), uncond))
        rows = [s.latents.shape[0] for s in cfg_states]
        pos, neg = cfg_parallel_predict(lambda: torch.cat(self._run_branch(expert, cfg_states, "cond")),
                                        lambda: torch.cat(self._run_branch(expert, cfg_states, "uncond")))
        cond_of = dict(zip(map(id, cfg_states), pos.split(rows)))
        plain = [s for s in group if not s.extra["do_cfg"]]
        cond_of.update(zip(map(id, plain), self._run_branch(expert, plain, "cond") if plain else []))
        return [cond_of[id(s)] for s in group], dict(zip(map(id, cfg_states), neg.split(rows)))

    def _run_branch(self, expert: str, states: list[StepState], branch: str) -> list[torch.Tensor]:
        model = self.experts[expert]
        rows = [s.latents.shape[0] for s in states]
        latents = torch.cat([s.latents for s in states]).to(self.transformer_dtype)
        embeds = [s.negative_prompt_embeds if branch == "uncond" else s.prompt_embeds for s in states]
        text, text_mask = _pad_text(embeds, rows)
        ts = [s.timesteps[s.step_index] for s in states]
        if self.expand_timesteps:  # Wan 2.2 TI2V: one timestep per latent token (all equal for text-to-video)
            _, _, f, h, w = latents.shape
            seq = f * (h // self.patch_size[1]) * (w // self.patch_size[2])
            timestep = torch.cat([t.expand(r, seq) for t, r in zip(ts, rows)])
        else:
            timestep = torch.cat([t.expand(r) for t, r in zip(ts, rows)])
        extras = {"branch": branch, "expert": expert, "states": states, "rows": rows, "text_mask": text_mask}
        with use_forward_context(extras={**forward_context().extras, **extras}), model.cache_context(branch):
            out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, attention_kwargs=None,
                        return_dict=False)[0]
        return list(out.split(rows))

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        t = state.timesteps[state.step_index]
        with torch.no_grad():
            state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]
        state.step_index += 1

    def post_decode(self, state: StepState) -> DiffusionOutput:
        pipe = self.pipe
        out = DiffusionOutput(request_id=state.request_id, finished=True, step_index=state.step_index,
                              num_steps=state.num_steps)
        if state.sampling_params.output_type == "latent":
            out.tensor = state.latents
            return out
        with torch.no_grad():
            latents = state.latents.to(self.device, dtype=pipe.vae.dtype)
            vcfg = pipe.vae.config
            mean = torch.tensor(vcfg.latents_mean).view(1, vcfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
            std = 1.0 / torch.tensor(vcfg.latents_std).view(1, vcfg.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
            latents = latents / std + mean
            video = pipe.vae.decode(latents, return_dict=False)[0]
            out.tensor = pipe.video_processor.postprocess_video(video, output_type="pt")  # [n, F, 3, H, W]
        return out

    def preview(self, state: StepState) -> torch.Tensor | None:
        """Cheap RGB of the middle latent frame (first three channels, min-max scaled; no VAE)."""
        if state.latents is None:
            return None
        lat = state.latents[0, :, state.latents.shape[2] // 2].float()
        rgb = lat[:3] if lat.shape[0] >= 3 else lat[:1].expand(3, -1, -1)
        lo = rgb.amin(dim=(1, 2), keepdim=True)
        hi = rgb.amax(dim=(1, 2), keepdim=True)
        return ((rgb - lo) / (hi - lo).clamp_min(1e-6)).cpu()


def _pad_text(embeds: list[torch.Tensor], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack ``[1, L_i, D]`` embeddings (each already zero-padded to its request's max_sequence_length, as
    diffusers does) into ``[sum(rows), max L, D]``; when the L_i differ, a key-padding mask hides the extra
    positions so each request attends to exactly the keys diffusers would give it."""
    longest = max(e.shape[1] for e in embeds)
    parts, masks = [], []
    for e, r in zip(embeds, rows):
        length = e.shape[1]
        valid = torch.ones(1, longest, dtype=torch.bool, device=e.device)
        if length < longest:
            e = torch.cat([e, e.new_zeros(1, longest - length, e.shape[2])], dim=1)
            valid[:, length:] = False
        parts.append(e.expand(r, -1, -1))
        masks.append(valid.expand(r, -1))
    mask = torch.cat(masks)
    return torch.cat(parts), (None if bool(mask.all()) else mask)
