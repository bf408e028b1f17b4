"""Omni's ``ZImagePipeline``: Z-Image / Z-Image-Turbo text-to-image, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request
scheduler, the folded CFG call, previews, batched decode); what is Z-Image's own is here: its sampling rules,
its CFG form (``pos + s * (pos - neg)`` with truncation and renormalization, on whenever ``guidance_scale > 0``),
the list-of-samples transformer call (the denoiser spec: ``denoiser.py``).
"""

from __future__ import annotations

import os
import re
from typing import Any, ClassVar

import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults, folder_config
from omni_model_z_image.denoiser import ZImageDenoiser, denoiser_spec
from omni_model_z_image.fields import SAMPLING_FIELDS, vae_scale_factor

DEFAULT_MAX_SEQUENCE_LENGTH = 512
#: diffusers' ``SEQ_MULTI_OF``: the transformer pads text and image tokens to multiples of it
SEQ_MULTI_OF = 32
#: ``ZImageTransformer2DModel`` defaults, for a folder whose config leaves them out
DEFAULT_AXES_LENS = (1024, 512, 512)
#: diffusers' docstring example for Z-Image-Turbo: 8 steps, no CFG (diffusers' own defaults: 50 and 5.0)
TURBO_STEPS, TURBO_GUIDANCE = 8, 0.0
_TURBO = re.compile(r"z[-_]?image[-_]?turbo", re.IGNORECASE)


def is_turbo(model_path: str | None) -> bool:
    """A Z-Image-Turbo folder (distilled: few steps, no CFG), told by its path (``Z-Image-Turbo`` in a folder
    name, as in the hub id ``Tongyi-MAI/Z-Image-Turbo`` and its cache snapshots); nothing in the folder's
    configs tells the two apart."""
    return bool(model_path) and any(_TURBO.search(part) for part in os.path.abspath(model_path).split(os.sep))


