"""Omni's ``HunyuanVideo15Pipeline``: HunyuanVideo 1.5 text-to-video, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request scheduler, CFG
through the cfg-parallel helpers, batched text encoding and VAE decode, previews). What is HunyuanVideo 1.5's own:

* **two text encoders**: Qwen2.5-VL's text model (the prompt in a chat template with diffusers' system message,
  the third-to-last hidden states, the template's first ``prompt_template_encode_start_idx`` tokens cropped) and
  ByT5 on the quoted "glyph" texts of the prompt (none: no glyph tokens);
* **conditions as channels**: the transformer's input is ``[noise, condition latents, mask]`` (zeros for
  text-to-video; image-to-video puts the VAE-encoded image in the first frame, :mod:`.i2v`) plus SigLIP image
  embeddings (zeros for text-to-video, which the transformer masks out);
* **guidance** from the folder's ``guider`` (diffusers' ``ClassifierFreeGuidance``: ``uncond + g (cond - uncond)``,
  on unless ``g == 1``), the request's ``guidance_scale`` overriding its scale;
* **the schedule**: flow-matching Euler with diffusers' explicit ``sigmas = linspace(1, 0, steps + 1)[:-1]``.

Padding: diffusers pads the Qwen text to 1000 tokens, ByT5 to 256 and the image tokens to 729 and masks the padding
everywhere (the transformer moves the valid condition tokens of each row to the front). Omni encodes each text to its
own valid tokens only (Qwen is causal and right-padded, ByT5 masks its padding keys: a valid token's output does not
depend on the padding) and pads one call's rows to that call's longest; text-to-video passes no image tokens. Every
valid token sees exactly what it sees in diffusers (up to float summation order), at a fraction of the cost.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.distributed.tensor_parallel import attention_layers, feed_forward_layers
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults
from omni_core.pipelines.shape_check import round_frames
from omni_model_hunyuan_video15.fields import bucket_size, guider_config, size_rules, target_size

logger = logging.getLogger(__name__)

#: diffusers' ``HunyuanVideo15Pipeline.__call__`` defaults; its T2V default size is the 16:9 bucket of the folder's
#: ``target_size``; ``ClassifierFreeGuidance``'s own default scale where a folder has no guider config
DEFAULT_NUM_FRAMES, DEFAULT_STEPS, DEFAULT_GUIDANCE = 121, 50, 7.5
DEFAULT_ASPECT = (16, 9)  # (width, height)

#: sequence parallelism of diffusers' ``HunyuanVideo15Transformer3DModel`` (checked against its forward): the video
#: tokens are sharded where the patch embedding makes them (``x_embedder``'s output ``[B, S, D]``, dim 1), with the
#: rotary tables ``rope`` returns (``(cos [S, d], sin [S, d])``, dim 0); the condition tokens (image, ByT5, Qwen)
#: stay whole on every rank at the back of each joint attention (the processor sets their count per call); the
#: video tokens are gathered after ``proj_out``, before the unpatchify reshape.
SP_PLAN = {"shard_after": {"x_embedder": 1, "rope": {0: 0, 1: 0}}, "gather_after": {"proj_out": 1},
           "gather": None, "joint_text_side": "back"}
#: tensor parallelism: the dual-stream blocks as FLUX's double blocks (joint attention by heads, both MLPs by hidden
#: units, both adaLN modulations gathered); the token refiner and the embedders stay whole
TP_PLAN = {**attention_layers("transformer_blocks.*.attn", joint=True),
           **feed_forward_layers("transformer_blocks.*.ff"), **feed_forward_layers("transformer_blocks.*.ff_context"),
           "transformer_blocks.*.norm1.linear": "colwise_gather",
           "transformer_blocks.*.norm1_context.linear": "colwise_gather"}

#: TeaCache: no HunyuanVideo 1.5 polynomial is published (TeaCache4HunyuanVideo's is for HunyuanVideo 1.0, another
#: architecture). These are fitted by ``omni cache calibrate`` on the tiny test folder (8 prompts, 20 steps, CFG,
#: 16x16x5; 304 step pairs, input changes 0.021-0.129, R^2 0.82): what the tests run on. Calibrate a released folder
#: before relying on them (``omni cache calibrate --model <folder> --write`` stores its own in the folder's
#: cache_defaults.json, which overrides these key by key).
TEACACHE_COEFFICIENTS = (-4.03043799e+03, 1.17584769e+03, -1.22090899e+02, 6.06044694e+00, -6.01138381e-02)
TEACACHE_DEFAULTS = {"coefficients": TEACACHE_COEFFICIENTS, "rel_l1_thresh": 0.3, "warmup_steps": 1}
#: cache_dit: first block computed, the rest reused while the residual change stays under the threshold
CACHE_DIT_DEFAULTS = {"residual_diff_threshold": 0.3, "max_warmup_steps": 2}


def modulated_input(transformer: Any, block: Any, a: dict) -> torch.Tensor:
    """TeaCache's signal: block 0's ``norm1(hidden_states, emb=temb)`` (the timestep-modulated video tokens)."""
    return block.norm1(a["hidden_states"], emb=a["temb"])[0]


class HunyuanVideo15Pipeline(DiffusersStepPipeline):
    """HunyuanVideo 1.5 text-to-video (diffusers ``HunyuanVideo15Pipeline`` semantics)."""

    diffusers_class = "HunyuanVideo15Pipeline"
    #: diffusers always hands the transformer the text masks (its padding is masked everywhere), so a request's
    #: cond and uncond rows fold into one masked call with the same result
    cfg_folds_with_masks = True
    is_video = True
    size_multiple = 16
    frame_multiple = 4
    default_height, default_width = 480, 848  # the 16:9 bucket of target_size 640 (480p); a folder's decides
    default_num_frames = DEFAULT_NUM_FRAMES
    default_num_inference_steps = DEFAULT_STEPS
    default_guidance_scale = 6.0
    #: 720p (target_size 960) and 241 frames
    default_limits: ClassVar[dict] = {"max_pixels": 1280 * 720, "max_frames": 241}

    # ------------------------------------------------------------------ engine process
    @classmethod
    def size_multiples(cls, model_path: str | None) -> tuple[int, int, int]:
        return size_rules(model_path)[:3]

    @classmethod
    def default_size(cls, model_path: str | None) -> tuple[int, int]:
        """diffusers' T2V default: the 16:9 bucket of the transformer's ``target_size``."""
        return bucket_size(DEFAULT_ASPECT[1], DEFAULT_ASPECT[0], target_size(model_path), size_rules(model_path)[3])

    @classmethod
    def folder_guidance(cls, model_path: str | None) -> float:
        """The folder's guider scale (diffusers uses it; Omni's default for ``guidance_scale``)."""
        if not model_path:
            return cls.default_guidance_scale
        return float(guider_config(model_path).get("guidance_scale", DEFAULT_GUIDANCE))

    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__`` (the size from the folder's ``target_size``, the guidance scale from
        its guider); height/width must be multiples of the VAE's spatial factor x the patch size (16), refused
        otherwise; ``num_frames - 1`` not a multiple of the temporal factor (4) is rounded with a warning."""
        hm, wm, temporal, _ = size_rules(model_path)
        height, width = cls.default_size(model_path)
        params = fill_defaults(params, height=height, width=width, num_frames=cls.default_num_frames,
                               num_inference_steps=cls.default_num_inference_steps,
                               guidance_scale=cls.folder_guidance(model_path))
        for name, m in (("height", hm), ("width", wm)):
            value = getattr(params, name)
            if value % m:
                lo, hi = value // m * m, (value // m + 1) * m
                raise ConfigError(f"{name}={value} is not allowed for {cls.__name__}: height must be a multiple of "
                                  f"{hm} and width a multiple of {wm} (VAE spatial factor x patch size), e.g. "
                                  f"{lo or m} or {hi}", field=name)
        frames = round_frames(params.num_frames, temporal)
        if frames != params.num_frames:
            logger.warning("num_frames=%d: num_frames - 1 must be a multiple of %d (the VAE's temporal factor) for "
                           "%s; rounded to %d", params.num_frames, temporal, cls.__name__, frames)
            params = params.replace(num_frames=frames)
        return cls.check_model_fields(params)

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        super().__init__(pipe, device, dtype, layers)
        transformer = pipe.transformer
        self.transformer_dtype = transformer.dtype
        self.latent_channels = pipe.num_channels_latents
        guider = getattr(pipe, "guider", None)
        if guider is not None:
            cfg = guider.config
            unsupported = {k: cfg.get(k) for k, v in (("guidance_rescale", 0.0), ("use_original_formulation", False),
                                                      ("start", 0.0), ("stop", 1.0), ("enabled", True))
                           if cfg.get(k, v) != v}
            if type(guider).__name__ != "ClassifierFreeGuidance" or unsupported:
                raise ConfigError(f"{type(self).__name__}: the folder's guider {type(guider).__name__} "
                                  f"{unsupported or ''} is not supported (plain ClassifierFreeGuidance only)",
                                  field="model")

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_hunyuan_video15.attention import install_omni_attention

        return install_omni_attention(module, prefix=f"{name}.")

    def denoisers(self) -> list[DenoiserSpec]:
        model = self.pipe.transformer
        return [DenoiserSpec(
            name="transformer", module=model, blocks_attr="transformer_blocks",
            block_params=("hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis"),
            carried=("hidden_states", "encoder_hidden_states"),
            block_outputs=("hidden_states", "encoder_hidden_states"), residual_stream="hidden_states",
            side_inputs=("temb", "attention_mask"),
            batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                        "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds"),
            modulated_input=modulated_input, num_heads=model.config.num_attention_heads,
            sp_plan=SP_PLAN, tp_plan=TP_PLAN,
            cache_defaults={"tea_cache": TEACACHE_DEFAULTS, "cache_dit": CACHE_DIT_DEFAULTS})]

    # -- text
    def text_keys(self, state: StepState) -> list:
        keys = [state.request.prompt]
        if self._guided(state):
            keys.append(state.request.negative_prompt or "")  # diffusers: "" (formatted as " ") when None
        return keys

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct text of the wave through both encoders, one call each: ``{text: (qwen [1, n, D],
        byt5 [1, m, D2])}`` holding the valid tokens only."""
        texts = list(dict.fromkeys(keys))
        with torch.no_grad():
            qwen = self.qwen_embeds(texts)
            byt5 = self.byt5_embeds(texts)
        return {t: (q, b) for t, q, b in zip(texts, qwen, byt5)}

    def _encoded(self, state: StepState, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoded_text(state, text, lambda: self.encode_prompts([text])[text])

    def qwen_embeds(self, texts: list[str]) -> list[torch.Tensor]:
        """diffusers' ``_get_mllm_prompt_embeds`` for each text, its valid tokens only (``[1, n, D]``). One encoder
        call padded to the longest text instead of ``tokenizer_max_length + crop``: the encoder is causal and the
        tokenizer pads on the right, so a valid token's hidden states do not depend on the padding after it."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        pipe = self.pipe
        crop = pipe.prompt_template_encode_start_idx
        tokens = pipe.tokenizer.apply_chat_template(
            format_text_input(texts, pipe.system_message), add_generation_prompt=True, tokenize=True,
            return_dict=True, padding="longest", max_length=pipe.tokenizer_max_length + crop, truncation=True,
            return_tensors="pt")
        ids, mask = tokens.input_ids, tokens.attention_mask
        if bool((mask[:, :1] == 0).any()):
            raise ConfigError("HunyuanVideo 1.5: the Qwen tokenizer pads on the left; right padding is required",
                              field="model")
        device = next(pipe.text_encoder.parameters()).device
        hidden = pipe.text_encoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                                   output_hidden_states=True).hidden_states[-3]
        hidden = hidden.to(device=self.device, dtype=self.transformer_dtype)
        return [hidden[i:i + 1, crop:n] for i, n in enumerate(mask.sum(dim=1).tolist())]

    def byt5_embeds(self, texts: list[str]) -> list[torch.Tensor]:
        """diffusers' ``_get_byt5_prompt_embeds`` for each text, valid tokens only (``[1, m, D2]``; ``m = 0`` for a
        text without quoted glyph text, which diffusers encodes as fully masked zeros). The glyph texts go through
        ByT5 in one call padded to the longest (ByT5 masks its padding keys)."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

        pipe = self.pipe
        encoder = pipe.text_encoder_2
        glyphs = [extract_glyph_texts(t) for t in texts]
        out = [torch.zeros(1, 0, encoder.config.d_model, device=self.device, dtype=self.transformer_dtype)
               for _ in texts]
        todo = [i for i, g in enumerate(glyphs) if g is not None]
        if todo:
            tokens = pipe.tokenizer_2([glyphs[i] for i in todo], padding="longest",
                                      max_length=pipe.tokenizer_2_max_length, truncation=True,
                                      add_special_tokens=True, return_tensors="pt")
            device = next(encoder.parameters()).device
            hidden = encoder(input_ids=tokens.input_ids.to(device),
                             attention_mask=tokens.attention_mask.float().to(device))[0]
            hidden = hidden.to(device=self.device, dtype=self.transformer_dtype)
            for row, (i, n) in enumerate(zip(todo, tokens.attention_mask.sum(dim=1).tolist())):
                out[i] = hidden[row:row + 1, :n]
        return out

    # -- per request
    def _guidance(self, state: StepState) -> float:
        g = state.sampling_params.guidance_scale
        return float(g if g is not None else self.default_guidance_scale)

    def _guided(self, state: StepState) -> bool:
        """``ClassifierFreeGuidance``'s rule (non-original formulation): on unless the scale is 1."""
        return not math.isclose(self._guidance(state), 1.0)

    def prepare_encode(self, state: StepState) -> StepState:
        sp, req = state.sampling_params, state.request
        do_cfg = self._guided(state)
        with torch.no_grad():
            state.prompt_embeds, state.extra["byt5"] = self._encoded(state, req.prompt)
            if do_cfg:
                state.negative_prompt_embeds, state.extra["neg_byt5"] = self._encoded(state, req.negative_prompt or "")
        scheduler = self.new_scheduler()
        sigmas = np.linspace(1.0, 0.0, sp.num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(sigmas=sigmas, device=self.device)
        self.start_schedule(state, scheduler, scheduler.timesteps)
        self.seed_generator(state)
        self.prepare_latents(state)
        state.extra.update(do_cfg=do_cfg, cfg_scale=self._guidance(state))
        return state

    def prepare_latents(self, state: StepState) -> None:
        """The request's noise, drawn by diffusers' ``prepare_latents`` from its generator; text-to-video's
        condition (zeros) is made per call."""
        sp = state.sampling_params
        state.latents = self.pipe.prepare_latents(sp.num_outputs_per_prompt, self.latent_channels, sp.height,
                                                  sp.width, sp.num_frames, torch.float32, self.device,
                                                  state.generator)

    def segment_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = state.negative_prompt_embeds if branch == "uncond" else state.prompt_embeds
        return embeds, torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)

    def condition(self, state: StepState) -> torch.Tensor:
        """``[condition latents, mask]`` rows of ``state`` (text-to-video: zeros, as diffusers)."""
        b, c, f, h, w = state.latents.shape
        return state.latents.new_zeros(b, c + 1, f, h, w)

    def image_embeds(self, segments: list[tuple[StepState, str]], rows: int) -> torch.Tensor:
        """The SigLIP embeddings of a call (text-to-video: none; diffusers' zeros are masked out)."""
        dim = self.pipe.transformer.config.image_embed_dim
        return torch.zeros(rows, 0, dim, device=self.device, dtype=self.transformer_dtype)

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call: each segment's ``[latents, condition, mask]`` rows with its branch's Qwen and
        ByT5 tokens (padded to the call's longest, with their masks), one timestep per row."""
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        inputs = [torch.cat([s.latents, self.condition(s)], dim=1) for s in states]
        hidden = (inputs[0] if len(inputs) == 1 else torch.cat(inputs)).to(self.transformer_dtype)
        text, text_mask = self.segment_text_batch(segments)
        byt5, byt5_mask = self.pad_text([s.extra["neg_byt5" if b == "uncond" else "byt5"] for s, b in segments],
                                        None, rows)
        total = sum(rows)
        if text_mask is None:
            text_mask = torch.ones(text.shape[:2], dtype=torch.bool, device=text.device)
        if byt5_mask is None:
            byt5_mask = torch.ones(byt5.shape[:2], dtype=torch.bool, device=byt5.device)
        timestep = torch.cat([s.timesteps[s.step_index].expand(r) for s, r in zip(states, rows)])
        return self.call_denoiser(expert, segments, text_mask, hidden_states=hidden,
                                  timestep=timestep.to(self.transformer_dtype), encoder_hidden_states=text,
                                  encoder_attention_mask=text_mask.to(self.transformer_dtype),
                                  encoder_hidden_states_2=byt5,
                                  encoder_attention_mask_2=byt5_mask.to(self.transformer_dtype),
                                  image_embeds=self.image_embeds(segments, total), **self.extra_inputs(segments))

    def extra_inputs(self, segments: list[tuple[StepState, str]]) -> dict:
        """More transformer arguments of one call (MeanFlow folders' ``timestep_r``: image-to-video)."""
        return {}

    # -- decoding
    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        """diffusers' decode: ``latents / scaling_factor`` through the VAE, post-processed to ``[n, F, 3, H, W]``.

        One video at a time: diffusers' ``HunyuanVideo15AttnBlock`` (0.42.1) builds its causal mask as
        ``[batch, S, S]`` against ``[batch, 1, S, C]`` queries, which only broadcasts for a batch of one (a batch of
        several fails with a shape error, in diffusers' own pipeline too)."""
        vae = self.pipe.vae
        latents = latents.to(self.device, dtype=vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae_decode(vae, row) for row in latents.split(1)])
        return self.pipe.video_processor.postprocess_video(video, output_type="pt")

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """Every latent frame of the first video ``[C, F, h, w]``."""
        return state.latents[0]
