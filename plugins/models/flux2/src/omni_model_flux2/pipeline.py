"""Omni's FLUX.2 pipelines: ``Flux2Pipeline`` ([dev]) and ``Flux2KleinPipeline`` ([klein]), text-to-image and with
reference images, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request scheduler, CFG
through the cfg-parallel helpers, batched text encoding and VAE decode, previews). diffusers' own pipeline object
does the text encoding (``encode_prompt``), the noise (``prepare_latents``), the reference images
(``image_processor`` and ``prepare_image_latents``) and the latent (un)packing; what is FLUX.2's own here: the
sampling defaults, the schedule (``compute_empirical_mu``), the transformer call (text ids and ``[image ids;
reference ids]`` for one rotary table per call, the reference tokens behind the noisy ones, the prediction cut
back to the noisy tokens), the embedded guidance of [dev], the CFG of [klein] (unless step-distilled) and the
denoiser spec. Both models share ``Flux2Transformer2DModel``; the two classes differ in their text encoder (Mistral3
/ Qwen3, behind diffusers' ``encode_prompt``) and guidance.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.distributed.tensor_parallel import attention_layers
from omni_core.errors import ConfigError
from omni_core.images import ImageInput, to_pil
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_folder import read_json
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults
from omni_model_flux2.blocks import BLOCK_PARAMS, BLOCKS_ATTR
from omni_model_flux2.fields import size_rules, vae_scale_factor

#: diffusers' ``tokenizer_max_length`` / ``max_sequence_length`` default and ``default_sample_size`` (latent px)
MAX_SEQUENCE_LENGTH = 512
DEFAULT_SAMPLE_SIZE = 128
#: diffusers' ``__call__`` defaults (both pipelines): 50 steps, guidance 4.0; a step-distilled [klein] is run at 4
DEFAULT_STEPS, DISTILLED_STEPS, DEFAULT_GUIDANCE = 50, 4, 4.0
#: diffusers resizes a reference image above this area down to it (``_resize_to_target_area``)
REFERENCE_AREA = 1024 * 1024

#: sequence-parallel plan (checked against :func:`omni_model_flux2.blocks.omni_forward`): the packed tokens
#: ``hidden_states [B, S, C]`` (the noisy latents, then any reference tokens) and their position ids
#: ``img_ids [S, 4]`` are sharded on the token dim before anything runs, so ``pos_embed(img_ids)`` is exactly this
#: rank's part of the rotary table; the text stays whole on every rank, in front of the image tokens of every joint
#: attention (double- and single-stream); the output ``[B, S, C]`` is gathered on dim 1
SP_PLAN = {"shard": {"hidden_states": 1, "img_ids": 0}, "gather": 1, "joint_text": "encoder_hidden_states"}

#: tensor-parallel plan (module paths of diffusers' ``Flux2Transformer2DModel``). Double-stream blocks: the joint
#: attention by heads (image and text projections; ``to_out.0`` / ``to_add_out`` by input) and both SwiGLU MLPs, whose
#: ``linear_in`` holds ``[gate | up]``: colwise in two segments, so each rank's output is its slice of the gate, then
#: the same slice of the up, and ``Flux2SwiGLU``'s halving pairs them; ``linear_out`` by input. Single-stream blocks:
#: the fused ``to_qkv_mlp_proj`` ``[q | k | v | gate | up]`` colwise in five segments, the fused ``to_out`` over
#: ``[attention | MLP]`` by input in two; ``Flux2ParallelSelfAttention`` has no ``to_q``, so its ``heads`` entry makes
#: the core divide its ``heads`` / ``inner_dim`` (and its Omni layer's); the processor
#: (:class:`~omni_model_flux2.attention.OmniFlux2ParallelSelfAttnProcessor`) splits the local output at
#: ``3 * inner_dim`` and takes the rest as the local MLP part, so ``mlp_hidden_dim`` (left whole) is never read. The
#: three shared modulations (the largest single weights: ``dim x 18 dim`` for the double-stream ones together) are
#: split and their small outputs gathered. Left whole: the embedders, ``norm_out`` and ``proj_out``.
TP_PLAN = {**attention_layers("transformer_blocks.*.attn", joint=True),
           **{f"transformer_blocks.*.{ff}.linear_in": {"style": "colwise", "segments": ["linear_out.in_features"] * 2}
              for ff in ("ff", "ff_context")},
           **{f"transformer_blocks.*.{ff}.linear_out": "rowwise" for ff in ("ff", "ff_context")},
           "single_transformer_blocks.*.attn": "heads",
           "single_transformer_blocks.*.attn.to_qkv_mlp_proj": {
               "style": "colwise", "segments": ["inner_dim"] * 3 + ["mlp_hidden_dim"] * 2},
           "single_transformer_blocks.*.attn.to_out": {"style": "rowwise", "segments": ["inner_dim", "mlp_hidden_dim"]},
           **{f"{m}.linear": "colwise_gather"
              for m in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")}}

#: TeaCache: no FLUX.2 polynomial is published (TeaCache4FLUX and ComfyUI-TeaCache publish FLUX.1's). These are
#: fitted by ``omni cache calibrate`` on the tiny [klein] test folder (8 prompts, 20 steps, CFG; 304 step pairs, input
#: changes 0.041-0.070, R^2 0.68): what the tests run on. Calibrate a released folder before relying on them
#: (``omni cache calibrate --model <folder> --write`` stores its own in the folder's cache_defaults.json).
TEACACHE_COEFFICIENTS = (-2.83699464e+05, 5.92698349e+04, -4.61363034e+03, 1.59891601e+02, -2.03607744e+00)
TEACACHE_DEFAULTS = {"coefficients": TEACACHE_COEFFICIENTS, "rel_l1_thresh": 0.3, "warmup_steps": 1}
#: cache_dit: on the tiny [klein] folder (4 requests, CFG, 20 steps) 0.6 reuses nothing, 1.0 computes 48 of 160
#: rows of the last block at 66-68 dB PSNR against uncached (no calibration command exists for cache_dit)
CACHE_DIT_DEFAULTS = {"residual_diff_threshold": 1.0, "max_warmup_steps": 2}


def modulated_input(transformer: Any, block: Any, a: dict) -> Any:
    """TeaCache's signal: block 0's (double-stream) timestep-modulated image tokens."""
    return block.modulated(a["hidden_states"], a["temb_mod_img"])


class Flux2Base(DiffusersStepPipeline):
    """What both FLUX.2 pipelines share (diffusers' ``Flux2Pipeline`` / ``Flux2KleinPipeline`` semantics)."""

    preview_projections = None  # a folder's preview_projection.json (``omni preview calibrate --write``)
    size_multiple = 16
    default_height = default_width = 1024
    default_num_inference_steps = DEFAULT_STEPS
    #: up to 10 reference images (BFL's limit for [dev]); their sizes set the token count, so they split waves
    image_input = ImageInput(min_images=0, max_images=10, size_splits_batch=True, role="reference images")
    default_limits: ClassVar[dict] = {"max_pixels": 2048 * 2048}
    #: the diffusers keyword of each model's text encoder hidden layers (diffusers' defaults are used)
    guided: ClassVar[bool] = False

    # ------------------------------------------------------------------ engine process
    @classmethod
    def size_multiples(cls, model_path: str | None) -> tuple[int, int, int]:
        return size_rules(model_path)

    @classmethod
    def default_size(cls, model_path: str | None) -> tuple[int, int]:
        size = DEFAULT_SAMPLE_SIZE * vae_scale_factor(model_path)
        return size, size

    @classmethod
    def default_steps(cls, model_path: str | None) -> int:
        return DEFAULT_STEPS

    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """diffusers' defaults (50 steps, guidance 4.0, 512 text tokens); height and width stay unset here when
        not given (the worker takes the first reference image's size, else ``default_sample_size * vae factor``,
        as diffusers does) and must be multiples of vae_scale_factor * 2 (the 2x2 patchify)."""
        multiple = size_rules(model_path)[0]
        params = fill_defaults(params, num_inference_steps=cls.default_steps(model_path),
                               guidance_scale=DEFAULT_GUIDANCE, max_sequence_length=MAX_SEQUENCE_LENGTH)
        for name in ("height", "width"):
            value = getattr(params, name)
            if value is not None and value % multiple:
                lo, hi = value // multiple * multiple, (value // multiple + 1) * multiple
                raise ConfigError(
                    f"{name}={value} is not allowed for {cls.__name__}: height and width must each be a multiple of "
                    f"{multiple} (VAE scale factor {multiple // 2} x 2 for the latent patchify), e.g. "
                    f"{lo or multiple} or {hi}", field=name)
        if params.num_frames not in (None, 1):
            raise ConfigError(f"num_frames={params.num_frames} is not allowed: {cls.__name__} makes images "
                              f"(leave num_frames unset or 1)", field="num_frames")
        if params.max_sequence_length > MAX_SEQUENCE_LENGTH:
            raise ConfigError(f"max_sequence_length={params.max_sequence_length} is not allowed for {cls.__name__}: "
                              f"at most {MAX_SEQUENCE_LENGTH} (text tokens)", field="max_sequence_length")
        return cls.check_model_fields(params)

    # ------------------------------------------------------------------ worker process
    @property
    def transformer(self) -> torch.nn.Module:
        return self.experts["transformer"]

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_flux2.attention import install_omni_attention
        from omni_model_flux2.blocks import install_block_list

        install_block_list(module)
        return install_omni_attention(module)

    def denoisers(self) -> list[DenoiserSpec]:
        t = self.transformer
        return [DenoiserSpec(
            name="transformer", module=t, blocks_attr=BLOCKS_ATTR, block_params=BLOCK_PARAMS,
            carried=("hidden_states", "encoder_hidden_states"),
            block_outputs=("encoder_hidden_states", "hidden_states"),
            residual_stream="hidden_states",
            side_inputs=("temb_mod_img", "temb_mod_txt", "temb_mod_single"),
            batch_args=("hidden_states", "encoder_hidden_states", "timestep", "guidance"),
            modulated_input=modulated_input,
            num_heads=t.config.num_attention_heads,
            sp_plan=SP_PLAN, tp_plan=TP_PLAN,
            cache_defaults={"tea_cache": TEACACHE_DEFAULTS, "cache_dit": CACHE_DIT_DEFAULTS})]

    # -- guidance
    def _do_cfg(self, state: StepState) -> bool:
        """[klein]: ``guidance_scale > 1`` and not step-distilled (diffusers' ``do_classifier_free_guidance``);
        [dev]: never (its guidance is an input of the transformer)."""
        return False

    def _negative(self, state: StepState) -> str:
        """The uncond branch's text: the request's negative prompt, else "" (diffusers' klein always uses "")."""
        return state.request.negative_prompt or ""

    # -- text
    def text_keys(self, state: StepState) -> list:
        msl = state.sampling_params.max_sequence_length
        texts = [state.request.prompt] + ([self._negative(state)] if self._do_cfg(state) else [])
        return [(t, msl) for t in texts]

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct text of the wave through the text encoder, one call per text length (diffusers pads
        every prompt to ``max_sequence_length``, so rows of a batch equal their encodings alone)."""
        out: dict = {}
        for msl in dict.fromkeys(m for _, m in keys):
            texts = [t for t, m in keys if m == msl]
            with torch.no_grad():
                embeds, _ = self.pipe.encode_prompt(prompt=texts, device=self.device, num_images_per_prompt=1,
                                                    max_sequence_length=msl)
            out.update({(t, msl): embeds[i:i + 1] for i, t in enumerate(texts)})
        return out

    def _encode(self, state: StepState, text: str) -> torch.Tensor:
        key = (text, state.sampling_params.max_sequence_length)
        return self.encoded_text(state, key, lambda: self.encode_prompts([key])[key])

    # -- reference images
    def reference_images(self, state: StepState) -> list:
        """diffusers' preprocessing of the request's images: above 1 MP resized to 1 MP, cropped to multiples of
        vae_scale_factor * 2, ``image_processor.preprocess`` (``[1, 3, h, w]`` in [-1, 1])."""
        proc, multiple = self.pipe.image_processor, self.pipe.vae_scale_factor * 2
        out = []
        for img in (to_pil(t) for t in state.request.images):
            proc.check_image_input(img)
            width, height = img.size
            if width * height > REFERENCE_AREA:
                img = proc._resize_to_target_area(img, REFERENCE_AREA)
                width, height = img.size
            width, height = width // multiple * multiple, height // multiple * multiple
            out.append(proc.preprocess(img, height=height, width=width, resize_mode="crop"))
        return out

    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

        pipe, sp = self.pipe, state.sampling_params
        do_cfg = self._do_cfg(state)
        with torch.no_grad():
            state.prompt_embeds = self._encode(state, state.request.prompt)
            if do_cfg:
                state.negative_prompt_embeds = self._encode(state, self._negative(state))
            images = self.reference_images(state) if state.request.images else []
            height, width = sp.height, sp.width
            if images:  # diffusers: the first reference image's size when none is given
                height, width = height or images[0].shape[-2], width or images[0].shape[-1]
            vsf = pipe.vae_scale_factor
            height, width = height or DEFAULT_SAMPLE_SIZE * vsf, width or DEFAULT_SAMPLE_SIZE * vsf
            self.seed_generator(state)
            n = sp.num_outputs_per_prompt
            state.latents, latent_ids = pipe.prepare_latents(
                batch_size=n, num_latents_channels=self.transformer.config.in_channels // 4, height=height,
                width=width, dtype=state.prompt_embeds.dtype, device=self.device, generator=state.generator)
            img_ids = latent_ids[0]
            if images:
                ref, ref_ids = pipe.prepare_image_latents(images=images, batch_size=1, generator=state.generator,
                                                          device=self.device, dtype=pipe.vae.dtype)
                state.extra["reference"] = ref  # [1, N, C]: the same for every output row
                img_ids = torch.cat([img_ids, ref_ids[0]], dim=0)
        steps = sp.num_inference_steps
        sigmas = None if pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = compute_empirical_mu(image_seq_len=state.latents.shape[1], num_steps=steps)
        scheduler = self.new_scheduler()
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        self.start_schedule(state, scheduler, timesteps)
        state.extra.update(do_cfg=do_cfg, cfg_scale=sp.guidance_scale, height=height, width=width,
                           img_ids=img_ids, grid=(height // vsf // 2, width // vsf // 2))
        return state

    def batch_key(self, state: StepState) -> tuple:
        """Same size, text length (no text mask) and reference images' sizes (one ``img_ids`` table per call)."""
        return (state.extra["height"], state.extra["width"], state.sampling_params.max_sequence_length,
                tuple(tuple(im.shape) for im in state.request.images), state.latents.dtype)

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call: each segment's packed latents (then its reference tokens) with its branch's text,
        one timestep (and [dev]'s embedded guidance) per row; each prediction cut back to the noisy tokens."""
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        latents = states[0].latents if len(states) == 1 else torch.cat([s.latents for s in states])
        tokens = latents.shape[1]
        hidden = latents
        if "reference" in states[0].extra:
            ref = torch.cat([s.extra["reference"].expand(r, -1, -1) for s, r in zip(states, rows)])
            hidden = torch.cat([latents, ref.to(latents.dtype)], dim=1)
        text, _ = self.segment_text_batch(segments)  # one length per call: never a mask
        counts = torch.tensor(rows, device=self.device)
        timestep = torch.stack([s.timesteps[s.step_index] for s in states]).repeat_interleave(counts)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([s.sampling_params.guidance_scale for s in states], device=self.device,
                                    dtype=torch.float32).repeat_interleave(counts)
        txt_ids = self.pipe._prepare_text_ids(text[:1])[0].to(self.device)
        dtype = self.transformer.dtype
        preds = self.call_denoiser(expert, segments, None, hidden_states=hidden.to(dtype),
                                   timestep=timestep.to(latents.dtype) / 1000, guidance=guidance,
                                   encoder_hidden_states=text, txt_ids=txt_ids, img_ids=states[0].extra["img_ids"],
                                   joint_attention_kwargs=None)
        return [p[:, :tokens] for p in preds]

    def _latent_ids(self, state: StepState, rows: int) -> torch.Tensor:
        """diffusers' ``_prepare_latent_ids`` of the request's latent grid (built from plain ints in ``extra``, which
        is all the decode stage gets of the state)."""
        h, w = state.extra["grid"]
        return self.pipe._prepare_latent_ids(torch.empty(rows, 0, h, w, device="meta")).to(self.device)

    def _unpacked(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        """Packed ``[B, S, 4C]`` -> the VAE's ``[B, C, H, W]`` (diffusers: scatter by ids, batch-norm statistics,
        unpatchify)."""
        pipe = self.pipe
        latents = pipe._unpack_latents_with_ids(latents, self._latent_ids(state, latents.shape[0]))
        bn = pipe.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(latents.device,
                                                                                                 latents.dtype)
        return pipe._unpatchify_latents(latents * std + mean)

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        pipe = self.pipe
        image = vae_decode(pipe.vae, self._unpacked(latents, state).to(pipe.vae.dtype))
        return pipe.image_processor.postprocess(image, output_type="pt")

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The first image's patchified latents ``[4C, h, w]`` (the transformer's normalized space)."""
        return self.pipe._unpack_latents_with_ids(state.latents[:1], self._latent_ids(state, 1))[0]


class Flux2Pipeline(Flux2Base):
    """FLUX.2 [dev]: Mistral3 text encoder, guidance embedded in the transformer (no CFG branch, no negative
    prompt: diffusers' ``Flux2Pipeline`` has none; a given negative prompt is unused)."""

    diffusers_class = "Flux2Pipeline"


class Flux2KleinPipeline(Flux2Base):
    """FLUX.2 [klein]: Qwen3 text encoder, CFG with ``guidance_scale > 1`` (the negative prompt, else "") unless
    the folder is step-distilled (``is_distilled`` in model_index.json: 4 steps by default, guidance ignored)."""

    diffusers_class = "Flux2KleinPipeline"

    @staticmethod
    def distilled(model_path: str | None) -> bool:
        index = read_json(os.path.join(model_path, "model_index.json")) if model_path else None
        return bool((index or {}).get("is_distilled", False))

    @classmethod
    def default_steps(cls, model_path: str | None) -> int:
        return DISTILLED_STEPS if cls.distilled(model_path) else DEFAULT_STEPS

    def _do_cfg(self, state: StepState) -> bool:
        scale = state.sampling_params.guidance_scale
        return scale is not None and scale > 1 and not self.pipe.config.is_distilled
