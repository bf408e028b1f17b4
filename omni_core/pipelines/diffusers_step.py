"""A base for Omni pipelines built on a diffusers pipeline object, stepped request by request.

Models such as Qwen-Image and Wan keep a real diffusers pipeline for its helpers (``encode_prompt``,
``prepare_latents``, the VAE and image/video processors) and run Omni's own denoise loop: one scheduler per
request, and per step ONE denoiser call per expert for a batch of requests that may be at different steps
and have prompts of different token lengths, with the CFG branches folded into the batch (the cond rows of
every request, then the uncond rows of the guided ones; padded text hidden by a key-padding mask). Everything
in that loop that does not depend on the model lives here once, so a model plugin writes only what is really
its own:

* ``diffusers_class`` and ``install_attention`` (how its attention modules call Omni ``Attention`` layers);
* ``prepare_encode`` (prompt encoding, latents, timesteps: use :meth:`start_schedule`);
* ``run_segments`` (the denoiser's arguments for a batch of (state, branch) segments: use
  :meth:`segment_text_batch` and :meth:`call_denoiser`, which sets the typed
  :class:`~omni_core.forward_context.DenoiseCall`);
* ``post_decode`` (use :meth:`denormalize_latents`), ``preview_latents`` and ``denoisers()`` (the specs).

CFG (plain, or true CFG with norm rescale via ``cfg_normalize``) goes through
:mod:`omni_core.distributed.cfg_parallel`, so cfg parallelism works with no model code. Sequence
parallelism is applied by the core from the specs' ``sp_plan`` after ``load`` (see
:func:`omni_core.attention.parallel.plan.apply_sequence_parallel_to_pipeline`).

Importing this module imports torch (it is the worker side of a model); ``import omni_core`` does not.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, ClassVar

import torch

from omni_core.distributed.cfg_parallel import cfg_combine
from omni_core.forward_context import use_config, use_denoise_call
from omni_core.pipelines.base import OmniPipeline
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines.diffusers_folder import check_model_index, dtype_kwarg, read_json
from omni_core.pipelines.rollout import check_rollout_scheduler, flow_step
from omni_core.pipelines.state import StepState, remember_flow_step
from omni_core.pipelines.text_padding import pad_text
from omni_core.pipelines.text_window import TextEncodingWindow
from omni_core.pipelines.vae_convs import single_frame_causal_convs


def _flow_scheduler(scheduler: Any) -> bool:
    """Whether the model output the scheduler steps with is a flow velocity (``x0 = x - sigma * v``):
    flow-matching schedulers, and multistep ones configured for ``flow_prediction`` (Wan's UniPC)."""
    pred = getattr(getattr(scheduler, "config", None), "prediction_type", None)
    return pred in (None, "flow_prediction") if "FlowMatch" not in type(scheduler).__name__ else True


def fill_defaults(params: Any, **defaults: Any) -> Any:
    """``params`` (``SamplingParams``) with every field that is None set to its default here (as a diffusers
    ``__call__``'s keyword defaults would be)."""
    changes = {name: value for name, value in defaults.items() if getattr(params, name) is None}
    return params.replace(**changes) if changes else params


@functools.lru_cache(maxsize=None)
def _step_takes_generator(scheduler_cls: type) -> bool:
    return "generator" in inspect.signature(scheduler_cls.step).parameters


def folder_config(model_path: str | None, component: str) -> dict | None:
    """``<model_path>/<component>/config.json`` as a dict; None without a folder or file."""
    return read_json(os.path.join(model_path, component, "config.json")) if model_path else None


class DiffusersStepPipeline(TextEncodingWindow, OmniPipeline):
    """Step-wise Omni pipeline around a diffusers pipeline object (see the module docstring).

    A subclass's ``prepare_encode`` sets ``state.extra["do_cfg"]`` (whether the request runs the uncond
    branch) and ``state.extra["cfg_scale"]``; :meth:`denoise_step` does the rest.
    """

    supports_request_batch = True
    supports_step_execution = True
    supported_parallel: ClassVar[tuple[str, ...]] = ("ulysses", "ring", "cfg")
    #: every step goes through the core's flow step (``omni_core.pipelines.rollout``), for flow-matching folders
    supports_rollout: ClassVar[bool] = True
    #: the ``diffusers`` pipeline class loaded, and the ``_class_name`` a folder's model_index.json must hold
    diffusers_class: ClassVar[str] = ""
    #: attributes of the diffusers pipeline that hold denoisers, in order; those that are None are skipped
    #: (Wan 2.1 folders have no ``transformer_2``)
    denoiser_names: ClassVar[tuple[str, ...]] = ("transformer",)
    #: true CFG rescales the guided prediction to the cond prediction's norm (Qwen-Image)
    cfg_normalize: ClassVar[bool] = False
    #: decode single latent frames with 2-D convolutions (:func:`single_frame_causal_convs`)
    fast_vae_convs: ClassVar[bool] = True
    #: a request's cond and uncond rows may always share one denoiser call: the transformer masks (or pads) each
    #: row's text itself, so folding the branches changes nothing even where one's text is padded to the other's
    #: (Z-Image pads inside, diffusers' HunyuanVideo 1.5 always passes its masks). False: a lone request whose two
    #: branches would need a mask only when folded runs them as two calls, as diffusers does
    cfg_folds_with_masks: ClassVar[bool] = False

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_rollout(cls, params: Any, model_path: str | None) -> None:
        """A rollout follows the folder's scheduler's sigmas: refused unless it is a flow-matching one."""
        if model_path is not None:
            scheduler = read_json(os.path.join(model_path, "scheduler", "scheduler_config.json")) or {}
            check_rollout_scheduler(scheduler.get("_class_name"), f"{cls.__name__} ({model_path})")

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
        if getattr(pipe, "vae", None) is not None and self.fast_vae_convs:
            single_frame_causal_convs(pipe.vae)

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
        from omni_core.distributed.sharded_load import meta_component, read_later

        later = read_later(model_path, cls.denoiser_names, kwargs)  # tensor parallel: shards read by the plan
        pipe = getattr(diffusers, cls.diffusers_class).from_pretrained(
            model_path, **dtype_kwarg(dtype), use_safetensors=True, **{n: None for n in later}, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        device = torch.device(device)
        pipe.to(device)
        for name in later:
            setattr(pipe, name, meta_component(model_path, name, dtype))
        layers: list = []
        with use_config(config) if config is not None else contextlib.nullcontext():
            for name in cls.denoiser_names:  # not into a config-only stand-in (the split decode's process)
                if getattr(pipe, name, None) is not None and not getattr(getattr(pipe, name), "omni_config_only", 0):
                    layers += cls.install_attention(getattr(pipe, name), name)
        return cls(pipe, device, dtype, layers)

    @classmethod
    def stage_components_for(cls, model_path: str | None) -> dict[str, tuple[str, ...]]:
        """``{stage: components}`` for loading the decode (and encode) apart (``omni_core.worker.stages``): the
        class's ``stage_components`` if it declares them, else from the folder's model_index.json: the ``vae*``
        components decode, the ``text_encoder*`` / ``tokenizer*`` ones encode; a pipeline that takes input
        images keeps its VAE on the denoise side too (``"denoise"``: it encodes the images)."""
        declared = getattr(cls, "stage_components", None)
        if declared is not None:
            return dict(declared)
        from omni_core.pipelines.stages import folder_stage_components

        return folder_stage_components(model_path, takes_images=getattr(cls, "image_input", None) is not None)

    @classmethod
    def stage_load_kwargs(cls, model_path: str, stage: str, dtype: Any, apart: tuple = ("decode",)) -> dict:
        """``from_pretrained`` keywords that load one side of the split: ``"denoise"`` without the weights of the
        stages ``apart``, ``"encode"`` / ``"decode"`` with nothing else (``omni_core.worker.stages``)."""
        from omni_core.pipelines.stages import diffusers_stage_kwargs

        return diffusers_stage_kwargs(model_path, stage, cls.stage_components_for(model_path), dtype or torch.float32,
                                      apart)

    def text_cache_scope(self) -> Any:
        """As :meth:`TextEncodingWindow.text_cache_scope`, the folder falling back to diffusers' ``name_or_path``."""
        scope = super().text_cache_scope()
        if scope is not None and scope[1] is None:
            scope = (scope[0], getattr(self.pipe, "name_or_path", None), scope[2])
        return scope

    def post_decode(self, state: StepState) -> DiffusionOutput:
        return self.post_decode_batch([state])[0]

    def post_decode_batch(self, states: list[StepState]) -> list[DiffusionOutput]:
        """One VAE decode per latent shape for the whole wave (:meth:`decode_latents`); each request's
        outputs split back out. ``latent`` output skips the decode."""
        outs = [DiffusionOutput(request_id=s.request_id, finished=True, step_index=s.step_index,
                                num_steps=s.num_steps) for s in states]
        for idx in self.decode_groups(states):
            group = [states[i] for i in idx]
            if group[0].sampling_params.output_type == "latent":
                outs[idx[0]].tensor = group[0].latents
                continue
            latents = group[0].latents if len(group) == 1 else torch.cat([s.latents for s in group])
            with torch.no_grad():
                decoded = self.decode_latents(latents, group[0])
            for i, part in zip(idx, decoded.split([s.latents.shape[0] for s in group])):
                outs[i].tensor = part
        return outs

    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        """The VAE decode of stacked final latents of one shape (``state``: the first of them, for its size)
        -> float outputs in [0, 1], one row per latent row."""
        raise NotImplementedError

    def decode_groups(self, states: list[StepState]) -> list[list[int]]:
        """Indices of ``states`` that one VAE decode can take together (same latent shape, not ``latent``
        output), in order; each state that is decoded alone (``latent`` output) is a group of its own."""
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            key = (("latent", i) if s.sampling_params.output_type == "latent"
                   else (tuple(s.latents.shape[1:]), s.latents.dtype, tuple(sorted(
                       (k, v) for k, v in s.extra.items() if k in ("height", "width")))))
            groups.setdefault(key, []).append(i)
        return list(groups.values())

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
        """States with equal keys share one denoiser call (same expert, latent shape, dtype)."""
        return (self.expert_name(state), tuple(state.latents.shape[1:]), state.latents.dtype)

    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """Per batch key (normally one per expert): ONE denoiser call whose rows are the cond rows of every
        state followed by the uncond rows of the guided states, then the guidance combined for all guided
        rows at once (:func:`cfg_combine` with a per-row scale)."""
        preds: list[torch.Tensor | None] = [None] * len(states)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(self.batch_key(s), []).append(i)
        with torch.no_grad():
            for idx in groups.values():
                group = [states[i] for i in idx]
                for i, pred in zip(idx, self._denoise_group(self.expert_name(group[0]), group)):
                    preds[i] = pred
        return preds

    def _denoise_group(self, expert: str, group: list[StepState]) -> list[torch.Tensor]:
        """The guided prediction of every state of one batch key.

        Normally one call holds every state's cond rows and the guided states' uncond rows. With a cfg group
        of two ranks the guided states' cond and uncond rows run on cfg ranks 0 and 1 at the same time and
        are exchanged (``cfg_parallel_predict``); states without CFG run on both ranks. A request alone whose
        two branches have prompts of different lengths runs them as two unmasked calls, as diffusers does, so
        it computes exactly what diffusers computes (folding them would need a padding mask)."""
        from omni_core.distributed import cfg_parallel_predict, get_cfg_group

        guided = [s for s in group if s.extra["do_cfg"]]
        if get_cfg_group().world_size == 1 or not guided:
            segments = [(s, "cond") for s in group] + [(s, "uncond") for s in guided]
            if len(group) == 1 and guided and not self.cfg_folds_with_masks and self._mask_only_when_folded(segments):
                out = self.run_segments(expert, segments[:1]) + self.run_segments(expert, segments[1:])
            else:
                out = self.run_segments(expert, segments)
            cond, uncond = out[:len(group)], out[len(group):]
        else:
            rows = [s.latents.shape[0] for s in guided]
            pos, neg = cfg_parallel_predict(
                lambda: torch.cat(self.run_segments(expert, [(s, "cond") for s in guided])),
                lambda: torch.cat(self.run_segments(expert, [(s, "uncond") for s in guided])))
            cond_of = dict(zip(map(id, guided), pos.split(rows)))
            plain = [s for s in group if not s.extra["do_cfg"]]
            if plain:
                cond_of.update(zip(map(id, plain), self.run_segments(expert, [(s, "cond") for s in plain])))
            cond, uncond = [cond_of[id(s)] for s in group], list(neg.split(rows))
        if not guided:
            return cond
        guided_ids = {id(s) for s in guided}
        pos = [c for s, c in zip(group, cond) if id(s) in guided_ids]
        rows = [p.shape[0] for p in pos]
        pos_t, neg_t = (pos[0], uncond[0]) if len(pos) == 1 else (torch.cat(pos), torch.cat(uncond))
        scales = [float(self.cfg_scale(s)) for s in guided]
        if len(set(scales)) == 1:
            scale: Any = scales[0]
        else:  # one scale per row, broadcast over the prediction's other dims
            scale = torch.tensor([g for g, r in zip(scales, rows) for _ in range(r)], dtype=pos_t.dtype,
                                 device=pos_t.device).view(-1, *([1] * (pos_t.dim() - 1)))
        guided_pred = cfg_combine(pos_t, neg_t, scale, normalize=self.cfg_normalize)
        combined = iter(guided_pred.split(rows) if len(pos) > 1 else [guided_pred])
        return [next(combined) if id(s) in guided_ids else c for s, c in zip(group, cond)]

    def _mask_only_when_folded(self, segments: list[tuple[StepState, str]]) -> bool:
        """Whether one call over ``segments`` needs a text padding mask that each segment alone does not."""
        texts = [self.segment_text(s, b) for s, b in segments]
        rows = [s.latents.shape[0] for s, _ in segments]
        if self.pad_text([e for e, _ in texts], [m for _, m in texts], rows)[1] is None:
            return False
        return all(self.pad_text([e], [m], [r])[1] is None for (e, m), r in zip(texts, rows))

    def segment_text(self, state: StepState, branch: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``[1, L, D]`` prompt embedding and ``[1, L]`` mask (or None: all valid) of ``state`` for
        ``branch`` ("cond": the prompt; "uncond": the negative prompt)."""
        if branch == "uncond":
            return state.negative_prompt_embeds, state.negative_prompt_mask
        return state.prompt_embeds, state.prompt_mask

    def segment_text_batch(self, segments: list[tuple[StepState, str]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The padded text of one call over ``segments`` and its key-padding mask (None: nothing masked)."""
        texts = [self.segment_text(s, b) for s, b in segments]
        return self.pad_text([e for e, _ in texts], [m for _, m in texts], [s.latents.shape[0] for s, _ in segments])

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One denoiser call over ``segments`` ((state, branch) pairs, in row order: each state's latents with
        that branch's prompt); one prediction per segment. Subclasses build the arguments (text from
        :meth:`segment_text_batch`) and call :meth:`call_denoiser`."""
        raise NotImplementedError

    pad_text = staticmethod(pad_text)

    def call_denoiser(self, expert: str, segments: list[tuple[StepState, str]], text_mask: Any = None,
                      **kwargs: Any) -> list[torch.Tensor]:
        """``experts[expert](**kwargs)`` inside the typed denoise-call context (which rows belong to which
        request and branch, the expert, the text key-padding mask) and the module's cache context (the branch
        name when the call holds one branch, else ``"cond+uncond"``); the output split back into one
        prediction per segment."""
        rows = [s.latents.shape[0] for s, _ in segments]
        module = self.experts[expert]
        branches = {b for _, b in segments}
        context = branches.pop() if len(branches) == 1 else "cond+uncond"
        # diffusers' CacheMixin names the branch for its own caches; a transformer without the mixin has none
        cache_context = getattr(module, "cache_context", None)
        with use_denoise_call([(s, r, b) for (s, b), r in zip(segments, rows)], expert=expert, text_mask=text_mask), \
                (cache_context(context) if cache_context is not None else contextlib.nullcontext()):
            out = module(**kwargs, return_dict=False)[0]
        return list(out.split(rows)) if len(rows) > 1 else [out]

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        sigmas = getattr(state.scheduler, "sigmas", None)
        if sigmas is not None and _flow_scheduler(state.scheduler):  # a preview's clean estimate (no work here)
            remember_flow_step(state, state.latents, sigmas[state.step_index], noise_pred)
        # a scheduler that draws noise (DPM-Solver's SDE variants, stochastic flow sampling) draws it from the
        # request's own generator, as diffusers' pipelines pass it (``prepare_extra_step_kwargs``)
        extra = {"generator": state.generator} if _step_takes_generator(type(state.scheduler)) else {}
        with torch.no_grad():  # a request asking for a rollout takes the SDE step (omni_core.pipelines.rollout)
            state.latents = flow_step(state, noise_pred, state.latents, **extra)
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
        """The latent image a preview shows (first request row), unpacked to the VAE's grid in the transformer's
        (normalized) space: ``[C, h, w]``, or ``[C, F, h, w]`` for a video. It reads ``state.latents`` only;
        the preview passes a state whose latents are the clean estimate."""
        raise NotImplementedError

    def preview(self, state: StepState) -> torch.Tensor | None:
        """RGB ``[3, h, w]`` in [0, 1] of the step's clean estimate, through the model's latent-to-RGB projection
        or the user's tiny decoder (a video: four frames tiled 2x2); no VAE decode. See
        :mod:`omni_core.pipelines.preview`."""
        from omni_core.pipelines.preview import render_preview

        return render_preview(self, state)

    def preview_vae_config(self) -> dict:
        """The VAE's config (with ``_class_name``) that shipped preview projections are matched against."""
        from omni_core.pipelines.preview import vae_config_of

        return vae_config_of(getattr(self.pipe, "vae", None))
