"""Omni's ``LTX2Pipeline``: LTX-2 text-to-video with its audio track, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, per-request schedulers, the
text window, previews). What is LTX-2's own, and why it is written here rather than taken from diffusers'
``__call__`` (which runs one batch start to end):

* **One state tensor for both streams.** LTX-2's transformer denoises a video and an audio latent together.
  ``state.latents`` is ``[n, S_v * C_v + S_a * C_a]``: the packed video tokens then the packed audio tokens,
  flattened. diffusers steps the audio with a copy of the video's scheduler (the same sigmas) and the flow-match
  Euler step is elementwise, so one step of the joined tensor is bit for bit diffusers' two steps; and the
  core's machinery that knows one latent per request (the decode stage's payload, previews' clean estimate,
  batching by latent shape) carries the audio with no core change. ``state.extra`` holds the shapes.
* **Guidance in the denoised space.** diffusers converts each prediction to x0, adds CFG, STG and
  modality-isolation deltas per stream with their own scales, rescales, and converts back to a velocity;
  :meth:`guide` does the same per request, so requests with different scales share a call.
* **One transformer call per wave**: every request's conditional rows, then the guided ones' unconditional
  rows, STG rows (the ``stg_block`` self-attentions skipped: the transformer's own per-row
  ``perturbation_mask``) and modality-isolation rows (their audio-video cross-attentions zeroed per row, which is
  what diffusers' per-call ``isolate_modalities`` does to them), with per-row timesteps, positions and text
  masks. diffusers runs the STG and modality passes as calls of their own.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar

import numpy as np
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.forward_context import use_denoise_call
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults
from omni_core.pipelines.shape_check import round_frames
from omni_model_ltx2.denoiser import denoiser_spec
from omni_model_ltx2.fields import SAMPLING_FIELDS, size_rules

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQUENCE_LENGTH = 1024

#: the guidance branches besides ``cond``, in row order, and the state flag that turns each on
BRANCH_FLAGS = (("uncond", "do_cfg"), ("stg", "do_stg"), ("modality", "do_modality"))


def _guidance_defaults(sp: SamplingParams) -> dict:
    """The request's guidance knobs as diffusers' ``__call__`` resolves them (an audio knob unset or 0 takes the
    video one's value: diffusers' ``audio_guidance_scale or guidance_scale``)."""
    g = sp.guidance_scale
    return {"guidance_scale": g, "stg_scale": sp.stg_scale, "modality_scale": sp.modality_scale,
            "guidance_rescale": sp.guidance_rescale,
            "audio_guidance_scale": sp.audio_guidance_scale or g, "audio_stg_scale": sp.audio_stg_scale or sp.stg_scale,
            "audio_modality_scale": sp.audio_modality_scale or sp.modality_scale,
            "audio_guidance_rescale": sp.audio_guidance_rescale or sp.guidance_rescale}


class LTX2Pipeline(DiffusersStepPipeline):
    """LTX-2 text-to-video + audio (diffusers ``LTX2Pipeline`` semantics, float-exact denoise math)."""

    diffusers_class = "LTX2Pipeline"
    is_video = True
    size_multiple = 32
    frame_multiple = 8
    default_height = 512
    default_width = 768
    default_num_frames = 121
    default_num_inference_steps = 30
    default_guidance_scale = 3.0
    #: LTX-2's trained range: up to 4K-class frames is beyond what one request should ask by default
    default_limits: ClassVar[dict] = {"max_pixels": 1920 * 1088, "max_frames": 257}
    sampling_fields = SAMPLING_FIELDS
    undeclared_field_hint = "use guidance_scale / audio_guidance_scale, stg_scale, modality_scale"
    #: the encode stage needs the connectors too (they turn Gemma's hidden states into the two streams' text);
    #: the decode stage both VAEs and the vocoder
    stage_components: ClassVar[dict] = {"encode": ("text_encoder", "tokenizer", "connectors"),
                                        "decode": ("vae", "audio_vae", "vocoder")}
    #: the joined video+audio state is stepped by the flow step; a rollout's SDE noise over it is not diffusers'
    supports_rollout: ClassVar[bool] = False
    fast_vae_convs: ClassVar[bool] = False  # LTX-2's VAE is not a causal-Conv3d Wan VAE
    #: video tokens over ulysses/ring ranks (``denoiser.sp_plan``), guidance branches over cfg ranks (below)
    supported_parallel: ClassVar[tuple[str, ...]] = ("tensor", "ulysses", "ring", "cfg")

    # ------------------------------------------------------------------ engine process
    @classmethod
    def size_multiples(cls, model_path: str | None) -> tuple[int, int]:
        return size_rules(model_path)[:2]

    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__``; height/width must be multiples of the VAE's spatial compression
        x the patch size (32 for LTX-2), refused otherwise (diffusers would make latents of the floor);
        ``num_frames - 1`` not a multiple of the temporal compression (8) is rounded with a warning."""
        hm, wm, temporal = size_rules(model_path)
        params = fill_defaults(params, height=cls.default_height, width=cls.default_width,
                               num_frames=cls.default_num_frames, num_inference_steps=cls.default_num_inference_steps,
                               guidance_scale=cls.default_guidance_scale,
                               max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH)
        for name, m in (("height", hm), ("width", wm)):
            value = getattr(params, name)
            if value % m:
                lo, hi = value // m * m, (value // m + 1) * m
                raise ConfigError(f"{name}={value} is not allowed for {cls.__name__}: height must be a multiple of "
                                  f"{hm} and width a multiple of {wm} (VAE spatial compression x patch size), e.g. "
                                  f"{lo or m} or {hi}", field=name)
        frames = round_frames(params.num_frames, temporal)
        if frames != params.num_frames:
            logger.warning("num_frames=%d: num_frames - 1 must be a multiple of %d (the VAE's temporal compression) "
                           "for %s; rounded to %d", params.num_frames, temporal, cls.__name__, frames)
            params = params.replace(num_frames=frames)
        return cls.check_model_fields(params)

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        super().__init__(pipe, device, dtype, layers)
        tr = pipe.transformer
        self.transformer_dtype = tr.dtype
        self.in_channels = tr.config.in_channels
        self.audio_in_channels = tr.config.audio_in_channels
        self.patch = (pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_ltx2.attention import install_omni_attention

        return install_omni_attention(module, prefix=f"{name}.")

    def denoisers(self) -> list[DenoiserSpec]:
        return [denoiser_spec(self.pipe.transformer)]

    # -- text
    def text_keys(self, state: StepState) -> list:
        msl = state.sampling_params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        keys = [(state.request.prompt, msl)]
        if self._guidance(state)["do_cfg"]:
            keys.append((state.request.negative_prompt or "", msl))
        return keys

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct (prompt, max_sequence_length) of the wave through Gemma-3 and the connectors, one call
        per length: diffusers' ``_get_gemma_prompt_embeds`` (left padding to the length: Gemma is causal and its
        positions count the padding, so the length is kept) then ``connectors`` (per row: a masked mean, the
        connector transformers). Each key: (video text ``[1, L, D]``, audio text ``[1, L, Da]``, mask ``[1, L]``)."""
        out: dict = {}
        for msl in dict.fromkeys(m for _, m in keys):
            texts = [t for t, m in keys if m == msl]
            with torch.no_grad():
                embeds, mask = self.pipe._get_gemma_prompt_embeds(texts, 1, msl, device=self.device)
                side = getattr(self.pipe.tokenizer, "padding_side", "left") if self.pipe.tokenizer is not None \
                    else "left"
                video, audio, cmask = self.pipe.connectors(embeds, mask, padding_side=side)
            out.update({(t, msl): (video[i:i + 1], audio[i:i + 1], cmask[i:i + 1]) for i, t in enumerate(texts)})
        return out

    def _encode(self, state: StepState, text: str, msl: int) -> tuple:
        return self.encoded_text(state, (text, msl), lambda: self.encode_prompts([(text, msl)])[(text, msl)])

    def _guidance(self, state: StepState) -> dict:
        g = _guidance_defaults(state.sampling_params)
        g["do_cfg"] = g["guidance_scale"] > 1.0 or g["audio_guidance_scale"] > 1.0
        g["do_stg"] = g["stg_scale"] > 0.0 or g["audio_stg_scale"] > 0.0
        g["do_modality"] = g["modality_scale"] > 1.0 or g["audio_modality_scale"] > 1.0
        return g

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        pipe, sp, req = self.pipe, state.sampling_params, state.request
        guidance = self._guidance(state)
        msl = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        with torch.no_grad():
            video, audio, mask = self._encode(state, req.prompt, msl)
            state.prompt_embeds, state.prompt_mask = video.to(self.transformer_dtype), mask
            state.extra["audio_prompt_embeds"] = audio.to(self.transformer_dtype)
            if guidance["do_cfg"]:  # diffusers: "" when no negative prompt is given
                video, audio, mask = self._encode(state, req.negative_prompt or "", msl)
                state.negative_prompt_embeds, state.negative_prompt_mask = video.to(self.transformer_dtype), mask
                state.extra["audio_negative_prompt_embeds"] = audio.to(self.transformer_dtype)
        self.seed_generator(state)
        frames = (sp.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        h, w = sp.height // pipe.vae_spatial_compression_ratio, sp.width // pipe.vae_spatial_compression_ratio
        audio_frames = round(sp.num_frames / sp.frame_rate * pipe.audio_sampling_rate / pipe.audio_hop_length
                             / float(pipe.audio_vae_temporal_compression_ratio))
        mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        state.extra.update(height=sp.height, width=sp.width, latent_grid=(frames, h, w), audio_frames=audio_frames,
                           mel_bins=mel_bins, fps=conditioning_frame_rate(sp.frame_rate, 1.0),
                           stg_blocks=(sp.stg_block,), **guidance)
        video_latents, audio_latents = self.initial_latents(state)
        state.extra["video_shape"] = tuple(video_latents.shape[1:])
        state.extra["audio_shape"] = tuple(audio_latents.shape[1:])
        state.latents = torch.cat([video_latents.flatten(1), audio_latents.flatten(1)], dim=1)
        # diffusers' schedule: linear sigmas, shifted by the video token count
        n = sp.num_inference_steps
        sigmas = np.linspace(1.0, 1 / n, n)
        config = pipe.scheduler.config
        mu = calculate_shift(video_latents.shape[1], config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                             config.get("max_shift", 2.05))
        scheduler = self.new_scheduler()
        scheduler.set_timesteps(sigmas=sigmas, device=self.device, mu=mu)
        self.start_schedule(state, scheduler, scheduler.timesteps)
        return state

    def initial_latents(self, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's packed video and audio noise, drawn in diffusers' order from its generator."""
        pipe, sp = self.pipe, state.sampling_params
        n = sp.num_outputs_per_prompt
        video = pipe.prepare_latents(n, self.in_channels, sp.height, sp.width, sp.num_frames, 0.0, torch.float32,
                                     self.device, state.generator)
        audio = pipe.prepare_audio_latents(n, pipe.audio_vae.config.latent_channels, state.extra["audio_frames"],
                                           pipe.audio_vae.config.mel_bins, 0.0, torch.float32, self.device,
                                           state.generator)
        return video, audio

    def split_latents(self, state: StepState, latents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The joined ``[n, S_v*C_v + S_a*C_a]`` state -> packed video ``[n, S_v, C_v]`` and audio ``[n, S_a, C_a]``."""
        latents = state.latents if latents is None else latents
        vs, as_ = state.extra["video_shape"], state.extra["audio_shape"]
        nv = vs[0] * vs[1]
        return latents[:, :nv].unflatten(1, vs), latents[:, nv:].unflatten(1, as_)

    def batch_key(self, state: StepState) -> tuple:
        """Same latent grid and audio length (one call's token counts), dtype and STG blocks."""
        return (state.extra["latent_grid"], state.extra["audio_frames"], state.latents.dtype, state.extra["stg_blocks"])

    def decode_groups(self, states: list[StepState]) -> list[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            key = (("latent", i) if s.sampling_params.output_type == "latent"
                   else (s.extra["latent_grid"], s.extra["audio_frames"], s.extra["height"], s.extra["width"],
                         s.latents.dtype))
            groups.setdefault(key, []).append(i)
        return list(groups.values())

    # -- the denoise loop
    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """Per batch key ONE transformer call (:meth:`_denoise_group`); each request's velocity guided as diffusers
        does (:meth:`guide`)."""
        preds: list[Any] = [None] * len(states)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(self.batch_key(s), []).append(i)
        with torch.no_grad():
            for idx in groups.values():
                group = [states[i] for i in idx]
                for i, pred in zip(idx, self._denoise_group(group)):
                    preds[i] = pred
        return preds

    def _denoise_group(self, group: list[StepState]) -> list[torch.Tensor]:
        """ONE transformer call for the group: every request's conditional rows, then the guided ones'
        unconditional rows, the STG rows (``perturbation_mask`` 0: the ``stg_block`` self-attentions skip to
        their values, as diffusers' separate STG pass with every row perturbed) and the modality-isolation rows
        (their audio-video cross-attentions zeroed: diffusers' ``isolate_modalities``) of those that use them.
        With a cfg group of two ranks, see :meth:`_branches_over_ranks`."""
        from omni_core.distributed import get_cfg_group

        preds: dict[tuple, tuple] = {}
        if get_cfg_group().world_size == 1:
            segments = [(s, "cond") for s in group]
            for branch, flag in BRANCH_FLAGS:
                segments += [(s, branch) for s in group if s.extra[flag]]
            for (s, b), pred in zip(segments, self.run_segments("transformer", segments)):
                preds[(id(s), b)] = pred
        else:
            preds = self._branches_over_ranks(group)
        return [self.guide(s, preds[(id(s), "cond")], preds.get((id(s), "uncond")), preds.get((id(s), "stg")),
                           preds.get((id(s), "modality"))) for s in group]

    def _branches_over_ranks(self, group: list[StepState]) -> dict[tuple, tuple]:
        """CFG parallel: the requests with the same guidance branches (cond, and uncond / STG / modality as each
        uses them) have one call per branch, spread round-robin over the cfg ranks (``parallel_branches``:
        cond and STG on rank 0, uncond and modality on rank 1 for diffusers' defaults) and all-gathered as
        joined video+audio velocities; a set with one branch (no guidance) runs on every rank."""
        from omni_core.distributed.cfg_parallel import parallel_branches

        sets: dict[tuple, list[StepState]] = {}
        for s in group:
            sets.setdefault(("cond",) + tuple(b for b, f in BRANCH_FLAGS if s.extra[f]), []).append(s)
        preds: dict[tuple, tuple] = {}
        for names, members in sets.items():
            if len(names) == 1:
                outs = [self.run_segments("transformer", [(s, "cond") for s in members])]
            else:
                joined = parallel_branches([lambda b=b: self._joined([(s, b) for s in members]) for b in names])
                outs = [self._unjoined(j, members) for j in joined]
            for b, per in zip(names, outs):
                preds.update({(id(s), b): p for s, p in zip(members, per)})
        return preds

    def _joined(self, segments: list[tuple[StepState, str]]) -> torch.Tensor:
        """One call over ``segments``: its (video, audio) predictions as one ``[rows, S_v*C_v + S_a*C_a]``."""
        return torch.cat([torch.cat([v.flatten(1), a.flatten(1)], dim=1)
                          for v, a in self.run_segments("transformer", segments)])

    def _unjoined(self, joined: torch.Tensor, states: list[StepState]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = [s.latents.shape[0] for s in states]
        return [self.split_latents(s, part) for s, part in zip(states, joined.split(rows))]

    def guide(self, state: StepState, cond: tuple, uncond: tuple | None, stg: tuple | None,
              mod: tuple | None) -> torch.Tensor:
        """diffusers' guidance of one request, per stream in x0 space: ``x0_cond + cfg + stg + modality`` deltas,
        rescaled towards the conditional prediction's std, back to a velocity; the joined velocity."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        e = state.extra
        sigma = state.scheduler.sigmas[state.step_index]
        latents = self.split_latents(state)
        out = []
        for k, prefix in enumerate(("", "audio_")):
            x = latents[k]

            def x0(pred: tuple) -> torch.Tensor:
                return x - pred[k].float() * sigma

            pos = x0(cond)
            cfg_delta = (e[prefix + "guidance_scale"] - 1) * (pos - x0(uncond)) if uncond is not None else 0
            stg_delta = e[prefix + "stg_scale"] * (pos - x0(stg)) if stg is not None else 0
            mod_delta = (e[prefix + "modality_scale"] - 1) * (pos - x0(mod)) if mod is not None else 0
            guided = pos + cfg_delta + stg_delta + mod_delta
            rescale = e[prefix + "guidance_rescale"]
            pred = rescale_noise_cfg(guided, pos, guidance_rescale=rescale) if rescale > 0 else guided
            out.append(((x - pred) / sigma).flatten(1))
        return torch.cat(out, dim=1)

    def segment_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if branch == "uncond":
            return state.negative_prompt_embeds, state.negative_prompt_mask
        return state.prompt_embeds, state.prompt_mask

    def _audio_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        if branch == "uncond":
            return state.extra["audio_negative_prompt_embeds"], state.negative_prompt_mask
        return state.extra["audio_prompt_embeds"], state.prompt_mask

    def transformer_inputs(self, segments: list[tuple[StepState, str]]) -> dict:
        """The transformer's arguments for ``segments`` (in row order): the rows' video and audio latents, both
        texts padded with one key mask, per-row timesteps and positions."""
        tr = self.pipe.transformer
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        parts = [self.split_latents(s) for s in states]
        video = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        audio = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        text, mask = self.segment_text_batch(segments)
        audio_texts = [self._audio_text(s, b) for s, b in segments]
        audio_text, _ = self.pad_text([t for t, _ in audio_texts], [m for _, m in audio_texts], rows)
        t = torch.stack([s.timesteps[s.step_index] for s in states])
        timestep = t if rows == [1] * len(rows) else t.repeat_interleave(torch.tensor(rows, device=t.device))
        frames, h, w = states[0].extra["latent_grid"]
        video_coords = torch.cat([tr.rope.prepare_video_coords(r, frames, h, w, self.device, fps=s.extra["fps"])
                                  for s, r in zip(states, rows)])
        audio_coords = tr.audio_rope.prepare_audio_coords(sum(rows), states[0].extra["audio_frames"], self.device)
        return {"hidden_states": video.to(self.transformer_dtype), "audio_hidden_states": audio.to(self.transformer_dtype),
                "encoder_hidden_states": text, "audio_encoder_hidden_states": audio_text,
                "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
                "timestep": timestep, "sigma": timestep, "num_frames": frames, "height": h, "width": w,
                "audio_num_frames": states[0].extra["audio_frames"], "video_coords": video_coords,
                "audio_coords": audio_coords}

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One transformer call over ``segments`` ((state, branch): ``cond``, ``uncond``, ``stg``, ``modality``);
        (video, audio) predictions per segment. Like the base's ``call_denoiser`` (the typed call context,
        diffusers' cache context) for a denoiser with two outputs and per-row STG / modality switches."""
        from omni_model_ltx2.attention import cross_modal_rows

        kwargs = self.transformer_inputs(segments)
        rows = [s.latents.shape[0] for s, _ in segments]
        branches = [b for _, b in segments]
        if "stg" in branches:
            kwargs["spatio_temporal_guidance_blocks"] = list(segments[0][0].extra["stg_blocks"])
            kwargs["perturbation_mask"] = torch.tensor([0.0 if b == "stg" else 1.0 for b, r in zip(branches, rows)
                                                        for _ in range(r)], device=self.device)
        keep = None
        if "modality" in branches:
            keep = torch.tensor([0.0 if b == "modality" else 1.0 for b, r in zip(branches, rows) for _ in range(r)],
                                device=self.device)
        module = self.experts[expert]
        names = set(branches)
        context = names.pop() if len(names) == 1 else "+".join(sorted(set(branches)))
        cache_context = getattr(module, "cache_context", None)
        # every row under its own branch (a cache keeps the STG and modality rows' state apart from cond's);
        # diffusers' cache context names the mix
        with use_denoise_call([(s, r, b) for (s, b), r in zip(segments, rows)],
                              expert=expert, text_mask=kwargs["encoder_attention_mask"]), \
                (cache_context(context) if cache_context is not None else contextlib.nullcontext()), \
                cross_modal_rows(keep):
            video, audio = module(**kwargs, use_cross_timestep=True, return_dict=False)
        if len(rows) == 1:
            return [(video, audio)]
        return list(zip(video.split(rows), audio.split(rows)))

    # -- decoding
    def post_decode_batch(self, states: list[StepState]) -> list[DiffusionOutput]:
        """One decode of each stream per group of one shape: the video VAE (frames ``[n, F, 3, H, W]`` in [0, 1]
        on ``tensor``) and the audio VAE + vocoder (``audio`` ``[n, channels, samples]`` at
        ``audio_sample_rate``). ``latent`` output returns the joined latents."""
        outs = [DiffusionOutput(request_id=s.request_id, finished=True, step_index=s.step_index,
                                num_steps=s.num_steps) for s in states]
        for idx in self.decode_groups(states):
            group = [states[i] for i in idx]
            if group[0].sampling_params.output_type == "latent":
                outs[idx[0]].tensor = group[0].latents
                continue
            latents = group[0].latents if len(group) == 1 else torch.cat([s.latents for s in group])
            with torch.no_grad():
                video, audio = self.decode_both(latents, group[0])
            rows = [s.latents.shape[0] for s in group]
            for i, v, a in zip(idx, video.split(rows), audio.split(rows)):
                outs[i].tensor, outs[i].audio = v, a
                outs[i].audio_sample_rate = self.audio_sample_rate
        return outs

    @property
    def audio_sample_rate(self) -> int:
        vocoder = self.pipe.vocoder
        return int(getattr(vocoder.config, "output_sampling_rate", None) or self.pipe.audio_sampling_rate)

    def decode_both(self, latents: torch.Tensor, state: StepState) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' decode of stacked final latents: video ``[n, F, 3, H, W]`` in [0, 1], audio waveforms."""
        pipe = self.pipe
        video, audio = self.split_latents(state, latents)
        frames, h, w = state.extra["latent_grid"]
        video = pipe._unpack_latents(video, frames, h, w, *self.patch)
        timestep = None
        if pipe.vae.config.timestep_conditioning:  # decode_timestep 0: diffusers' noise is scaled by 0
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        video = pipe._denormalize_latents(video, pipe.vae.latents_mean, pipe.vae.latents_std,
                                          pipe.vae.config.scaling_factor).to(pipe.vae.dtype)
        video = pipe.vae.decode(video, timestep, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(video, output_type="pt")
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, state.extra["audio_frames"], num_mel_bins=state.extra["mel_bins"])
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        return video, pipe.vocoder(mel).float()

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        return self.decode_both(latents, state)[0]

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The first video's latent frames ``[C, F, h, w]`` (the audio is not shown)."""
        video = self.split_latents(state)[0][:1]
        frames, h, w = state.extra["latent_grid"]
        return self.pipe._unpack_latents(video, frames, h, w, *self.patch)[0]
