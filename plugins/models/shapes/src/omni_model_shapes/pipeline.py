"""``ShapesPipeline``: text -> 32x32 RGB picture of a coloured shape, step-wise and request-batched.

Per request, ``prepare_encode`` draws the initial noise from the request's own generator (so an image does
not depend on what else is in the batch), builds the request's own ``FlowMatchEulerDiscreteScheduler`` and
encodes the prompt and the negative prompt. ``denoise_step`` evaluates the transformer once for every
state it is given -- each at its own timestep, both CFG branches included.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from typing import Any, ClassVar, Iterator

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.outputs import DiffusionOutput
from omni_core.pipelines import OmniPipeline, StepState
from omni_core.pipelines.base import read_model_index
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_folder import read_json, refuse_pickled_weights
from omni_core.pipelines.embedding_cache import carried_encodings, text_encoders_have_adapters
from omni_core.pipelines.rollout import flow_step
from omni_core.pipelines.state import flow_clean_estimate, remember_flow_step
from omni_core.request import OmniDiffusionRequest
from omni_model_shapes.models import ShapesTextEncoder, ShapesTransformer2DModel, velocity
from omni_model_shapes.tokenizer import ShapesTokenizer

logger = logging.getLogger(__name__)

#: ``OmniDiffusionConfig.model_kwargs`` this pipeline understands: none (torch threads are the engine's
#: ``cpu_threads``, set once per model process)
MODEL_KWARGS: dict[str, str] = {}

#: ``SamplingParams.extra_args`` this pipeline understands
EXTRA_ARGS = {"upscale": "integer 1..32: nearest-neighbour upscaling of PIL outputs for display (default 8)"}
DEFAULT_UPSCALE = 8

#: sequence parallelism: shard the image tokens after the patch embedding, gather them after the output
#: projection (the text context stays whole on every rank; cross-attention needs no exchange)
SP_PLAN = {"shard_after": {"x_embed": 1}, "gather_after": {"proj_out": 1}, "gather": None}

#: TeaCache: fitted on the shipped weights with ``omni cache calibrate --model shapes --prompts 48 --steps 50``
#: (guidance 3.0; 4704 step pairs, R^2 0.34); refit when the model is retrained
TEA_CACHE_COEFFICIENTS: tuple[float, ...] = (2.74887208e+04, -3.81222300e+03, 2.08794877e+02, -5.95705452e+00,
                                             8.32354849e-02)
#: tuned on 120 prompts at 50 steps: ~4x fewer evaluations, PSNR ~35 dB, evaluator accuracy unchanged
TEA_CACHE_THRESH = 0.03
TEA_CACHE_WARMUP = 1


#: the text encodings of the window :meth:`ShapesPipeline.encoded_prompts` is in, by ``(text, max_length)``; a
#: context variable, not an attribute, because CPU lanes run windows of one pipeline side by side (each lane runs in
#: a copy of the caller's context)
_TEXT_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shapes_text_memo", default=None)


def _modulated_input(transformer: ShapesTransformer2DModel, block: Any, args: dict) -> torch.Tensor:
    """Block 0's adaLN-modulated input (what TeaCache compares between steps)."""
    return transformer.modulated_input(0, args["hidden"], args["temb"])


