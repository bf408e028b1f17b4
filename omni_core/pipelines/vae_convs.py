"""A VAE decode speed-up: a causal ``Conv3d`` given one frame (an image, a video's first latent frame) runs as
one ``conv2d`` with its last temporal slice, as a hook on the module (same result up to summation order)."""

from __future__ import annotations

from typing import Any

import torch

from omni_core.hooks import STAGES, ModuleHook, add_hook, get_hook

#: the hook name of :class:`_SingleFrameCausalConv` on a VAE's causal convolutions
SINGLE_FRAME_CONV = "vae.single_frame_conv"


class _SingleFrameCausalConv(ModuleHook):
    """Hook (``kernel`` stage) on a diffusers causal ``Conv3d`` (``QwenImageCausalConv3d``, ``WanCausalConv3d``):
    a single input frame with no cached frames before it (an image, or a video's first latent frame) is padded
    in time with zeros only, so every temporal kernel slice but the last multiplies zeros: the same output is
    one ``conv2d`` with that slice, a third of the work for a 3x3x3 kernel. Anything else (cached frames,
    several frames, temporal stride) runs the rest of the chain (the module's own forward)."""

    order = STAGES["kernel"]

    def __init__(self) -> None:
        super().__init__()
        self._slice: tuple[Any, torch.Tensor] | None = None

    def new_forward(self, conv: torch.nn.Conv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        pad = conv._padding
        if (cache_x is not None or x.dim() != 5 or x.shape[2] != 1 or conv.stride[0] != 1
                or conv.dilation[0] != 1 or pad[4] != conv.kernel_size[0] - 1 or pad[5] != 0):
            return self.fn_ref.original_forward(x, cache_x)
        w = conv.weight
        if w.device.type == "meta":  # a shapes-only pass (the parallel decode's): keep nothing
            weight = w[:, :, -1]
        else:
            key = (w.data_ptr(), w._version, w.dtype, w.device)
            if self._slice is None or self._slice[0] != key:
                self._slice = (key, w[:, :, -1].contiguous())
            weight = self._slice[1]
        x2 = torch.nn.functional.pad(x[:, :, 0], list(pad[:4])) if any(pad[:4]) else x[:, :, 0]
        out = torch.nn.functional.conv2d(x2, weight, conv.bias, stride=conv.stride[1:],
                                         dilation=conv.dilation[1:], groups=conv.groups)
        return out.unsqueeze(2)


def single_frame_causal_convs(vae: torch.nn.Module) -> int:
    """Add the :class:`_SingleFrameCausalConv` hook (:data:`SINGLE_FRAME_CONV`) to every causal ``Conv3d`` of
    ``vae`` (modules with diffusers' ``_padding`` causal layout); returns how many. Decoding an image (one
    latent frame) then costs about a third of the convolution work, with the same result up to float
    summation order."""
    n = 0
    for module in vae.modules():
        if (isinstance(module, torch.nn.Conv3d) and isinstance(getattr(module, "_padding", None), (tuple, list))
                and len(module._padding) == 6 and get_hook(module, SINGLE_FRAME_CONV) is None):
            add_hook(module, SINGLE_FRAME_CONV, _SingleFrameCausalConv())
            n += 1
    return n


__all__ = ["SINGLE_FRAME_CONV", "single_frame_causal_convs"]
