"""A base for Omni pipelines built on a diffusers pipeline object, stepped request by request.

Models such as Qwen-Image and Wan keep a real diffusers pipeline for its helpers (``encode_prompt``,
``prepare_latents``, the VAE and image/video processors) and run Omni's own denoise loop: one scheduler per
request, one denoiser call per (expert, CFG branch) for a batch of requests that may be at different steps
and have prompts of different token lengths. Everything in that loop that does not depend on the model lives
here once, so a model plugin writes only what is really its own:

* ``diffusers_class`` and ``install_attention`` (how its attention modules call Omni ``Attention`` layers);
* ``prepare_encode`` (prompt encoding, latents, timesteps: use :meth:`start_schedule`);
* ``run_branch`` (the denoiser's arguments for a batch of states: use :meth:`pad_text` and
  :meth:`call_denoiser`, which sets the typed :class:`~omni_core.forward_context.DenoiseCall`);
* ``post_decode`` (use :meth:`denormalize_latents`), ``preview_latents`` and ``denoisers()`` (the specs).

CFG (plain, or true CFG with norm rescale via ``cfg_normalize``) goes through
:mod:`omni_core.distributed.cfg_parallel`, so cfg parallelism works with no model code. Sequence
parallelism is applied by the core from the specs' ``sp_plan`` after ``load`` (see
:func:`omni_core.attention.parallel.plan.apply_sequence_parallel_to_pipeline`).

Importing this module imports torch (it is the worker side of a model); ``import omni_core`` does not.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar

import torch

from omni_core.distributed.cfg_parallel import cfg_combine
from omni_core.forward_context import use_config, use_denoise_call
from omni_core.pipelines.base import OmniPipeline
from omni_core.pipelines.diffusers_folder import check_model_index, dtype_kwarg, read_json
from omni_core.pipelines.state import StepState


def latents_to_rgb(lat: torch.Tensor) -> torch.Tensor:
    """``[C, h, w]`` latents -> ``[3, h, w]`` in [0, 1]: channels 0..2 (repeated when fewer), each min-max
    scaled. A preview without a VAE decode: cheap enough to send every step."""
    rgb = lat[:3] if lat.shape[0] >= 3 else lat[:1].expand(3, -1, -1)
    lo = rgb.amin(dim=(1, 2), keepdim=True)
    hi = rgb.amax(dim=(1, 2), keepdim=True)
    return ((rgb - lo) / (hi - lo).clamp_min(1e-6)).cpu()


def pad_text(embeds: list[torch.Tensor], masks: list[torch.Tensor | None] | None, rows: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack per-request ``[1, L_i, D]`` prompt embeddings into ``[sum(rows), max L, D]`` with zero padding
    (each repeated for the request's ``rows``), and the ``[sum(rows), max L]`` key-padding mask (True =
    attend) built from the requests' own masks (None: all valid) and the padding. The mask is None when
    nothing is masked, which is what diffusers passes for a single prompt, so one request alone computes
    exactly what diffusers computes."""
    masks = masks if masks is not None else [None] * len(embeds)
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


def fill_defaults(params: Any, **defaults: Any) -> Any:
    """``params`` (``SamplingParams``) with every field that is None set to its default here (as a diffusers
    ``__call__``'s keyword defaults would be)."""
    changes = {name: value for name, value in defaults.items() if getattr(params, name) is None}
    return params.replace(**changes) if changes else params


def folder_config(model_path: str | None, component: str) -> dict | None:
    """``<model_path>/<component>/config.json`` as a dict; None without a folder or file."""
    return read_json(os.path.join(model_path, component, "config.json")) if model_path else None


