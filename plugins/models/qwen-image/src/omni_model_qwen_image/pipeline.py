"""Omni's ``QwenImagePipeline``: text-to-image with true CFG, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request
scheduler, CFG through the cfg-parallel helpers, prompt padding with key-padding masks, previews); what is
Qwen-Image's own is here: its sampling-parameter rules, the flow-matching shift of its timesteps, the
packed-latent transformer call and its denoiser spec (blocks, TeaCache signal and defaults, SP plan).
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
from omni_model_qwen_image.fields import SAMPLING_FIELDS, TRUE_CFG_SCALE, vae_scale_factor

DEFAULT_MAX_SEQUENCE_LENGTH = 512
#: diffusers' ``QwenImagePipeline.default_sample_size`` (latent pixels)
DEFAULT_SAMPLE_SIZE = 128
MAX_SEQUENCE_LENGTH_LIMIT = 1024

#: sequence-parallel plan of diffusers' ``QwenImageTransformer2DModel`` (checked against its forward): the
#: packed latents enter as ``hidden_states [B, S, C]`` and are sharded on the token dim; the image half of the
#: rotary table (``pos_embed`` returns ``(image [S, D/2], text)``) is sharded the same way; the text stream
#: stays whole on every rank and joins each joint attention in front of the image tokens; the output
#: ``[B, S, C']`` is gathered on dim 1.
#: tensor parallelism: the joint attention by heads, both streams' MLPs by hidden units, both modulations'
#: weights split with their (small) outputs gathered
TP_PLAN = {**attention_layers("transformer_blocks.*.attn", joint=True),
           **feed_forward_layers("transformer_blocks.*.img_mlp"), **feed_forward_layers("transformer_blocks.*.txt_mlp"),
           "transformer_blocks.*.img_mod.1": "colwise_gather", "transformer_blocks.*.txt_mod.1": "colwise_gather"}
SP_PLAN = {"shard": {"hidden_states": 1}, "shard_after": {"pos_embed": {0: 0}}, "gather": 1,
           "joint_text": "encoder_hidden_states"}

#: TeaCache polynomial published by ComfyUI-TeaCache (and used by vLLM-Omni) for QwenImageTransformer2DModel
TEACACHE_COEFFICIENTS = (-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02)
TEACACHE_DEFAULTS = {"coefficients": TEACACHE_COEFFICIENTS, "rel_l1_thresh": 0.2, "warmup_steps": 1}


def modulated_input(transformer: Any, block: Any, a: dict) -> Any:
    """TeaCache's signal: ``img_norm1(hidden)`` modulated by the first third of ``img_mod(temb)``, as the
    block itself computes it."""
    mod1 = block.img_mod(a["temb"]).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(a["hidden_states"]), mod1, a.get("modulate_index"))[0]


class QwenImagePipeline(DiffusersStepPipeline):
    """Qwen-Image text-to-image (diffusers ``QwenImagePipeline`` semantics, float-exact denoise math)."""

    diffusers_class = "QwenImagePipeline"
    #: latent-to-RGB preview projections for the released VAE (a folder's preview_projection.json comes first)
    preview_projections = "omni_model_qwen_image:preview_projections.json"
    cfg_normalize = True
    size_multiple = 16
    default_height = 1024
    default_width = 1024
    default_num_inference_steps = 50
    #: ``true_cfg_scale`` (default 4.0), also on the record
    sampling_fields = SAMPLING_FIELDS
    undeclared_field_hint = "use true_cfg_scale with a negative prompt for CFG"
    #: Qwen-Image's published sizes reach 1664x928 / 1328x1328 (1.8 MP); 2048x2048 (4x the default area) leaves
    #: headroom without letting one request take minutes per step
    default_limits: ClassVar[dict] = {"max_pixels": 2048 * 2048}
    #: height/width default to diffusers' 1024x1024 here; an edit pipeline leaves them unset in the engine and
    #: derives them from the input image in the worker (as diffusers does)
    size_from_input: ClassVar[bool] = False

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__``; height/width must be multiples of vae_scale_factor * 2 (the
        2x2 latent packing), i.e. 16 for Qwen-Image."""
        vsf = vae_scale_factor(model_path)
        multiple = vsf * 2
        default_size = DEFAULT_SAMPLE_SIZE * vsf  # diffusers: default_sample_size * vae_scale_factor (1024)
        sizes = {} if cls.size_from_input else {"height": default_size, "width": default_size}
        params = fill_defaults(params, **sizes, num_inference_steps=cls.default_num_inference_steps,
                               max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH)
        for name in ("height", "width"):
            value = getattr(params, name)
            if value is not None and value % multiple:
                lo, hi = value // multiple * multiple, (value // multiple + 1) * multiple
                raise ConfigError(
                    f"{name}={value} is not allowed for {cls.__name__}: height and width must each be a multiple of "
                    f"{multiple} (VAE scale factor {vsf} x 2 for latent packing), e.g. {lo or multiple} or {hi}",
                    field=name)
        if params.num_frames not in (None, 1):
            raise ConfigError(f"num_frames={params.num_frames} is not allowed: {cls.__name__} makes images "
                              f"(leave num_frames unset or 1)", field="num_frames")
        if params.max_sequence_length > MAX_SEQUENCE_LENGTH_LIMIT:
            raise ConfigError(f"max_sequence_length={params.max_sequence_length} is not allowed for {cls.__name__}: "
                              f"at most {MAX_SEQUENCE_LENGTH_LIMIT}", field="max_sequence_length")
        params = cls.check_model_fields(params)  # true_cfg_scale's default; other models' fields are refused
        tcfg = folder_config(model_path, "transformer")
        if tcfg and tcfg.get("guidance_embeds") and params.guidance_scale is None:
            raise ConfigError(f"this {cls.__name__} is guidance-distilled (guidance_embeds): guidance_scale is "
                              f"required", field="guidance_scale")
        return params

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Head counts (the base), and no sequence parallelism for ``zero_cond_t`` transformers (their
        per-token modulation index is not sharded), refused before workers start."""
        from omni_core.config import ParallelConfig

        super().check_parallel_config(parallel_config, model_path)
        pc = ParallelConfig.coerce(parallel_config)
        if pc.sequence_parallel_size > 1 and (folder_config(model_path, "transformer") or {}).get("zero_cond_t"):
            raise ConfigError(f"{cls.__name__}: sequence parallelism does not support zero_cond_t transformers "
                              f"(per-token modulation index); use cfg or data parallelism", field="parallel_config")

    # ------------------------------------------------------------------ worker process
    @property
    def transformer(self) -> torch.nn.Module:
        return self.experts["transformer"]

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_qwen_image.attention import install_omni_attention

        return install_omni_attention(module)

    def denoisers(self) -> list[DenoiserSpec]:
        t = self.transformer
        zero_cond_t = bool(getattr(t.config, "zero_cond_t", False))
        return [DenoiserSpec(
            name="transformer", module=t, blocks_attr="transformer_blocks",
            block_params=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
                          "image_rotary_emb", "joint_attention_kwargs", "modulate_index"),
            carried=("hidden_states", "encoder_hidden_states"),
            block_outputs=("encoder_hidden_states", "hidden_states"),
            residual_stream="hidden_states",
            side_inputs=("encoder_hidden_states_mask", "temb", "modulate_index"),
            batch_args=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                        "img_shapes", "guidance", "additional_t_cond"),
            modulated_input=modulated_input,
            # zero_cond_t doubles temb's batch ([cond rows; zero-t rows]): rows cannot be computed apart
            rows_separable=not zero_cond_t,
            num_heads=t.config.num_attention_heads,
            sp_plan=None if zero_cond_t else SP_PLAN, tp_plan=TP_PLAN,
            cache_defaults={"tea_cache": TEACACHE_DEFAULTS})]

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe, sp, req = self.pipe, state.sampling_params, state.request
        true_cfg = sp.true_cfg_scale if sp.true_cfg_scale is not None else TRUE_CFG_SCALE.default
        do_cfg = self._do_cfg(state)
        with torch.no_grad():
            state.prompt_embeds, state.prompt_mask = self._encode(state, req.prompt)
            if do_cfg:
                state.negative_prompt_embeds, state.negative_prompt_mask = self._encode(state, req.negative_prompt)
            self.seed_generator(state)
            height, width = self.output_size(state)
            state.latents = self.initial_latents(state, height, width)
        steps = sp.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        cfg = pipe.scheduler.config
        mu = calculate_shift(state.latents.shape[1], cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        scheduler = self.new_scheduler()
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        self.start_schedule(state, scheduler, timesteps)
        state.extra.update(do_cfg=do_cfg, cfg_scale=true_cfg, height=height, width=width,
                           rows=sp.num_outputs_per_prompt)
        return state

    def output_size(self, state: StepState) -> tuple[int, int]:
        return state.sampling_params.height, state.sampling_params.width

    def initial_latents(self, state: StepState, height: int, width: int) -> torch.Tensor:
        """The request's packed noise ``[n, S, C]`` (diffusers' ``prepare_latents``, the request's generator)."""
        return self.pipe.prepare_latents(state.sampling_params.num_outputs_per_prompt,
                                         self.transformer.config.in_channels // 4, height, width,
                                         state.prompt_embeds.dtype, self.device, state.generator)

    @staticmethod
    def _do_cfg(state: StepState) -> bool:
        sp = state.sampling_params
        true_cfg = sp.true_cfg_scale if sp.true_cfg_scale is not None else TRUE_CFG_SCALE.default
        return true_cfg > 1 and state.request.negative_prompt is not None

    def _encode(self, state: StepState, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """diffusers' ``encode_prompt([text])``: ``[1, L, D]`` embeddings cut to ``max_sequence_length`` and no
        mask (one prompt has no padding); from the wave's batched encoding when there is one."""
        msl = state.sampling_params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        key = self.text_key(state, text)
        embeds = self.encoded_text(state, key, lambda: self.encode_prompts([key])[key])
        return embeds[:, :msl], None

    def text_key(self, state: StepState, text: str) -> Any:
        """What identifies one text encoding (the text itself; an edit model adds its input image)."""
        return text

    def text_keys(self, state: StepState) -> list:
        req = state.request
        texts = [req.prompt, req.negative_prompt] if self._do_cfg(state) else [req.prompt]
        return [self.text_key(state, t) for t in texts]

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct prompt of the wave through the text encoder in one call (padded to the longest,
        with the attention mask, as diffusers encodes a list of prompts); each cut back to its own tokens."""
        with torch.no_grad():
            embeds, mask = self.embed_texts(list(keys))
        lengths = mask.sum(dim=1).tolist()
        return {key: embeds[i:i + 1, :n] for i, (key, n) in enumerate(zip(keys, lengths))}

    def embed_texts(self, keys: list) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' ``_get_qwen_prompt_embeds`` over the keys: padded ``[N, L, D]`` and the ``[N, L]`` mask."""
        return self.pipe._get_qwen_prompt_embeds(keys, self.device)

    def batch_key(self, state: StepState) -> tuple:
        """Same image size (the transformer takes one ``img_shapes`` layout per call) and dtype."""
        return (state.extra["height"], state.extra["width"], state.latents.dtype)

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call: each segment's packed latents with its branch's prompt, text padded to the
        longest (masked when lengths differ), one timestep (and guidance) per row."""
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        latents = states[0].latents if len(states) == 1 else torch.cat([s.latents for s in states])
        text, text_mask = self.segment_text_batch(segments)
        timestep = torch.stack([s.timesteps[s.step_index] for s in states])
        if len(set(rows)) != 1 or rows[0] != 1:
            timestep = timestep.repeat_interleave(torch.tensor(rows, device=timestep.device))
        timestep = timestep.to(latents.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([s.sampling_params.guidance_scale for s, r in zip(states, rows) for _ in range(r)],
                                    device=self.device, dtype=torch.float32)
        hidden_states, img_shapes = self.image_tokens(states, latents)
        preds = self.call_denoiser(expert, segments, text_mask, hidden_states=hidden_states, timestep=timestep / 1000,
                                   guidance=guidance, encoder_hidden_states_mask=text_mask,
                                   encoder_hidden_states=text, img_shapes=img_shapes, attention_kwargs={})
        return self.noise_predictions(preds, states)

    def image_tokens(self, states: list[StepState], latents: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The transformer's image stream for stacked ``latents`` of ``states`` and its ``img_shapes`` (one
        ``(frames, h, w)`` layout per part of the stream, per row)."""
        vsf = self.pipe.vae_scale_factor
        height, width = states[0].extra["height"], states[0].extra["width"]
        return latents, [[(1, height // vsf // 2, width // vsf // 2)]] * latents.shape[0]

    def noise_predictions(self, preds: list[torch.Tensor], states: list[StepState]) -> list[torch.Tensor]:
        """The part of each segment's output that predicts its latents (all of it here)."""
        return preds

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        pipe = self.pipe
        latents = pipe._unpack_latents(latents, state.extra["height"], state.extra["width"], pipe.vae_scale_factor)
        image = vae_decode(pipe.vae, self.denormalize_latents(latents))[:, :, 0]  # split across ranks when it pays
        return pipe.image_processor.postprocess(image, output_type="pt")

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The first image's unpacked latents ``[C, h, w]``."""
        return self.pipe._unpack_latents(state.latents[:1], state.extra["height"], state.extra["width"],
                                         self.pipe.vae_scale_factor)[0, :, 0]
