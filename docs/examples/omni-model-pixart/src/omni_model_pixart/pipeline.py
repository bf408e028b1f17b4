"""``PixArtSigmaPipeline``: diffusers' PixArt-Sigma, native and step-wise in Omni.

Built on :class:`omni_core.pipelines.diffusers_step.DiffusersStepPipeline`, which loads the folder with diffusers'
own ``PixArtSigmaPipeline`` (kept as ``self.pipe`` for its helpers: ``encode_prompt``, ``prepare_latents``, the
VAE and image processor) and runs Omni's loop: one DPM-Solver per request, one transformer call per step for a
batch of requests at different steps with the CFG branches folded in, the batched decode, previews. What is
PixArt's own is here: the T5 encoding with its attention mask, the transformer's arguments, the learned-sigma
channels, the ``scaling_factor`` VAE, and the ``DenoiserSpec`` (``denoisers()``).

What it computes is diffusers' ``PixArtSigmaPipeline.__call__`` with ``use_resolution_binning=False`` (Omni makes
the size asked for) and ``clean_caption=False`` (diffusers too, unless ``bs4`` and ``ftfy`` are installed).
"""

from __future__ import annotations

from typing import Any

import torch

from omni_core.config import SamplingParams
from omni_core.distributed.parallel_decode import vae_decode
from omni_core.pipelines import StepState
from omni_core.pipelines.denoiser import DenoiserSpec
from omni_core.pipelines.diffusers_step import DiffusersStepPipeline, fill_defaults
from omni_model_pixart.rules import default_size, size_rules