class DiffusersStepPipeline(OmniPipeline):
    """Step-wise Omni pipeline around a diffusers pipeline object (see the module docstring).

    A subclass's ``prepare_encode`` sets ``state.extra["do_cfg"]`` (whether the request runs the uncond
    branch) and ``state.extra["cfg_scale"]``; :meth:`denoise_step` does the rest.
    """

    supports_request_batch = True
    supports_step_execution = True
    supported_parallel: ClassVar[tuple[str, ...]] = ("ulysses", "ring", "cfg")
    #: the ``diffusers`` pipeline class loaded, and the ``_class_name`` a folder's model_index.json must hold
    diffusers_class: ClassVar[str] = ""
    #: attributes of the diffusers pipeline that hold denoisers, in order; those that are None are skipped
    #: (Wan 2.1 folders have no ``transformer_2``)
    denoiser_names: ClassVar[tuple[str, ...]] = ("transformer",)
    #: true CFG rescales the guided prediction to the cond prediction's norm (Qwen-Image)
    cfg_normalize: ClassVar[bool] = False

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Ulysses splits attention heads: its degree must divide every denoiser's head count, read from the
        folder's ``<denoiser>/config.json`` (``num_attention_heads``) so the engine refuses before starting
        workers; the workers check again against the specs' ``num_heads``."""
        from omni_core.distributed import validate_parallel_config

        for i, name in enumerate(cls.denoiser_names):
            tcfg = folder_config(model_path, name)
            if tcfg or i == 0:
                validate_parallel_config(parallel_config, num_heads=(tcfg or {}).get("num_attention_heads"),
                                         supported=(*cls.supported_parallel, "data"),
                                         model=f"{cls.__name__} ({name})" if len(cls.denoiser_names) > 1
                                         else cls.__name__)

    # ------------------------------------------------------------------ worker process
    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, layers: list) -> None:
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        #: the Omni ``Attention`` layers every attention call of the denoisers goes through
        self.attention_layers = layers
        #: denoiser name -> module, for the names in ``denoiser_names`` that the folder has
        self.experts = {name: getattr(pipe, name) for name in self.denoiser_names
                        if getattr(pipe, name, None) is not None}

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        """Route denoiser ``name``'s attention through Omni ``Attention`` layers; returns the layers. Runs
        inside ``use_config`` so the layers pick the user's attention backends."""
        raise NotImplementedError

    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> DiffusersStepPipeline:
        """The folder through diffusers' own loader: model_index.json must name ``diffusers_class`` and only
        diffusers/transformers components, weights from safetensors only (no pickles, no remote code);
        ``config.model_kwargs`` are passed on to ``from_pretrained``."""
        import diffusers

        check_model_index(model_path, cls.diffusers_class)
        dtype = dtype or torch.float32
        kwargs = dict(getattr(config, "model_kwargs", None) or {})
        pipe = getattr(diffusers, cls.diffusers_class).from_pretrained(
            model_path, **dtype_kwarg(dtype), use_safetensors=True, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        device = torch.device(device)
        pipe.to(device)
        layers: list = []
        with use_config(config) if config is not None else contextlib.nullcontext():
            for name in cls.denoiser_names:
                if getattr(pipe, name, None) is not None:
                    layers += cls.install_attention(getattr(pipe, name), name)
        return cls(pipe, device, dtype, layers)

    # -- helpers for prepare_encode
    def new_scheduler(self) -> Any:
        """A fresh scheduler for one request (schedulers keep per-request state: step index, sigmas)."""
        return type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)

    def start_schedule(self, state: StepState, scheduler: Any, timesteps: Any) -> None:
        """Attach the request's scheduler and timesteps to ``state``, at step 0."""
        scheduler.set_begin_index(0)
        state.scheduler = scheduler
        state.timesteps = timesteps
        state.num_steps = len(timesteps)
        state.step_index = 0

    def seed_generator(self, state: StepState) -> None:
        """The state's generator, from ``sampling_params.seed`` when the runner gave none."""
        if state.generator is None and state.sampling_params.seed is not None:
            state.generator = torch.Generator(self.device).manual_seed(state.sampling_params.seed)

    # -- the denoise loop
    def expert_name(self, state: StepState) -> str:
        """The denoiser this state's current step runs (the first one; Wan 2.2 picks by timestep)."""
        return next(iter(self.experts))

    def cfg_scale(self, state: StepState) -> float:
        """The guidance scale of the state's current step."""
        return state.extra["cfg_scale"]

    def batch_key(self, state: StepState) -> tuple:
        """States with equal keys share one denoiser call per branch (same expert, latent shape, dtype)."""
        return (self.expert_name(state), tuple(state.latents.shape[1:]), state.latents.dtype)

    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """Per batch key: one cond call, and one uncond call for the CFG requests, combined per request."""
        preds: dict[int, torch.Tensor] = {}
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(self.batch_key(s), []).append(i)
        with torch.no_grad():
            for idx in groups.values():
                group = [states[i] for i in idx]
                cond, uncond_of = self._branches(self.expert_name(group[0]), group)
                for i, s, pred in zip(idx, group, cond):
                    if s.extra["do_cfg"]:
                        pred = cfg_combine(pred, uncond_of[id(s)], self.cfg_scale(s), normalize=self.cfg_normalize)
                    preds[i] = pred
        return [preds[i] for i in range(len(states))]

    def _branches(self, expert: str, group: list[StepState]) -> tuple[list, dict]:
        """(cond prediction per state, {id(state): uncond prediction} for the CFG states).

        With a cfg group of two ranks the CFG states' cond and uncond calls run on cfg ranks 0 and 1 at the
        same time and are exchanged (``cfg_parallel_predict``); states without CFG run on both ranks."""
        from omni_core.distributed import cfg_parallel_predict, get_cfg_group

        cfg_states = [s for s in group if s.extra["do_cfg"]]
        if get_cfg_group().world_size == 1 or not cfg_states:
            cond = self.run_branch(expert, group, "cond")
            uncond = self.run_branch(expert, cfg_states, "uncond") if cfg_states else []
            return cond, dict(zip(map(id, cfg_states), uncond))
        rows = [s.latents.shape[0] for s in cfg_states]
        pos, neg = cfg_parallel_predict(lambda: torch.cat(self.run_branch(expert, cfg_states, "cond")),
                                        lambda: torch.cat(self.run_branch(expert, cfg_states, "uncond")))
        cond_of = dict(zip(map(id, cfg_states), pos.split(rows)))
        plain = [s for s in group if not s.extra["do_cfg"]]
        cond_of.update(zip(map(id, plain), self.run_branch(expert, plain, "cond") if plain else []))
        return [cond_of[id(s)] for s in group], dict(zip(map(id, cfg_states), neg.split(rows)))

    def run_branch(self, expert: str, states: list[StepState], branch: str) -> list[torch.Tensor]:
        """One denoiser call over every row of ``states`` for ``branch`` ("cond"/"uncond"); each state's
        prediction. Subclasses build the arguments and call :meth:`call_denoiser`."""
        raise NotImplementedError

    pad_text = staticmethod(pad_text)

    def call_denoiser(self, expert: str, states: list[StepState], branch: str, text_mask: Any = None,
                      **kwargs: Any) -> list[torch.Tensor]:
        """``experts[expert](**kwargs)`` inside the typed denoise-call context (which rows belong to which
        request, the branch, the expert, the text key-padding mask) and the module's per-branch cache
        context; the output split back into one prediction per state."""
        rows = [s.latents.shape[0] for s in states]
        module = self.experts[expert]
        with use_denoise_call([(s, r, branch) for s, r in zip(states, rows)], expert=expert, text_mask=text_mask), \
                module.cache_context(branch):
            out = module(**kwargs, return_dict=False)[0]
        return list(out.split(rows))

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        t = state.timesteps[state.step_index]
        with torch.no_grad():
            state.latents = state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]
        state.step_index += 1

    # -- decoding
    def denormalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, z, F, h, w]`` latents back to the VAE's scale (``latents_mean`` / ``latents_std`` of its
        config), in the VAE's dtype, as diffusers' Wan and Qwen-Image pipelines do before ``vae.decode``."""
        vae = self.pipe.vae
        latents = latents.to(self.device, dtype=vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / std + mean

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The ``[C, h, w]`` latent image a preview shows (first request row)."""
        raise NotImplementedError

    def preview(self, state: StepState) -> torch.Tensor | None:
        """Cheap RGB of the current latents (first three latent channels, min-max scaled; no VAE)."""
        if state.latents is None:
            return None
        return latents_to_rgb(self.preview_latents(state).float())
