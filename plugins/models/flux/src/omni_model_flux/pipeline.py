"""Omni's ``FluxPipeline``: FLUX.1 text-to-image (dev and schnell), batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request
scheduler, CFG through the cfg-parallel helpers, batched text encoding and VAE decode, previews); what is
FLUX's own is here: its sampling-parameter rules, the embedded guidance of guidance-distilled (dev) folders,
true CFG with a negative prompt, the packed-latent transformer call (pooled CLIP projection per row, one
rotary table of ``[text ids; image ids]`` per call) and its denoiser spec.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.distributed.tensor_parallel import attention_layers, feed_forward_layers
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults, folder_config
from omni_model_flux.fields import SAMPLING_FIELDS, TRUE_CFG_SCALE, vae_scale_factor

#: diffusers' ``FluxPipeline`` limit and default; schnell was trained with 256 T5 tokens (BFL's reference code)
MAX_SEQUENCE_LENGTH = 512
SCHNELL_MAX_SEQUENCE_LENGTH = 256
#: diffusers' ``FluxPipeline.default_sample_size`` (latent pixels) and ``guidance_scale`` default
DEFAULT_SAMPLE_SIZE = 128
DEFAULT_GUIDANCE = 3.5
DEV_STEPS, SCHNELL_STEPS = 28, 4

#: sequence-parallel plan of diffusers' ``FluxTransformer2DModel`` (checked against its forward): the packed
#: latents ``hidden_states [B, S, C]`` and their position ids ``img_ids [S, 3]`` are sharded on the token dim
#: before anything runs, so ``pos_embed(cat(txt_ids, img_ids))`` builds the rotary table of exactly this rank's
#: ``[text; image shard]`` sequence; the text stream stays whole on every rank in front of the image tokens of
#: each joint attention (double- and single-stream blocks alike); the output ``[B, S, C']`` is gathered on dim 1.
#: tensor parallelism: double-stream blocks as Qwen-Image's (joint attention, two MLPs, two modulations);
#: single-stream blocks split attention heads and MLP units, and their ``proj_out`` by input over the concatenation
#: [attention output | MLP output], each part split on its own
TP_PLAN = {**attention_layers("transformer_blocks.*.attn", joint=True),
           **feed_forward_layers("transformer_blocks.*.ff"), **feed_forward_layers("transformer_blocks.*.ff_context"),
           "transformer_blocks.*.norm1.linear": "colwise_gather",
           "transformer_blocks.*.norm1_context.linear": "colwise_gather",
           **attention_layers("single_transformer_blocks.*.attn", output=False),
           "single_transformer_blocks.*.proj_mlp": "colwise",
           "single_transformer_blocks.*.proj_out": {"style": "rowwise",
                                                    "segments": ["attn.inner_dim", "proj_mlp.out_features"]},
           "single_transformer_blocks.*.norm.linear": "colwise_gather"}
SP_PLAN = {"shard": {"hidden_states": 1, "img_ids": 0}, "gather": 1, "joint_text": "encoder_hidden_states"}

#: TeaCache polynomial for FluxTransformer2DModel published by TeaCache (TeaCache4FLUX) and ComfyUI-TeaCache
TEACACHE_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)
TEACACHE_DEFAULTS = {"coefficients": TEACACHE_COEFFICIENTS, "rel_l1_thresh": 0.4, "warmup_steps": 1}


def guidance_distilled(model_path: str | None) -> bool:
    """FLUX.1-dev style (``guidance_embeds``: the guidance scale is an input of the transformer); True when
    the folder is unknown."""
    cfg = folder_config(model_path, "transformer")
    return bool(cfg.get("guidance_embeds", True)) if cfg else True


def modulated_input(transformer: Any, block: Any, a: dict) -> Any:
    """TeaCache's signal: block 0's ``norm1(hidden, emb=temb)`` (the timestep-modulated image tokens)."""
    return block.norm1(a["hidden_states"], emb=a["temb"])[0]


class FluxPipeline(DiffusersStepPipeline):
    """FLUX.1 text-to-image (diffusers ``FluxPipeline`` semantics, float-exact denoise math)."""

    diffusers_class = "FluxPipeline"
    #: latent-to-RGB preview projections for the released VAE (a folder's preview_projection.json comes first)
    preview_projections = "omni_model_flux:preview_projections.json"
    size_multiple = 16
    default_height = 1024
    default_width = 1024
    default_num_inference_steps = DEV_STEPS
    #: ``true_cfg_scale`` (default 1.0: off), also on the record
    sampling_fields = SAMPLING_FIELDS
    undeclared_field_hint = "use guidance_scale (embedded guidance) or true_cfg_scale with a negative prompt"
    default_limits: ClassVar[dict] = {"max_pixels": 2048 * 2048}

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """diffusers' defaults (dev: 28 steps, guidance 3.5, 512 T5 tokens; schnell: 4 steps, 256 tokens, no
        guidance input); height/width must be multiples of vae_scale_factor * 2 (the 2x2 latent packing)."""
        vsf = vae_scale_factor(model_path)
        multiple = vsf * 2
        dev = guidance_distilled(model_path)
        params = fill_defaults(params, height=DEFAULT_SAMPLE_SIZE * vsf, width=DEFAULT_SAMPLE_SIZE * vsf,
                               num_inference_steps=DEV_STEPS if dev else SCHNELL_STEPS,
                               max_sequence_length=MAX_SEQUENCE_LENGTH if dev else SCHNELL_MAX_SEQUENCE_LENGTH)
        if dev:
            params = fill_defaults(params, guidance_scale=DEFAULT_GUIDANCE)
        for name in ("height", "width"):
            value = getattr(params, name)
            if value % multiple:
                lo, hi = value // multiple * multiple, (value // multiple + 1) * multiple
                raise ConfigError(
                    f"{name}={value} is not allowed for {cls.__name__}: height and width must each be a multiple of "
                    f"{multiple} (VAE scale factor {vsf} x 2 for latent packing), e.g. {lo or multiple} or {hi}",
                    field=name)
        if params.num_frames not in (None, 1):
            raise ConfigError(f"num_frames={params.num_frames} is not allowed: {cls.__name__} makes images "
                              f"(leave num_frames unset or 1)", field="num_frames")
        if params.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ConfigError(f"max_sequence_length={params.max_sequence_length} is not allowed for {cls.__name__}: "
                              f"at most {MAX_SEQUENCE_LENGTH} (T5 tokens)", field="max_sequence_length")
        return cls.check_model_fields(params)  # true_cfg_scale's default; other models' fields are refused

    # ------------------------------------------------------------------ worker process
    @property
    def transformer(self) -> torch.nn.Module:
        return self.experts["transformer"]

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_flux.attention import install_omni_attention

        return install_omni_attention(module)

    def denoisers(self) -> list[DenoiserSpec]:
        t = self.transformer
        return [DenoiserSpec(
            name="transformer", module=t, blocks_attr=("transformer_blocks", "single_transformer_blocks"),
            block_params=("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb",
                          "joint_attention_kwargs"),
            carried=("hidden_states", "encoder_hidden_states"),
            block_outputs=("encoder_hidden_states", "hidden_states"),
            residual_stream="hidden_states",
            side_inputs=("temb",),
            batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
            modulated_input=modulated_input,
            num_heads=t.config.num_attention_heads,
            sp_plan=SP_PLAN, tp_plan=TP_PLAN,
            cache_defaults={"tea_cache": TEACACHE_DEFAULTS})]

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        pipe, sp, req = self.pipe, state.sampling_params, state.request
        msl = sp.max_sequence_length
        do_cfg = self._do_cfg(state)
        with torch.no_grad():
            state.prompt_embeds, pooled = self._encode(state, req.prompt, msl)
            if do_cfg:
                state.negative_prompt_embeds, state.extra["negative_pooled"] = self._encode(state, req.negative_prompt,
                                                                                           msl)
        self.seed_generator(state)
        state.latents, img_ids = pipe.prepare_latents(
            sp.num_outputs_per_prompt, self.transformer.config.in_channels // 4, sp.height, sp.width,
            state.prompt_embeds.dtype, self.device, state.generator)
        steps = sp.num_inference_steps
        cfg = pipe.scheduler.config
        sigmas = None if cfg.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(state.latents.shape[1], cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        scheduler = self.new_scheduler()
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        self.start_schedule(state, scheduler, timesteps)
        state.extra.update(do_cfg=do_cfg, cfg_scale=sp.true_cfg_scale, height=sp.height, width=sp.width,
                           pooled=pooled, img_ids=img_ids)
        return state

    @staticmethod
    def _do_cfg(state: StepState) -> bool:
        """diffusers: ``true_cfg_scale > 1`` and a negative prompt."""
        scale = state.sampling_params.true_cfg_scale
        return (scale if scale is not None else TRUE_CFG_SCALE.default) > 1 and state.request.negative_prompt is not None

    def _encode(self, state: StepState, text: str, msl: int) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' ``encode_prompt([text])``: T5 states ``[1, msl, D]`` (padded to ``msl`` by the tokenizer,
        so every prompt has the same length and needs no mask) and the pooled CLIP output ``[1, P]``; from the
        wave's batched encoding when there is one."""
        encodings = state.text_encodings
        if (text, msl) in encodings:
            return encodings[(text, msl)]
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=[text], prompt_2=None, device=self.device,
                                                    num_images_per_prompt=1, max_sequence_length=msl)
        return embeds, pooled

    def text_keys(self, state: StepState) -> list:
        req, msl = state.request, state.sampling_params.max_sequence_length
        texts = [req.prompt, req.negative_prompt] if self._do_cfg(state) else [req.prompt]
        return [(t, msl) for t in texts]

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct prompt of the wave through both text encoders, one call per T5 length (CLIP pads to
        77 and T5 to ``max_sequence_length`` in diffusers itself, so batched rows equal encodings alone)."""
        out: dict = {}
        for msl in dict.fromkeys(m for _, m in keys):
            texts = [t for t, m in keys if m == msl]
            with torch.no_grad():
                embeds, pooled, _ = self.pipe.encode_prompt(prompt=texts, prompt_2=None, device=self.device,
                                                            num_images_per_prompt=1, max_sequence_length=msl)
            out.update({(t, msl): (embeds[i:i + 1], pooled[i:i + 1]) for i, t in enumerate(texts)})
        return out

    def batch_key(self, state: StepState) -> tuple:
        """Same image size (one ``img_ids`` table per call), T5 length (no text mask) and dtype."""
        return (state.extra["height"], state.extra["width"], state.sampling_params.max_sequence_length,
                state.latents.dtype)

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call: each segment's packed latents with its branch's T5 states and pooled CLIP
        projection, one timestep (and embedded guidance, dev) per row."""
        states = [s for s, _ in segments]
        rows = torch.tensor([s.latents.shape[0] for s in states], device=self.device)
        latents = states[0].latents if len(states) == 1 else torch.cat([s.latents for s in states])
        text, _ = self.segment_text_batch(segments)  # equal lengths: never a mask
        pooled = torch.cat([s.extra["pooled" if b == "cond" else "negative_pooled"] for s, b in segments])
        pooled = pooled.repeat_interleave(rows, dim=0)
        timestep = torch.stack([s.timesteps[s.step_index] for s in states]).repeat_interleave(rows)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([s.sampling_params.guidance_scale for s in states], device=self.device,
                                    dtype=torch.float32).repeat_interleave(rows)
        encoder = self.pipe.text_encoder  # None in the model process when the encode stage runs apart
        dtype = encoder.dtype if encoder is not None else self.pipe.transformer.dtype  # diffusers' encode_prompt rule
        txt_ids = torch.zeros(text.shape[1], 3, device=self.device, dtype=dtype)
        return self.call_denoiser(expert, segments, None, hidden_states=latents,
                                  timestep=timestep.to(latents.dtype) / 1000, guidance=guidance,
                                  pooled_projections=pooled, encoder_hidden_states=text, txt_ids=txt_ids,
                                  img_ids=states[0].extra["img_ids"], joint_attention_kwargs={})

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        pipe = self.pipe
        latents = pipe._unpack_latents(latents, state.extra["height"], state.extra["width"], pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = vae_decode(pipe.vae, latents.to(pipe.vae.dtype))  # split across ranks when it pays
        return pipe.image_processor.postprocess(image, output_type="pt")

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The first image's unpacked latents ``[C, h, w]``."""
        return self.pipe._unpack_latents(state.latents[:1], state.extra["height"], state.extra["width"],
                                         self.pipe.vae_scale_factor)[0]