class ZImagePipeline(DiffusersStepPipeline):
    """Z-Image text-to-image (diffusers ``ZImagePipeline`` semantics, float-exact denoise math)."""

    diffusers_class = "ZImagePipeline"
    #: the transformer takes one text per row and pads and masks inside, and diffusers itself runs a request's two
    #: CFG branches as one call
    cfg_folds_with_masks = True
    #: latent-to-RGB preview projections for the released VAE (a folder's preview_projection.json comes first)
    preview_projections = "omni_model_z_image:preview_projections.json"
    fast_vae_convs = False  # AutoencoderKL: 2-D convolutions already
    size_multiple = 16
    default_height = 1024
    default_width = 1024
    default_num_inference_steps = 50
    default_guidance_scale = 5.0
    #: ``cfg_normalization`` and ``cfg_truncation``, also on the record
    sampling_fields = SAMPLING_FIELDS
    undeclared_field_hint = "Z-Image's CFG is guidance_scale (on whenever > 0) with negative_prompt"
    default_limits: ClassVar[dict] = {"max_pixels": 2048 * 2048}

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__`` (Turbo folders: 8 steps, no CFG); height/width multiples of
        vae_scale_factor * 2 and within the transformer's rotary table, as is the text length."""
        vsf = vae_scale_factor(model_path)
        multiple = vsf * 2
        axes = (folder_config(model_path, "transformer") or {}).get("axes_lens") or DEFAULT_AXES_LENS
        # the text's rotary positions start at 1 and the image's follow the text padded to SEQ_MULTI_OF
        text_limit = axes[0] - SEQ_MULTI_OF - 1
        turbo = is_turbo(model_path)
        params = fill_defaults(params, height=cls.default_height, width=cls.default_width,
                               num_inference_steps=TURBO_STEPS if turbo else cls.default_num_inference_steps,
                               guidance_scale=TURBO_GUIDANCE if turbo else cls.default_guidance_scale,
                               max_sequence_length=min(DEFAULT_MAX_SEQUENCE_LENGTH, text_limit))
        for name, patches in (("height", axes[1]), ("width", axes[2])):
            value = getattr(params, name)
            if value % multiple:
                lo, hi = value // multiple * multiple, (value // multiple + 1) * multiple
                raise ConfigError(
                    f"{name}={value} is not allowed for {cls.__name__}: height and width must each be a multiple of "
                    f"{multiple} (VAE scale factor {vsf} x 2 for the 2x2 patches), e.g. {lo or multiple} or {hi}",
                    field=name)
            if value // multiple > patches:
                raise ConfigError(f"{name}={value} is not allowed for {cls.__name__}: at most {patches * multiple} "
                                  f"(the transformer's rotary table covers {patches} patches)", field=name)
        if params.num_frames not in (None, 1):
            raise ConfigError(f"num_frames={params.num_frames} is not allowed: {cls.__name__} makes images "
                              f"(leave num_frames unset or 1)", field="num_frames")
        if params.max_sequence_length > text_limit:
            raise ConfigError(f"max_sequence_length={params.max_sequence_length} is not allowed for {cls.__name__}: "
                              f"at most {text_limit} (the transformer's rotary table covers {axes[0]} positions)",
                              field="max_sequence_length")
        return cls.check_model_fields(params)

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Ulysses splits heads: its degree must divide the folder's ``n_heads`` / ``n_kv_heads``."""
        from omni_core.distributed import validate_parallel_config

        tcfg = folder_config(model_path, "transformer") or {}
        validate_parallel_config(parallel_config, num_heads=tcfg.get("n_heads"), num_kv_heads=tcfg.get("n_kv_heads"),
                                 model=cls.__name__)

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        super().__init__(pipe, device, dtype, layers)
        self.experts = {"transformer": ZImageDenoiser(pipe.transformer)}

    @property
    def transformer(self) -> torch.nn.Module:
        """diffusers' ``ZImageTransformer2DModel``."""
        return self.pipe.transformer

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_z_image.attention import install_omni_attention

        return install_omni_attention(module)

    def denoisers(self) -> list[DenoiserSpec]:
        return [denoiser_spec(self.experts["transformer"])]

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.z_image.pipeline_z_image import (calculate_shift, get_default_z_image_sigmas,
                                                                  retrieve_timesteps)

        pipe, sp, req = self.pipe, state.sampling_params, state.request
        guided = sp.guidance_scale > 0  # diffusers: CFG whenever the scale is positive, "" as default negative
        with torch.no_grad():
            state.prompt_embeds = self._encode(state, req.prompt, sp.max_sequence_length)
            if guided:
                state.negative_prompt_embeds = self._encode(state, req.negative_prompt or "", sp.max_sequence_length)
        self.seed_generator(state)
        state.latents = pipe.prepare_latents(sp.num_outputs_per_prompt, self.transformer.in_channels, sp.height,
                                             sp.width, torch.float32, self.device, state.generator)
        cfg = pipe.scheduler.config
        mu = calculate_shift((state.latents.shape[2] // 2) * (state.latents.shape[3] // 2),
                             cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        scheduler = self.new_scheduler()
        steps = sp.num_inference_steps
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=get_default_z_image_sigmas(steps),
                                          mu=mu)
        self.start_schedule(state, scheduler, timesteps)
        state.extra.update(guided=guided, do_cfg=guided, guidance=sp.guidance_scale,
                           cfg_scale=1.0 + sp.guidance_scale, cfg_normalization=sp.cfg_normalization,
                           cfg_truncation=sp.cfg_truncation, height=sp.height, width=sp.width)
        return state

    def _encode(self, state: StepState, text: str, msl: int) -> torch.Tensor:
        """diffusers' ``_encode_prompt([text])[0]``: the ``[L, D]`` states of the prompt's own tokens; from the
        wave's batched encoding when there is one."""
        return self.encoded_text(state, (text, msl), lambda: self.pipe._encode_prompt(
            [text], device=self.device, max_sequence_length=msl)[0])

    def text_keys(self, state: StepState) -> list:
        sp, req = state.sampling_params, state.request
        keys = [(req.prompt, sp.max_sequence_length)]
        if sp.guidance_scale > 0:
            keys.append((req.negative_prompt or "", sp.max_sequence_length))
        return keys

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct prompt of the wave through the text encoder in one call per text length (diffusers
        pads each to ``max_sequence_length`` and keeps its own tokens)."""
        out = {}
        with torch.no_grad():
            for msl in dict.fromkeys(m for _, m in keys):
                texts = [t for t, m in keys if m == msl]
                embeds = self.pipe._encode_prompt(list(texts), device=self.device, max_sequence_length=msl)
                out.update({(t, msl): e for t, e in zip(texts, embeds)})
        return out

    def segment_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, None]:
        return (state.negative_prompt_embeds if branch == "uncond" else state.prompt_embeds), None

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call: each segment's latents with its branch's prompt states (one ``[L, D]`` per
        row, lengths free), timestep ``(1000 - t) / 1000`` per row. Each output is also kept on its state for
        the renormalization."""
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        latents = torch.cat([s.latents for s in states]).to(self.transformer.dtype).unsqueeze(2)
        t = torch.stack([s.timesteps[s.step_index] for s in states]).repeat_interleave(
            torch.tensor(rows, device=latents.device))
        caps = [self.segment_text(s, b)[0] for (s, b), r in zip(segments, rows) for _ in range(r)]
        outs = self.call_denoiser(expert, segments, None, hidden_states=latents, timestep=(1000 - t) / 1000,
                                  cap_feats=caps)
        outs = [o.float() for o in outs]
        for (s, branch), o in zip(segments, outs):
            s.extra[f"pred_{branch}"] = o
        return outs

    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """The base's folded call with this step's CFG on/off per request (truncation), then diffusers'
        renormalization per image and the sign flip (the transformer predicts ``-velocity``)."""
        for s in states:
            s.extra["do_cfg"] = self._cfg_now(s)
        preds = super().denoise_step(states)
        out = []
        for s, pred in zip(states, preds):
            x = s.extra
            if x["do_cfg"] and x["cfg_normalization"] > 0:
                pred = self._renormalize(s, pred)
            x.pop("pred_cond", None)
            x.pop("pred_uncond", None)
            out.append(-pred.squeeze(2))
        return out

    @staticmethod
    def _cfg_now(state: StepState) -> bool:
        """diffusers: a step whose normalized time ``(1000 - t) / 1000`` exceeds ``cfg_truncation`` runs
        without CFG."""
        x = state.extra
        if not x["guided"]:
            return False
        t_norm = ((1000 - state.timesteps[state.step_index].float()) / 1000).item()
        return not (x["cfg_truncation"] <= 1 and t_norm > x["cfg_truncation"])

    @staticmethod
    def _renormalize(state: StepState, pred: torch.Tensor) -> torch.Tensor:
        """Cap each image's guided norm at ``cfg_normalization`` times its cond prediction's norm. A cfg-parallel
        rank that ran only the uncond branch recovers the cond one from ``pred = pos + s * (pos - neg)``."""
        x = state.extra
        pos = x.get("pred_cond")
        if pos is None:
            pos = (pred + x["guidance"] * x["pred_uncond"]) / (1 + x["guidance"])
        ori = torch.linalg.vector_norm(pos.flatten(1), dim=1)
        new = torch.linalg.vector_norm(pred.flatten(1), dim=1)
        cap = ori * float(x["cfg_normalization"])
        factor = torch.where(new > cap, cap / new, torch.ones_like(new))
        return pred * factor.view(-1, *([1] * (pred.dim() - 1)))

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae_decode(vae, latents)  # split across ranks when it pays
        return self.pipe.image_processor.postprocess(image, output_type="pt")

    def preview_latents(self, state: StepState) -> torch.Tensor:
        return state.latents[0]
