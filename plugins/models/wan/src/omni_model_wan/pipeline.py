"""Omni's ``WanPipeline``: Wan 2.1 / Wan 2.2 text-to-video, batched across requests, step by step.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline` (loading, the per-request
scheduler, CFG through the cfg-parallel helpers, prompt padding with key-padding masks, previews). Wan 2.2
A14B folders carry a second expert (``transformer_2``) and ``boundary_ratio``: steps with
``t >= boundary_ratio * num_train_timesteps`` use ``transformer`` with ``guidance_scale``, later steps
``transformer_2`` with ``guidance_scale_2``; each expert has its own denoiser spec.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.distributed.tensor_parallel import attention_layers, feed_forward_layers
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_folder import read_model_index
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults
from omni_core.pipelines.shape_check import round_frames
from omni_model_wan.fields import SAMPLING_FIELDS, size_rules

logger = logging.getLogger(__name__)

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


def tp_plan(model: Any) -> dict:
    """Tensor parallelism: self- and cross-attention by heads (their RMSNorms span all heads: split with an
    all-reduced mean of squares), the FFN by hidden units, I2V's image key/value projections when present."""
    i2v = getattr(model.blocks[0].attn2, "add_k_proj", None) is not None
    return {**attention_layers("blocks.*.attn1", norms_across_heads=("norm_q", "norm_k")),
            **attention_layers("blocks.*.attn2", norms_across_heads=("norm_q", "norm_k"), added_kv=i2v),
            **feed_forward_layers("blocks.*.ffn")}

#: TeaCache4Wan2.1 "ret_steps" polynomials (input: the timestep projection ``e0``), by model width
TEACACHE_1_3B_COEFFICIENTS = (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02)
TEACACHE_14B_COEFFICIENTS = (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01)


def teacache_defaults(transformer: Any) -> dict:
    """TeaCache4Wan2.1 with ``use_ret_steps``: the first 5 steps always compute; 0.08 (1.3B, width <= 2048)
    / 0.2 (14B) are its "fast" thresholds (~2x)."""
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    if width <= 2048:
        return {"coefficients": TEACACHE_1_3B_COEFFICIENTS, "rel_l1_thresh": 0.08, "warmup_steps": 5}
    return {"coefficients": TEACACHE_14B_COEFFICIENTS, "rel_l1_thresh": 0.2, "warmup_steps": 5}