#: diffusers' ``__call__`` defaults
MAX_SEQUENCE_LENGTH, STEPS, GUIDANCE = 300, 20, 4.5
#: the block signature of diffusers' ``BasicTransformerBlock.forward`` (the prefix PixArt's forward passes)
BLOCK_PARAMS = ("hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "timestep")
#: sequence parallelism: the image tokens are sharded where ``pos_embed`` makes them (positions added inside),
#: and gathered after ``proj_out``; the text (cross-attention keys) stays whole on every rank
SP_PLAN = {"shard_outputs": {"pos_embed": 1}, "gather_after": {"proj_out": 1}, "gather_output": None}


def modulated_input(module: Any, block: Any, a: dict) -> torch.Tensor:
    """TeaCache's signal: block 0's self-attention input, ``norm1(x) * (1 + scale_msa) + shift_msa`` with the
    adaLN-single modulation, as ``BasicTransformerBlock`` computes it."""
    x = a["hidden_states"]
    shift, scale = (block.scale_shift_table[None] + a["timestep"].reshape(x.shape[0], 6, -1)).chunk(6, dim=1)[:2]
    return block.norm1(x) * (1 + scale) + shift


class PixArtSigmaPipeline(DiffusersStepPipeline):
    diffusers_class = "PixArtSigmaPipeline"
    fast_vae_convs = False  # AutoencoderKL: 2-D convolutions already
    size_multiple = 16  # without a folder (the record's value); a folder's own come from size_multiples
    default_height = default_width = 1024
    default_num_inference_steps = STEPS
    default_guidance_scale = GUIDANCE

    # ------------------------------------------------------------------ engine process
    @classmethod
    def size_multiples(cls, model_path: str | None = None) -> tuple[int, int, int]:
        return size_rules(model_path)

    @classmethod
    def default_size(cls, model_path: str | None = None) -> tuple[int, int]:
        return default_size(model_path)

    @classmethod
    def check_sampling_params(cls, params: SamplingParams, model_path: str | None = None) -> SamplingParams:
        """The base's defaults and shape checks (from the folder), and T5's default text length."""
        return super().check_sampling_params(fill_defaults(params, max_sequence_length=MAX_SEQUENCE_LENGTH),
                                             model_path)

    # ------------------------------------------------------------------ worker process
    @property
    def transformer(self) -> torch.nn.Module:
        """diffusers' ``PixArtTransformer2DModel``."""
        return self.pipe.transformer

    @classmethod
    def install_attention(cls, module: torch.nn.Module, name: str) -> list:
        from omni_model_pixart.attention import install_omni_attention

        return install_omni_attention(module)

    def denoisers(self) -> list[DenoiserSpec]:
        t = self.transformer
        return [DenoiserSpec(
            name="transformer", module=t, blocks_attr="transformer_blocks", block_params=BLOCK_PARAMS,
            carried="hidden_states", block_outputs="hidden_states", residual_stream="hidden_states",
            # per row: the text, its padding bias and the adaLN-single timestep embedding. attention_mask (None)
            # and the forward's added_cond_kwargs dict are the same for every row: in neither list
            side_inputs=("encoder_hidden_states", "encoder_attention_mask", "timestep"),
            batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
            modulated_input=modulated_input,
            num_heads=t.config.num_attention_heads,
            sp_plan=SP_PLAN,
            # no published TeaCache coefficients for PixArt: tea_cache uses the raw relative change unless a
            # cache_config (or `omni cache calibrate --write`) gives some
            cache_defaults={})]

    # -- prompts: the text-encoding window (batched encoding, the embedding cache, the encode stage)
    def text_keys(self, state: StepState) -> list:
        sp, req = state.sampling_params, state.request
        keys = [(req.prompt, sp.max_sequence_length)]
        if sp.guidance_scale > 1:
            keys.append((req.negative_prompt or "", sp.max_sequence_length))
        return keys

    def encode_prompts(self, keys: list) -> dict:
        """The wave's distinct texts through T5, one call per text length (the tokenizer pads each text to
        ``max_sequence_length``: the mask marks the padding); ``{key: ([1, L, D] states, [1, L] mask)}``."""
        out: dict = {}
        with torch.no_grad():
            for msl in dict.fromkeys(m for _, m in keys):
                texts = [t for t, m in keys if m == msl]
                embeds, mask, _, _ = self.pipe.encode_prompt(texts, False, device=self.device, clean_caption=False,
                                                             max_sequence_length=msl)
                out.update({(t, msl): (embeds[i:i + 1], mask[i:i + 1]) for i, t in enumerate(texts)})
        return out

    def _encode(self, state: StepState, text: str, msl: int) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' ``encode_prompt`` of one text (as its ``__call__`` encodes the prompt and the negative), or
        the window's batched encoding."""
        def alone() -> tuple[torch.Tensor, torch.Tensor]:
            embeds, mask, _, _ = self.pipe.encode_prompt(text, False, device=self.device, clean_caption=False,
                                                         max_sequence_length=msl)
            return embeds, mask

        return self.encoded_text(state, (text, msl), alone)

    def prepare_encode(self, state: StepState) -> StepState:
        from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import retrieve_timesteps

        sp, req = state.sampling_params, state.request
        guided = sp.guidance_scale > 1  # diffusers: CFG when the scale is above 1, negative prompt "" by default
        with torch.no_grad():
            state.prompt_embeds, state.prompt_mask = self._encode(state, req.prompt, sp.max_sequence_length)
            if guided:
                state.negative_prompt_embeds, state.negative_prompt_mask = self._encode(
                    state, req.negative_prompt or "", sp.max_sequence_length)
        scheduler = self.new_scheduler()  # this request's own DPM-Solver (it keeps the previous model outputs)
        timesteps, _ = retrieve_timesteps(scheduler, sp.num_inference_steps, self.device)
        self.seed_generator(state)
        state.latents = self.pipe.prepare_latents(  # noise from the request's own generator
            sp.num_outputs_per_prompt, self.transformer.config.in_channels, sp.height, sp.width,
            state.prompt_embeds.dtype, self.device, state.generator)
        self.start_schedule(state, scheduler, timesteps)
        state.extra.update(do_cfg=guided, cfg_scale=sp.guidance_scale, height=sp.height, width=sp.width)
        return state

    def run_segments(self, expert: str, segments: list[tuple[StepState, str]]) -> list[torch.Tensor]:
        """One transformer call over the segments' latents with their branch's text and its padding mask, one
        timestep per row; the learned-sigma half of the output dropped, as diffusers does."""
        states = [s for s, _ in segments]
        rows = torch.tensor([s.latents.shape[0] for s in states], device=self.device)
        latents = [s.scheduler.scale_model_input(s.latents, s.timesteps[s.step_index]) for s in states]
        latents = latents[0] if len(latents) == 1 else torch.cat(latents)
        text, mask = self.segment_text_batch(segments)
        timestep = torch.stack([s.timesteps[s.step_index] for s in states]).repeat_interleave(rows)
        outs = self.call_denoiser(expert, segments, mask, hidden_states=latents, encoder_hidden_states=text,
                                  encoder_attention_mask=mask, timestep=timestep,
                                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        channels = latents.shape[1]
        return [o[:, :channels] if o.shape[1] == 2 * channels else o for o in outs]

    def step_scheduler(self, state: StepState, noise_pred: torch.Tensor) -> None:
        """The request's scheduler step with the keywords diffusers' call hands it (``prepare_extra_step_kwargs``:
        the request's generator where the step takes one, as the SDE DPM-Solvers do to draw noise)."""
        extra = self.pipe.prepare_extra_step_kwargs(state.generator, 0.0)
        with torch.no_grad():
            state.latents = state.scheduler.step(noise_pred, state.timesteps[state.step_index], state.latents,
                                                 **extra, return_dict=False)[0]
        state.step_index += 1

    # -- decoding and previews
    def decode_latents(self, latents: torch.Tensor, state: StepState) -> torch.Tensor:
        vae = self.pipe.vae
        image = vae_decode(vae, latents.to(self.device, vae.dtype) / vae.config.scaling_factor)
        return self.pipe.image_processor.postprocess(image, output_type="pt")

    def preview_latents(self, state: StepState) -> torch.Tensor:
        """The solver's latest clean-image estimate where it keeps one (DPM-Solver++ stores its data predictions),
        else the current latents (noise early on: the scheduler is not flow matching)."""
        scheduler = state.scheduler
        kept = getattr(scheduler, "model_outputs", None) or [None]
        x0 = kept[-1]
        data = getattr(getattr(scheduler, "config", None), "algorithm_type", "").endswith("dpmsolver++")
        if data and x0 is not None and x0.shape == state.latents.shape:
            return x0[0]
        return state.latents[0]