class ShapesPipeline(OmniPipeline):
    supports_request_batch = True
    supports_step_execution = True
    supports_rollout = True  # its own FlowMatchEulerDiscreteScheduler, every step through the core's flow step
    concurrent_calls_safe = True  # denoise_step keeps no state on the pipeline or its modules
    supported_parallel = ("ulysses", "ring", "cfg")
    size_multiple = 4
    default_height = 32
    default_width = 32
    default_num_inference_steps = 20
    default_guidance_scale = 3.0
    #: previews: the clean estimate's pixels mapped from [-1, 1] to [0, 1] (an exact projection, any shapes folder)
    preview_projections = "omni_model_shapes:preview_projections.json"
    #: trained at 32x32 only, so a larger size shows nothing new; 64x64 (4x the area) keeps the largest request
    #: (64x64, n=4) near 0.3 s per step on 2 CPU cores, where 512x512 took 25 s
    default_limits: ClassVar[dict] = {"max_pixels": 64 * 64, "max_steps": 200, "max_outputs": 4}

    text_encoder: ShapesTextEncoder
    transformer: ShapesTransformer2DModel
    component_names: ClassVar[tuple[str, ...]] = ("transformer", "text_encoder", "tokenizer", "scheduler")
    #: what each stage needs (omni_core.worker.stages): its decode is arithmetic on the latents, no component
    stage_components: ClassVar[dict] = {"decode": (), "encode": ("text_encoder", "tokenizer")}

    def __init__(self, transformer: ShapesTransformer2DModel, text_encoder: ShapesTextEncoder,
                 tokenizer: ShapesTokenizer, scheduler: FlowMatchEulerDiscreteScheduler,
                 device: Any = "cpu", dtype: Any = torch.float32) -> None:
        for model in (transformer, text_encoder):
            model.to(device)
            if model.dtype != dtype:
                model.to(dtype)
            model.eval()
        self.transformer = transformer
        self.transformer.batch_invariant = True
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.device = torch.device(device)
        self.dtype = dtype

    # ------------------------------------------------------------------ engine process
    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        params = super().check_sampling_params(params, model_path)
        unknown = sorted(set(params.extra_args) - set(EXTRA_ARGS))
        if unknown:
            raise ConfigError(f"extra_args {unknown} are not understood by {cls.__name__}; allowed: "
                              + "; ".join(f"{k} ({v})" for k, v in EXTRA_ARGS.items()), field="extra_args")
        up = params.extra_args.get("upscale", DEFAULT_UPSCALE)
        if isinstance(up, bool) or not isinstance(up, int) or not 1 <= up <= 32:
            raise ConfigError(f"extra_args.upscale={up!r} is not allowed: an integer from 1 to 32",
                              field="extra_args.upscale")
        return params

    @classmethod
    def post_process(cls, output: DiffusionOutput, request: OmniDiffusionRequest) -> DiffusionOutput:
        """As the base class; PIL images are also upscaled (nearest) so a 32x32 picture is viewable."""
        output = super().post_process(output, request)
        up = request.sampling_params.extra_args.get("upscale", DEFAULT_UPSCALE)
        if output.finished and output.images and request.sampling_params.output_type == "pil" and up > 1:
            from PIL import Image

            output.images = [im.resize((im.width * up, im.height * up), Image.NEAREST) for im in output.images]
        return output

    @classmethod
    def check_parallel_config(cls, parallel_config: Any, model_path: str | None = None) -> None:
        """Refuse, before any worker starts, a Ulysses or tensor-parallel degree that does not divide the
        transformer's head count (read from the folder); the strategies it supports are its record's."""
        from omni_core.distributed import validate_parallel_config

        config = read_json(os.path.join(model_path, "transformer", "config.json")) if model_path else None
        heads = (config or {}).get("num_heads")
        validate_parallel_config(parallel_config, num_heads=heads, model=cls.__name__)

    # ------------------------------------------------------------------ worker process
    @classmethod
    def load(cls, model_path: str, config: Any = None, device: Any = "cpu", dtype: Any = None) -> ShapesPipeline:
        index = read_model_index(model_path)
        if index is None or index.get("_class_name") != "ShapesPipeline":
            raise ConfigError(f"{model_path!r} is not a ShapesPipeline folder (model_index.json with "
                              f"_class_name 'ShapesPipeline' expected)", field="model")
        missing = [c for c in cls.component_names if not os.path.isdir(os.path.join(model_path, c))]
        if missing:
            raise ConfigError(f"model folder {model_path!r} lacks the component folder(s) {missing}", field="model")
        refuse_pickled_weights(model_path, cls.component_names)
        dtype = dtype or torch.float32
        kwargs = dict(getattr(config, "model_kwargs", None) or {})
        unknown = sorted(set(kwargs) - set(MODEL_KWARGS))
        if unknown:
            hint = " (torch threads: the engine option cpu_threads / --cpu-threads)" if "cpu_threads" in unknown else ""
            raise ConfigError(f"model_kwargs {unknown} are not understood by {cls.__name__}; it takes none"
                              + hint, field="model_kwargs")
        pipeline = cls(
            transformer=ShapesTransformer2DModel.from_pretrained(os.path.join(model_path, "transformer"),
                                                                 torch_dtype=dtype, use_safetensors=True),
            text_encoder=ShapesTextEncoder.from_pretrained(os.path.join(model_path, "text_encoder"),
                                                           torch_dtype=dtype, use_safetensors=True),
            tokenizer=ShapesTokenizer.from_pretrained(os.path.join(model_path, "tokenizer")),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(model_path, "scheduler")),
            device=device, dtype=dtype)
        return pipeline

    def denoisers(self) -> list[DenoiserSpec]:
        """The transformer as caches and sequence parallelism see it (the core installs ``sp_plan``)."""
        return [DenoiserSpec(
            name="transformer", module=self.transformer, blocks_attr="blocks",
            block_params=("hidden", "temb", "context", "context_mask"), carried=("hidden",),
            block_outputs=("hidden",), residual_stream="hidden", side_inputs=("temb", "context", "context_mask"),
            batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_mask"),
            modulated_input=_modulated_input, num_heads=self.transformer.config.num_heads, sp_plan=SP_PLAN,
            cache_defaults={"tea_cache": {"coefficients": TEA_CACHE_COEFFICIENTS, "rel_l1_thresh": TEA_CACHE_THRESH,
                                          "warmup_steps": TEA_CACHE_WARMUP}})]

    @classmethod
    def example_prompts(cls) -> list[str]:
        """Prompts in the model's closed vocabulary (shape, colour, place)."""
        return ["a red circle in the top left", "a blue square in the center", "a green triangle in the bottom right",
                "a yellow cross in the top right", "a large purple circle in the bottom left",
                "a small orange square in the center", "a blue cross in the bottom left",
                "a green circle in the top right"]

    def encode_prompt(self, prompt: str, max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``([1, L, D] states, [1, L] bool mask)``; unknown words become ``<unk>`` (and are logged). Inside
        :meth:`encoded_prompts` the encoding comes from that window's batched call."""
        memo = _TEXT_MEMO.get()
        if memo is not None and (prompt, max_length) in memo:
            return memo[(prompt, max_length)]
        return self._encode_texts([prompt], max_length)[0]

    @torch.no_grad()
    def _encode_texts(self, texts: list[str], max_length: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One text-encoder call over ``texts`` -> ``(states [1, L, D], mask [1, L])`` per text."""
        for text in texts:
            unknown = self.tokenizer.unknown_words(text)
            if unknown:
                logger.info("shapes: words outside the model's vocabulary are ignored: %s", ", ".join(unknown))
        ids, mask = self.tokenizer(texts)  # always padded to the tokenizer's max_length
        if max_length is not None and max_length < ids.shape[1]:
            ids[:, max_length:] = self.tokenizer.pad_id
            mask[:, max_length:] = False
        ids, mask = ids.to(self.device), mask.to(self.device)
        states = self.text_encoder(ids, mask)
        return [(states[i:i + 1], mask[i:i + 1]) for i in range(len(texts))]

    def _guidance_scale(self, sp: SamplingParams) -> float:
        return self.default_guidance_scale if sp.guidance_scale is None else sp.guidance_scale

    def _texts_of(self, state: StepState) -> list[tuple[str, int | None]]:
        """The ``(text, max_length)`` pairs :meth:`prepare_encode` encodes for ``state``."""
        sp = state.sampling_params
        scale = self._guidance_scale(sp)
        texts = [(state.request.prompt, sp.max_sequence_length)]
        if scale > 1.0:
            texts.append((state.request.negative_prompt or "", sp.max_sequence_length))
        return texts

    @contextlib.contextmanager
    def encoded_prompts(self, states: list[StepState]) -> Iterator[dict]:
        """Every distinct text of ``states`` (prompts and negative prompts) in one text-encoder call per
        ``max_sequence_length``, which :meth:`encode_prompt` then reads. Why: a 2-layer encoder over 16 tokens
        is all per-op cost, so 8 texts batched cost ~2x one text (not 8x), and a request's two encodings were
        ~2% of its time in a batch of 8. The text encoder is batch-invariant here as the transformer is (every
        op is per row or per token; the GEMMs have >= 16 rows): a text's states in the batch are the bits it
        gets alone (``tests/test_pipeline.py``).

        With the process's embedding cache (``embedding_cache``) every text, a lone request's too, is read from
        it; the misses are encoded in one call per ``max_sequence_length`` (batch-invariant, so the cache holds
        the bits of each text alone) and kept. Requests the encode stage encoded (``encode_workers``) carry
        their encodings (``request.text_encodings``): read as they are, no text encoder runs here."""
        carried = carried_encodings(states, self.device)
        if carried is not None:
            token = _TEXT_MEMO.set(carried)
            try:
                yield carried
            finally:
                _TEXT_MEMO.reset(token)
            return
        groups: dict[int | None, list[str]] = {}
        for state in states:
            for text, max_length in self._texts_of(state):
                if text not in groups.setdefault(max_length, []):
                    groups[max_length].append(text)
        memo: dict = {}
        cache = self.embedding_cache
        if cache is not None and not text_encoders_have_adapters([self.text_encoder]):
            scope = (type(self).__name__, getattr(self, "omni_model_path", None), "text_encoder")

            def encode(missing: list) -> dict:
                out: dict = {}
                for max_length in dict.fromkeys(m for _, (_, m) in missing):
                    texts = [t for _, (t, m) in missing if m == max_length]
                    out.update(((scope, (t, max_length)), enc)
                               for t, enc in zip(texts, self._encode_texts(texts, max_length)))
                return out

            keys = [(scope, (t, m)) for m, texts in groups.items() for t in texts]
            memo.update((key, enc) for (_, key), enc in cache.get_or_encode(keys, encode).items())
        else:
            for max_length, texts in groups.items():
                if len(texts) > 1:
                    memo.update(((t, max_length), enc)
                                for t, enc in zip(texts, self._encode_texts(texts, max_length)))
        token = _TEXT_MEMO.set(memo)
        try:
            yield memo
        finally:
            _TEXT_MEMO.reset(token)

    def prepare_encode(self, state: StepState) -> StepState:
        sp = state.sampling_params
        height = sp.height or self.default_height
        width = sp.width or self.default_width
        steps = sp.num_inference_steps or self.default_num_inference_steps
        scale = self._guidance_scale(sp)
        if height % self.size_multiple or width % self.size_multiple:
            raise ConfigError(f"height and width must be multiples of {self.size_multiple}, got {height}x{width}",
                              field="height" if height % self.size_multiple else "width")
        if state.generator is None:
            state.generator = torch.Generator("cpu")
            if sp.seed is not None:
                state.generator.manual_seed(sp.seed)
            else:
                state.generator.seed()
        gen_device = state.generator.device
        noise = torch.randn((sp.num_outputs_per_prompt, 3, height, width), generator=state.generator,
                            device=gen_device, dtype=torch.float32)
        state.latents = noise.to(self.device, self.dtype)
        state.scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        state.scheduler.set_timesteps(steps, device=self.device)
        state.timesteps = state.scheduler.timesteps
        state.num_steps = len(state.timesteps)
        state.step_index = 0
        state.prompt_embeds, state.prompt_mask = self.encode_prompt(state.request.prompt, sp.max_sequence_length)
        state.extra["guidance_scale"] = float(scale)
        if scale > 1.0:
            state.negative_prompt_embeds, state.negative_prompt_mask = self.encode_prompt(
                state.request.negative_prompt or "", sp.max_sequence_length)
        return state

    @torch.no_grad()
    def denoise_step(self, states: list[StepState]) -> list[torch.Tensor]:
        """One transformer call per image size (normally one) for all states and both CFG branches."""
        preds: list[torch.Tensor | None] = [None] * len(states)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(tuple(s.latents.shape[1:]), []).append(i)
        for idx in groups.values():
            for i, pred in zip(idx, self._denoise_group([states[i] for i in idx])):
                preds[i] = pred
        return preds

    def _denoise_group(self, states: list[StepState]) -> list[torch.Tensor]:
        """Guided velocity per state. Normally one transformer call holds every state's cond rows and the
        uncond rows of the states with guidance; with a cfg group of two ranks, the guided states' cond and
        uncond calls run on the two ranks at once (``cfg_parallel_predict``)."""
        from omni_core.distributed import cfg_parallel_predict, get_cfg_group

        guided = [s for s in states if self._cfg(s)]
        if get_cfg_group().world_size == 1 or not guided:
            out = self._run([(s, "cond") for s in states] + [(s, "uncond") for s in guided])
            cond, uncond = out[: len(states)], dict(zip(map(id, guided), out[len(states):]))
        else:
            rows = [s.latents.shape[0] for s in guided]
            pos, neg = cfg_parallel_predict(lambda: torch.cat(self._run([(s, "cond") for s in guided])),
                                            lambda: torch.cat(self._run([(s, "uncond") for s in guided])))
            by_id = dict(zip(map(id, guided), pos.split(rows)))
            plain = [s for s in states if not self._cfg(s)]
            by_id.update(zip(map(id, plain), self._run([(s, "cond") for s in plain]) if plain else []))
            cond, uncond = [by_id[id(s)] for s in states], dict(zip(map(id, guided), neg.split(rows)))
        preds = []
        for s, vc in zip(states, cond):
            if id(s) in uncond:
                vu = uncond[id(s)]
                vc = vu + s.extra["guidance_scale"] * (vc - vu)
            preds.append(vc)
        return preds

    def _run(self, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call over (state, branch) segments -> the velocity of each segment. The typed call
        context tells cache backends which rows belong to which request and branch."""
        from omni_core.forward_context import use_denoise_call

        xs, ts, sigmas, embs, masks, rows = [], [], [], [], [], []
        for s, branch in segments:
            n = s.latents.shape[0]
            xs.append(s.latents)
            ts.append(s.timesteps[s.step_index].reshape(1).expand(n))
            sigmas.append(s.scheduler.sigmas[s.step_index].reshape(1).expand(n))
            emb, mask = ((s.prompt_embeds, s.prompt_mask) if branch == "cond"
                         else (s.negative_prompt_embeds, s.negative_prompt_mask))
            embs.append(emb.expand(n, -1, -1))
            masks.append(mask.expand(n, -1))
            rows.append(n)
        x, t, sigma = torch.cat(xs), torch.cat(ts).to(self.dtype), torch.cat(sigmas).to(self.device)
        mask = torch.cat(masks)
        with use_denoise_call([(s, n, b) for (s, b), n in zip(segments, rows)], expert="transformer", text_mask=mask):
            out = self.transformer(x, t, torch.cat(embs), mask)
        return list(velocity(out.float(), x.float(), sigma.float(), self.transformer.config.prediction_type)
                    .split(rows))

    @staticmethod
    def _cfg(state: StepState) -> bool:
        return state.extra["guidance_scale"] > 1.0

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        # the step's inputs, for a preview's clean estimate (computed only if someone streams previews)
        remember_flow_step(state, state.latents, state.scheduler.sigmas[state.step_index], noise_pred)
        # the core's flow step: the scheduler's, or a rollout's SDE step with its log-probability
        state.latents = flow_step(state, noise_pred, state.latents.float()).to(self.dtype)
        state.step_index += 1

    def post_decode(self, state: StepState) -> DiffusionOutput:
        images = ((state.latents.float() + 1) / 2).clamp(0, 1).cpu()
        return DiffusionOutput(request_id=state.request_id, tensor=images, finished=True,
                               step_index=state.step_index, num_steps=state.num_steps)

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The first image's ``[3, H, W]`` pixels in [-1, 1] (the model draws in pixel space)."""
        return state.latents[0]

    def preview(self, state: StepState) -> torch.Tensor | None:
        """The first image's current clean estimate (exact at the last step; no extra model call), through the
        projection the plugin ships (``preview_projections.json``: ``(x + 1) / 2``, exact)."""
        if flow_clean_estimate(state) is None:
            return None
        from omni_core.pipelines.preview import render_preview

        return render_preview(self, state)
