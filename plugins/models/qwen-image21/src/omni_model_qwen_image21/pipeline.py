"""Omni's ``QwenImage21Pipeline``: Qwen-Image 2.1 text-to-image with true CFG, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request scheduler, CFG
through the cfg-parallel helpers, prompt padding with key-padding masks, previews). What is Qwen-Image 2.1's own:
the text prefix's keys/values, computed once per request and branch when the request is prepared (diffusers'
first-step "extract", ``model.prefix_kv``) and handed to every step's transformer call per row, padded to the
longest and masked (diffusers' "cached" steps, ``model.OmniQwenImage21Transformer``); each row's rotary table
(its target image's frame index follows its own text); the flow-matching shift of its timesteps; its denoiser
spec (blocks, TeaCache signal, SP and TP plans).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.forward_context import use_denoise_call
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline
from omni_core.pipelines.base import read_model_index
from omni_model_qwen_image21.fields import SAMPLING_FIELDS, SIZE_MULTIPLE, TRUE_CFG_SCALE

#: diffusers' ``QwenImage21Pipeline.__call__`` defaults: ``output_resolution`` 1024, 40 steps
DEFAULT_SIZE = 1024
DEFAULT_STEPS = 40

#: sequence-parallel plan of the cached-prefix step (``model.OmniQwenImage21Transformer.forward``): the target
#: latents ``hidden_states [B, S, C]`` and their rotary table ``image_rotary_emb [B, S, D/2]`` are sharded on the
#: token dim; the prefix keys/values ``prefix_kv [B, P, ...]`` are the joint text every rank keeps whole, in
#: front of the image in every attention call; the output ``[B, S, C']`` is gathered on dim 1.
SP_PLAN = {"shard": {"hidden_states": 1, "image_rotary_emb": 1}, "gather": 1, "joint_text": "prefix_kv"}
#: tensor parallelism (diffusers' own ``_tp_plan``): q/k/v by heads, the output projection by input, the SwiGLU
#: MLP by hidden units; the shared modulation, input projections, final norm and projection stay whole. The
#: per-head QK RMS norms need no entry. The prefix is computed with the same split layers, so each rank keeps
#: its own heads' prefix keys/values.
TP_PLAN = {"transformer_blocks.*.attn.to_q": "colwise", "transformer_blocks.*.attn.to_k": "colwise",
           "transformer_blocks.*.attn.to_v": "colwise", "transformer_blocks.*.attn.to_out.0": "rowwise",
           "transformer_blocks.*.img_mlp.proj": "colwise", "transformer_blocks.*.img_mlp.gate_layer": "colwise",
           "transformer_blocks.*.img_mlp.out": "rowwise"}

#: TeaCache: no Qwen-Image 2.1 polynomial is published (ComfyUI-TeaCache's Qwen-Image one is for the 1.x dual-stream
#: transformer). These are fitted by ``omni cache calibrate`` on the tiny test folder (8 prompts, 20 steps, 64x64,
#: both CFG branches; 152 step pairs, input changes 0.027-0.110, R^2 0.68): what the tests run on. Calibrate a
#: released folder before relying on them (``omni cache calibrate --model <folder> --write`` stores its own in the
#: folder's cache_defaults.json).
TEACACHE_COEFFICIENTS = (-1.33061506e+04, 2.90855893e+03, -2.15996660e+02, 7.78304865e+00, -5.97167409e-02)
TEACACHE_DEFAULTS = {"coefficients": TEACACHE_COEFFICIENTS, "rel_l1_thresh": 0.3, "warmup_steps": 1}
#: cache_dit: on the tiny folder (4 requests, CFG, 20 steps, tests/test_caches.py) 0.6 reuses nothing, 1.0 reuses
#: the last block on most steps at 45-60 dB PSNR against uncached (no calibration command exists for cache_dit)
CACHE_DIT_DEFAULTS = {"residual_diff_threshold": 1.0, "max_warmup_steps": 2}


def modulated_input(transformer: Any, block: Any, a: dict) -> Any:
    """TeaCache's signal: block 0's ``img_norm1(hidden)`` modulated by the first scale of ``modulation``, as the
    block computes it (one modulation row per image row on the cached-prefix step)."""
    mod1 = a["modulation"].chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(a["hidden_states"]), mod1, None)[0]


def sample_sigmas(model_path: str | None) -> list[float] | None:
    """The folder's ``sample_sigmas`` (model_index.json; diffusers' default grid when set), or None."""
    index = read_model_index(model_path) if model_path else None
    return (index or {}).get("sample_sigmas")


class QwenImage21Pipeline(DiffusersStepPipeline):
    """Qwen-Image 2.1 text-to-image (diffusers ``QwenImage21Pipeline`` semantics, per-request prefix KV cache)."""

    diffusers_class = "QwenImage21Pipeline"
    preview_projections = None
    cfg_normalize = False  # 2.1: neg + s * (cond - neg), no norm rescale
    size_multiple = SIZE_MULTIPLE
    default_height = DEFAULT_SIZE
    default_width = DEFAULT_SIZE
    default_num_inference_steps = DEFAULT_STEPS
    sampling_fields = SAMPLING_FIELDS
    undeclared_field_hint = "use true_cfg_scale with a negative prompt for CFG"
    default_limits: ClassVar[dict] = {"max_pixels": 2048 * 2048}

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """The base's checks (defaults 1024x1024, multiples of 32, images only, ``true_cfg_scale`` 1.0); the step
        count defaults to the folder's ``sample_sigmas`` length when it has them (diffusers' default grid)."""
        sigmas = sample_sigmas(model_path)
        if params.num_inference_steps is None and sigmas:
            params = params.replace(num_inference_steps=len(sigmas))
        return super().check_sampling_params(params, model_path)

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None):
        """As the base, with the folder's processor loaded by :func:`~omni_model_qwen_image21.processor.load_processor`
        (which works without torchvision) and handed to diffusers' ``from_pretrained``."""
        import attrs

        from omni_core.config import OmniDiffusionConfig
        from omni_core.pipelines.diffusers_folder import check_model_index
        from omni_model_qwen_image21.processor import has_torchvision, load_processor

        check_model_index(model_path, cls.diffusers_class)
        config = config if config is not None else OmniDiffusionConfig(model=model_path)
        kwargs = dict(config.model_kwargs or {})
        if "processor" not in kwargs and not has_torchvision() and (processor := load_processor(model_path)):
            kwargs["processor"] = processor
        return super().load(model_path, attrs.evolve(config, model_kwargs=kwargs), device, dtype)

    # ------------------------------------------------------------------ worker process
    @property
    def transformer(self) -> torch.nn.Module:
        return self.experts["transformer"]

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_qwen_image21.attention import install_omni_attention
        from omni_model_qwen_image21.model import install_step_forward

        return install_omni_attention(install_step_forward(module))

    def denoisers(self) -> list[DenoiserSpec]:
        t = self.transformer
        return [DenoiserSpec(
            name="transformer", module=t, blocks_attr="transformer_blocks",
            block_params=("hidden_states", "modulation", "rotary_emb", "attention_mask", "target_token_mask",
                          "layer_cache", "kv_cache_mode", "cache_write_slice", "segments", "key_valid"),
            carried="hidden_states", block_outputs="hidden_states", residual_stream="hidden_states",
            side_inputs=("modulation", "rotary_emb", "layer_cache", "key_valid"),
            batch_args=("hidden_states", "timestep", "image_rotary_emb", "prefix_kv", "prefix_mask"),
            modulated_input=modulated_input,
            num_heads=t.config.num_attention_heads,
            sp_plan=SP_PLAN, tp_plan=TP_PLAN,
            cache_defaults={"tea_cache": TEACACHE_DEFAULTS, "cache_dit": CACHE_DIT_DEFAULTS})]

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps

        pipe, sp = self.pipe, state.sampling_params
        do_cfg = self._do_cfg(state)
        with torch.no_grad():
            state.prompt_embeds, state.prompt_mask = self._encode(state, state.request.prompt)
            if do_cfg:
                state.negative_prompt_embeds, state.negative_prompt_mask = self._encode(state,
                                                                                        state.request.negative_prompt)
            self.seed_generator(state)
            height, width = sp.height, sp.width
            state.latents, _ = pipe.prepare_latents(None, sp.num_outputs_per_prompt, self.transformer.config.in_channels,
                                                    height, width, state.prompt_embeds.dtype, self.device,
                                                    state.generator)
            state.extra["prefix"] = {"cond": self._prefix(state, "cond", state.prompt_embeds)}
            if do_cfg:
                state.extra["prefix"]["uncond"] = self._prefix(state, "uncond", state.negative_prompt_embeds)
        steps = sp.num_inference_steps
        sigmas = sample_sigmas_for(pipe, steps)
        cfg = pipe.scheduler.config
        mu = calculate_shift(state.latents.shape[1], cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        scheduler = self.new_scheduler()
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)
        self.start_schedule(state, scheduler, timesteps)
        true_cfg = sp.true_cfg_scale if sp.true_cfg_scale is not None else TRUE_CFG_SCALE.default
        state.extra.update(do_cfg=do_cfg, cfg_scale=true_cfg, height=height, width=width,
                           rows=sp.num_outputs_per_prompt)
        return state

    def _prefix(self, state: StepState, branch: str, text: torch.Tensor) -> torch.Tensor:
        """The request's prefix keys/values for one branch (``model.prefix_kv``), inside a denoise-call context of
        that one row so per-request LoRA layers apply the request's adapter to the prefix too."""
        from omni_model_qwen_image21.model import prefix_kv

        with use_denoise_call([(state, 1, branch)], expert="transformer", text_mask=None):
            return prefix_kv(self.transformer, text.to(self.dtype))

    @staticmethod
    def _do_cfg(state: StepState) -> bool:
        sp = state.sampling_params
        true_cfg = sp.true_cfg_scale if sp.true_cfg_scale is not None else TRUE_CFG_SCALE.default
        return true_cfg > 1 and state.request.negative_prompt is not None

    def _encode(self, state: StepState, text: str) -> tuple[torch.Tensor, None]:
        """diffusers' ``encode_prompt([text])``: ``[1, L, D]`` embeddings and no mask (one prompt has no
        padding); from the wave's batched encoding when there is one."""
        return self.encoded_text(state, text, lambda: self.encode_prompts([text])[text]), None

    def text_keys(self, state: StepState) -> list:
        req = state.request
        return [req.prompt, req.negative_prompt] if self._do_cfg(state) else [req.prompt]

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct prompt of the wave through Qwen3-VL in one call (left-padded with the attention mask,
        as diffusers encodes a list of prompts); each cut back to its own tokens."""
        with torch.no_grad():
            embeds, mask, _ = self.pipe._get_qwen_prompt_embeds(list(keys), None, self.device)
        lengths = mask.sum(dim=1).tolist()
        return {key: embeds[i:i + 1, :n] for i, (key, n) in enumerate(zip(keys, lengths))}

    def batch_key(self, state: StepState) -> tuple:
        """Same image size (one token grid per call) and dtype."""
        return (state.extra["height"], state.extra["width"], state.latents.dtype)

    def segment_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a row brings for its branch's text: the prefix keys/values ``[1, P, ...]`` (no mask: unpadded),
        which the base pads to the longest of a call and masks (``segment_text_batch``)."""
        return state.extra["prefix"][branch], None

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call: each segment's target latents with its branch's prefix (padded to the longest,
        masked when lengths differ), one timestep and one rotary table per row."""
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        latents = states[0].latents if len(states) == 1 else torch.cat([s.latents for s in states])
        prefix, prefix_mask = self.segment_text_batch(segments)
        timestep = torch.cat([s.timesteps[s.step_index].expand(r) for s, r in zip(states, rows)]).to(latents.dtype)
        rotary = self.rotary_rows(segments, rows)
        return self.call_denoiser(expert, segments, prefix_mask, hidden_states=latents, timestep=timestep / 1000,
                                  image_rotary_emb=rotary, prefix_kv=prefix, prefix_mask=prefix_mask,
                                  attention_kwargs={})

    def rotary_rows(self, segments: list[tuple[StepState, str]], rows: list[int]) -> torch.Tensor:
        """``[rows, S, D/2]``: each row's target rotary table, its frame index at its own prefix length."""
        tables = [self.target_table(self.segment_text(s, b)[0].shape[1], s)[None].expand(r, -1, -1)
                  for (s, b), r in zip(segments, rows)]
        return tables[0] if len(tables) == 1 else torch.cat(tables)

    def target_table(self, text_len: int, state: StepState) -> torch.Tensor:
        """The ``[S, D/2]`` rotary table of ``state``'s target image after a prefix of ``text_len`` tokens
        (memoised on the pipeline per length and grid: it depends on nothing else)."""
        from omni_model_qwen_image21.model import target_rotary

        memo = self.__dict__.setdefault("_rotary_memo", {})
        vsf = self.pipe.vae_scale_factor
        key = (text_len, state.extra["height"] // vsf, state.extra["width"] // vsf)
        if key not in memo:
            memo[key] = target_rotary(self.transformer, text_len, key[1:], self.device)
        return memo[key]

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        """diffusers' decode, RGB only: the 2.1 VAE decodes RGBA (four channels); Omni's image outputs are RGB
        (``PipelineContract``: PIL mode ``RGB``), so the fourth (alpha) channel is dropped and the three colour
        channels are diffusers' own values (not composited over a background)."""
        pipe = self.pipe
        latents = pipe._unpack_latents(latents, state.extra["height"], state.extra["width"], pipe.vae_scale_factor)
        image = vae_decode(pipe.vae, self.denormalize_latents(latents))[:, :, 0]  # split across ranks when it pays
        return pipe.image_processor.postprocess(image, output_type="pt")[:, :3]

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The first image's unpacked latents ``[C, h, w]``."""
        return self.pipe._unpack_latents(state.latents[:1], state.extra["height"], state.extra["width"],
                                         self.pipe.vae_scale_factor)[0, :, 0]


def sample_sigmas_for(pipe: Any, steps: int) -> list[float] | np.ndarray:
    """diffusers' sigmas: the folder's ``sample_sigmas`` when configured (their length is the step count, which
    ``check_sampling_params`` defaults to), else ``linspace(1, 1/steps, steps)``. A request asking for another
    step count than a configured grid gets the linspace grid of its count (diffusers would ignore the count)."""
    configured = getattr(pipe.config, "sample_sigmas", None)
    if configured and len(configured) == steps:
        return list(configured)
    return np.linspace(1.0, 1 / steps, steps)