class WanPipeline(DiffusersStepPipeline):
    """Wan text-to-video (diffusers ``WanPipeline`` semantics, float-exact denoise math)."""

    diffusers_class = "WanPipeline"
    #: latent-to-RGB preview projections for the released VAE (a folder's preview_projection.json comes first)
    preview_projections = "omni_model_wan:preview_projections.json"
    denoiser_names: ClassVar[tuple[str, ...]] = ("transformer", "transformer_2")
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
    #: ``guidance_scale_2`` (Wan 2.2's second expert), also on the record
    sampling_fields = SAMPLING_FIELDS
    undeclared_field_hint = "use guidance_scale (and guidance_scale_2 for Wan 2.2's second expert)"

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """Defaults as diffusers' ``__call__``. height/width must be multiples of the VAE's spatial factor x the
        patch size (16 for Wan), refused otherwise (diffusers rounds them silently); ``num_frames - 1`` not a
        multiple of the temporal factor (4) is rounded with a warning, as diffusers and vLLM-Omni do."""
        hm, wm, temporal, _ = size_rules(model_path)
        params = fill_defaults(params, height=cls.default_height, width=cls.default_width,
                               num_frames=cls.default_num_frames, num_inference_steps=cls.default_num_inference_steps,
                               guidance_scale=cls.default_guidance_scale, max_sequence_length=DEFAULT_MAX_SEQUENCE_LENGTH)
        for name, m in (("height", hm), ("width", wm)):
            value = getattr(params, name)
            if value % m:
                lo, hi = value // m * m, (value // m + 1) * m
                raise ConfigError(f"{name}={value} is not allowed for {cls.__name__}: height must be a multiple of "
                                  f"{hm} and width a multiple of {wm} (VAE spatial factor x patch size), e.g. "
                                  f"{lo or m} or {hi}", field=name)
        frames = round_frames(params.num_frames, temporal)
        if frames != params.num_frames:  # as diffusers' WanPipeline: round, with a warning
            logger.warning("num_frames=%d: num_frames - 1 must be a multiple of %d (the VAE's temporal factor) for "
                           "%s; rounded to %d", params.num_frames, temporal, cls.__name__, frames)
            params = params.replace(num_frames=frames)
        params = cls.check_model_fields(params)  # guidance_scale_2; other models' fields are refused
        index = (read_model_index(model_path) if model_path else None) or {}
        if params.guidance_scale_2 is not None and model_path and index.get("boundary_ratio") is None:
            raise ConfigError(f"guidance_scale_2 needs a two-expert Wan 2.2 model (boundary_ratio in "
                              f"model_index.json); {model_path!r} has none", field="guidance_scale_2")
        if params.boundary_ratio is not None and model_path and index.get("boundary_ratio") is None:
            raise ConfigError(f"boundary_ratio needs a two-expert Wan 2.2 model (boundary_ratio in "
                              f"model_index.json); {model_path!r} has one expert", field="boundary_ratio")
        if params.flow_shift is not None and model_path and _shift_key(model_path) is None:
            raise ConfigError(f"flow_shift: the scheduler of {model_path!r} has no 'shift' or 'flow_shift' setting",
                              field="flow_shift")
        return params

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        super().__init__(pipe, device, dtype, layers)
        first = next(iter(self.experts.values()))
        self.transformer_dtype = first.dtype
        self.in_channels = first.config.in_channels
        self.patch_size = tuple(first.config.patch_size)
        ratio = pipe.config.boundary_ratio
        self.boundary_timestep = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_wan.attention import install_omni_attention

        return install_omni_attention(module, prefix=f"{name}.")

    def denoisers(self) -> list[DenoiserSpec]:
        """One spec per expert (Wan 2.2 A14B: two, with their own TeaCache state and SP hooks)."""
        return [DenoiserSpec(
            name=name, module=model, blocks_attr="blocks",
            block_params=("hidden_states", "encoder_hidden_states", "temb", "rotary_emb"),
            carried=("hidden_states",), block_outputs=("hidden_states",), residual_stream="hidden_states",
            side_inputs=("encoder_hidden_states", "temb"),
            batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
            # TeaCache4Wan2.1 compares the timestep projection e0 (what every block's ``temb`` is)
            modulated_input=lambda module, block, a: a["temb"],
            num_heads=model.config.num_attention_heads,
            sp_plan=SP_PLAN_EXPANDED if self.expand_timesteps else SP_PLAN, tp_plan=tp_plan(model),
            cache_defaults={"tea_cache": teacache_defaults(model)}) for name, model in self.experts.items()]

    # -- step-wise protocol
    def prepare_encode(self, state: StepState) -> StepState:
        sp, req = state.sampling_params, state.request
        guidance_scale = sp.guidance_scale if sp.guidance_scale is not None else self.default_guidance_scale
        guidance_scale_2 = sp.guidance_scale_2
        if self.boundary_timestep is not None and guidance_scale_2 is None:
            guidance_scale_2 = guidance_scale
        do_cfg = guidance_scale > 1.0
        msl = sp.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        with torch.no_grad():
            pe = self._encode(state, req.prompt, msl)
            ne = self._encode(state, req.negative_prompt or "", msl) if do_cfg else None  # diffusers: "" when None
        state.prompt_embeds = pe.to(self.transformer_dtype)
        state.negative_prompt_embeds = ne.to(self.transformer_dtype) if ne is not None else None
        scheduler = self.new_scheduler()
        if sp.sample_solver is not None:  # Wan's solver names, as diffusers schedulers
            scheduler = solver_scheduler(scheduler, sp.sample_solver)
        if sp.flow_shift is not None:  # this request's shift (vLLM-Omni's flow_shift)
            key = "flow_shift" if "flow_shift" in scheduler.config else "shift"
            scheduler = type(scheduler).from_config(scheduler.config, **{key: sp.flow_shift})
        if sp.boundary_ratio is not None and self.boundary_timestep is not None:
            state.extra["boundary_timestep"] = sp.boundary_ratio * scheduler.config.num_train_timesteps
        scheduler.set_timesteps(sp.num_inference_steps, device=self.device)
        self.start_schedule(state, scheduler, scheduler.timesteps)
        self.seed_generator(state)
        self.prepare_latents(state)
        state.extra.update(do_cfg=do_cfg, cfg_scale=guidance_scale, cfg_scale_2=guidance_scale_2)
        return state

    def prepare_latents(self, state: StepState) -> None:
        """The request's initial noise, drawn by diffusers' ``prepare_latents`` from its generator."""
        sp = state.sampling_params
        state.latents = self.pipe.prepare_latents(sp.num_outputs_per_prompt, self.in_channels, sp.height, sp.width,
                                                  sp.num_frames, torch.float32, self.device, state.generator)

    def _guided(self, state: StepState) -> bool:
        sp = state.sampling_params
        return (sp.guidance_scale if sp.guidance_scale is not None else self.default_guidance_scale) > 1.0

    def _encode(self, state: StepState, text: str, msl: int) -> torch.Tensor:
        """diffusers' T5 embedding of one prompt (zero-padded to ``msl``); from the wave's batched encoding
        when there is one."""
        return self.encoded_text(state, (text, msl), lambda: self.t5_embeds([text], msl))

    def text_keys(self, state: StepState) -> list:
        msl = state.sampling_params.max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH
        keys = [(state.request.prompt, msl)]
        if self._guided(state):
            keys.append((state.request.negative_prompt or "", msl))
        return keys

    def encode_prompts(self, keys: list) -> dict:
        """Every distinct (prompt, max_sequence_length) of the wave through the text encoder, one call per
        length (each row is padded to its length with its own attention mask, as diffusers encodes one)."""
        out: dict = {}
        by_length: dict[int, list[str]] = {}
        for text, msl in keys:
            by_length.setdefault(msl, []).append(text)
        with torch.no_grad():
            for msl, texts in by_length.items():
                embeds = self.t5_embeds(texts, msl)
                out.update({(t, msl): embeds[i:i + 1] for i, t in enumerate(texts)})
        return out

    def t5_embeds(self, texts: list[str], msl: int) -> torch.Tensor:
        """diffusers' ``_get_t5_prompt_embeds(texts, max_sequence_length=msl)``: ``[len(texts), msl, D]``, each
        prompt's tokens encoded with the attention mask and zero beyond them. The encoder runs on the batch's
        longest prompt, not ``msl`` tokens: T5 is bidirectional with masked padding keys, per-token norms and
        MLPs, and relative position biases, so a real token's output does not depend on how much padding
        follows (diffusers discards the padding's outputs); the same result up to float summation order."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        pipe = self.pipe
        tokens = pipe.tokenizer([prompt_clean(t) for t in texts], padding="longest", max_length=msl, truncation=True,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids, tokens.attention_mask
        device = next(pipe.text_encoder.parameters()).device
        hidden = pipe.text_encoder(ids.to(device), mask.to(device)).last_hidden_state
        hidden = hidden.to(dtype=pipe.text_encoder.dtype, device=self.device)
        embeds = hidden.new_zeros(len(texts), msl, hidden.shape[-1])
        for i, n in enumerate(mask.gt(0).sum(dim=1).tolist()):
            embeds[i, :n] = hidden[i, :n]
        return embeds

    def expert_for(self, state: StepState) -> tuple[str, float]:
        """The expert and guidance scale for the state's current timestep (diffusers' boundary rule)."""
        t = state.timesteps[state.step_index]
        boundary = state.extra.get("boundary_timestep", self.boundary_timestep)
        if boundary is None or t >= boundary:
            return "transformer", state.extra["cfg_scale"]
        return "transformer_2", state.extra["cfg_scale_2"]

    def expert_name(self, state: StepState) -> str:
        return self.expert_for(state)[0]

    def cfg_scale(self, state: StepState) -> float:
        return self.expert_for(state)[1]

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One expert call: each segment's latents with its branch's prompt, one timestep per row (per token
        for Wan 2.2 TI2V)."""
        states = [s for s, _ in segments]
        rows = [s.latents.shape[0] for s in states]
        inputs = [self.model_input(s) for s in states]
        latents = (inputs[0] if len(inputs) == 1 else torch.cat(inputs)).to(self.transformer_dtype)
        # each embedding is already zero-padded to its request's max_sequence_length, as diffusers does: the
        # mask hides only the extra positions of the shorter ones
        text, text_mask = self.segment_text_batch(segments)
        timestep = torch.stack([s.timesteps[s.step_index] for s in states])
        if len(set(rows)) != 1 or rows[0] != 1:
            timestep = timestep.repeat_interleave(torch.tensor(rows, device=timestep.device))
        if self.expand_timesteps:  # Wan 2.2 TI2V: one timestep per latent token
            timestep = self.token_timesteps(states, timestep, latents)
        return self.call_denoiser(expert, segments, text_mask, hidden_states=latents, timestep=timestep,
                                  encoder_hidden_states=text, attention_kwargs=None,
                                  **self.extra_inputs(segments))

    def model_input(self, state: StepState) -> torch.Tensor:
        """The transformer's ``hidden_states`` rows of ``state`` (image-to-video adds its condition)."""
        return state.latents

    def token_timesteps(self, states: list[StepState], timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """``[rows]`` timesteps -> ``[rows, tokens]`` (all equal for text-to-video)."""
        _, _, f, h, w = latents.shape
        return timestep[:, None].expand(-1, f * (h // self.patch_size[1]) * (w // self.patch_size[2]))

    def extra_inputs(self, segments: list[tuple[StepState, str]]) -> dict:
        """More transformer arguments for one call (image-to-video: the image embeddings)."""
        return {}

    def segment_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, None]:
        return (state.negative_prompt_embeds if branch == "uncond" else state.prompt_embeds), None

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        pipe = self.pipe
        video = vae_decode(pipe.vae, self.denormalize_latents(latents))  # split across ranks when it pays
        return pipe.video_processor.postprocess_video(video, output_type="pt")  # [n, F, 3, H, W]

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """Every latent frame of the first video ``[C, F, h, w]`` (the preview shows four of them, tiled)."""
        return state.latents[0]


#: Wan's ``sample_solver`` values -> the diffusers scheduler with flow prediction (Wan's reference code:
#: FlowUniPCMultistepScheduler / FlowDPMSolverMultistepScheduler; euler: flow matching)
SOLVERS = {"unipc": "UniPCMultistepScheduler", "dpm++": "DPMSolverMultistepScheduler",
           "euler": "FlowMatchEulerDiscreteScheduler"}


def solver_scheduler(scheduler: Any, solver: str) -> Any:
    """``scheduler`` (the folder's) as the scheduler of ``solver``, keeping its training timesteps and shift; the
    folder's own scheduler when it already is that one."""
    import diffusers

    name = SOLVERS[solver]
    if type(scheduler).__name__ == name:
        return scheduler
    config = scheduler.config
    shift = config.get("flow_shift", config.get("shift", 1.0))
    cls = getattr(diffusers, name)
    if solver == "euler":
        return cls(num_train_timesteps=config.num_train_timesteps, shift=shift)
    return cls(num_train_timesteps=config.num_train_timesteps, prediction_type="flow_prediction",
               use_flow_sigmas=True, flow_shift=shift)


def _shift_key(model_path: str) -> str | None:
    """The scheduler config's shift setting (``flow_shift``: UniPC; ``shift``: flow-match Euler), or None."""
    import json
    import os

    try:
        with open(os.path.join(model_path, "scheduler", "scheduler_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return "shift"  # not a readable folder here: the worker's scheduler decides
    return next((k for k in ("flow_shift", "shift") if k in config), None)
