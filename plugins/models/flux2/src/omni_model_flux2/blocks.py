"""One block list with one call for diffusers' ``Flux2Transformer2DModel``: what Omni's caches need.

Why this file exists: diffusers' forward runs the double-stream blocks
``(hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb, joint_attention_kwargs)
-> (encoder_hidden_states, hidden_states)``, then concatenates ``[text; image]`` and runs the single-stream blocks
``(hidden_states, encoder_hidden_states=None, temb_mod, ...) -> hidden_states`` on the joint sequence. A
``DenoiserSpec`` needs every block of ``blocks_attr`` to share one call and one return and the forward to call them
in a plain loop (TeaCache reuses one residual for all of them; cache-dit stands in for the whole loop). So:

* :class:`DoubleStream` / :class:`SingleStream` wrap the blocks (they are not registered in the transformer, so its
  ``state_dict``, its module paths for LoRA / tensor parallelism and its weights are untouched) with the one call
  ``(hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, temb_mod_single, image_rotary_emb,
  joint_attention_kwargs) -> (encoder_hidden_states, hidden_states)``; the single-stream wrapper concatenates the
  text in front of the image and splits it off again around each block (cat and slice are exact, so the result is
  diffusers' bit for bit);
* :func:`omni_forward` is diffusers' forward without the KV-cache branches (which Omni never uses; a call that
  asks for them goes to diffusers' own forward) with the two block loops as one loop over the wrappers; it runs as
  a ``kernel``-stage hook in the core's registry (:mod:`omni_core.hooks`), so caches, offload and diffusers' own
  hooks compose with it as with any forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: the registry name of the one-loop forward on the transformer
HOOK = "flux2.one_block_loop"
#: the wrappers' call (``DenoiserSpec.block_params``)
BLOCK_PARAMS = ("hidden_states", "encoder_hidden_states", "temb_mod_img", "temb_mod_txt", "temb_mod_single",
                "image_rotary_emb", "joint_attention_kwargs")
#: the attribute of the transformer holding the wrappers (a plain list: not a registered submodule)
BLOCKS_ATTR = "omni_blocks"


class DoubleStream(nn.Module):
    """A ``Flux2TransformerBlock`` under the common call."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, temb_mod_single,
                image_rotary_emb, joint_attention_kwargs):
        return self.block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          temb_mod_img=temb_mod_img, temb_mod_txt=temb_mod_txt, image_rotary_emb=image_rotary_emb,
                          joint_attention_kwargs=joint_attention_kwargs)

    def modulated(self, hidden_states: torch.Tensor, temb_mod_img: torch.Tensor) -> torch.Tensor:
        """The block's timestep-modulated image tokens (its attention input): TeaCache's signal."""
        from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

        (shift, scale, _), _ = Flux2Modulation.split(temb_mod_img, 2)
        return (1 + scale) * self.block.norm1(hidden_states) + shift


class SingleStream(nn.Module):
    """A ``Flux2SingleTransformerBlock`` under the common call: ``[text; image]`` in, split again after."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, temb_mod_single,
                image_rotary_emb, joint_attention_kwargs):
        txt = encoder_hidden_states.shape[1]
        joint = self.block(hidden_states=torch.cat([encoder_hidden_states, hidden_states], dim=1),
                           encoder_hidden_states=None, temb_mod=temb_mod_single, image_rotary_emb=image_rotary_emb,
                           joint_attention_kwargs=joint_attention_kwargs)
        return joint[:, :txt], joint[:, txt:]


def omni_forward(self, below: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 timestep: torch.Tensor = None, img_ids: torch.Tensor = None, txt_ids: torch.Tensor = None,
                 guidance: torch.Tensor = None, joint_attention_kwargs: dict[str, Any] | None = None,
                 return_dict: bool = True, **kv_cache: Any) -> Any:
    """diffusers' ``Flux2Transformer2DModel.forward`` (0.42) without its KV-cache mode, the blocks in one loop;
    ``below``: the module's own forward (the KV-cache calls)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModelOutput

    if any(v not in (None, 0, 0.0) for v in kv_cache.values()):
        return below(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance,
                     joint_attention_kwargs, return_dict, **kv_cache)
    timestep = timestep.to(hidden_states.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hidden_states.dtype) * 1000
    temb = self.time_guidance_embed(timestep, guidance)
    mods = {"temb_mod_img": self.double_stream_modulation_img(temb),
            "temb_mod_txt": self.double_stream_modulation_txt(temb),
            "temb_mod_single": self.single_stream_modulation(temb)}
    hidden_states = self.x_embedder(hidden_states)
    encoder_hidden_states = self.context_embedder(encoder_hidden_states)
    img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
    image_rotary, text_rotary = self.pos_embed(img_ids), self.pos_embed(txt_ids)
    rotary = (torch.cat([text_rotary[0], image_rotary[0]], dim=0), torch.cat([text_rotary[1], image_rotary[1]], dim=0))
    for block in getattr(self, BLOCKS_ATTR):  # a plain loop over one block list (what cache-dit stands in for)
        encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, mods["temb_mod_img"],
                                                     mods["temb_mod_txt"], mods["temb_mod_single"], rotary,
                                                     joint_attention_kwargs)
    output = self.proj_out(self.norm_out(hidden_states, temb))
    return (output,) if not return_dict else Flux2Transformer2DModelOutput(sample=output)


def install_block_list(transformer: nn.Module) -> list[nn.Module]:
    """Put the wrappers on ``transformer`` (``omni_blocks``, double- then single-stream) and route its forward
    through :func:`omni_forward` (with diffusers' LoRA-scale decorator, as its own forward has), a ``kernel``-stage
    hook of the core's registry."""
    from diffusers.utils.peft_utils import apply_lora_scale

    from omni_core.hooks import STAGES, FunctionHook, add_hook

    blocks = [DoubleStream(b) for b in transformer.transformer_blocks]
    blocks += [SingleStream(b) for b in transformer.single_transformer_blocks]
    object.__setattr__(transformer, BLOCKS_ATTR, blocks)
    forward = apply_lora_scale("joint_attention_kwargs")(omni_forward)
    add_hook(transformer, HOOK, FunctionHook(lambda below, *args, **kwargs: forward(transformer, below, *args, **kwargs),
                                             order=STAGES["kernel"]))
    return blocks
