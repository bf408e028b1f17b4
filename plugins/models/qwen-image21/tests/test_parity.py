"""Omni's QwenImage21Pipeline against diffusers' own, on one tiny random folder (float32, CPU).

``TestQwenImage21Parity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` (request and step mode,
CFG on, off and mixed, three prompts of different lengths whose prefixes are padded and masked in one call,
staggered admission: a request joining a running wave brings its own prefix cache, several outputs at a
non-square size, one call per wave equal to each request alone, the engine end to end) plus Qwen-Image 2.1's own:
the prefix key/value cache per request, the per-row rotary tables. Parity: at most one level of 255 per pixel,
final latents within 5e-5.
"""

from __future__ import annotations

import torch

from omni_core.testing import DiffusersParityContract

SAMPLING = {"num_inference_steps": 3, "height": 32, "width": 32}
#: token lengths differ (the byte tokenizer gives one token per character)
PROMPTS = ("a red fox jumping over a lazy dog in a snowy forest at dawn, cinematic",
           "a cat",
           "an astronaut riding a green horse")


class TestQwenImage21Parity(DiffusersParityContract):
    tiny_model = "q21"
    sampling = SAMPLING
    prompts = PROMPTS
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    other_size = {"width": 64}
    non_square = {"height": 64, "width": 32}
    #: alone, branches whose prefixes differ in length run as two unmasked calls, as diffusers does
    alone_folds_branches = False

    def reference(self, case):
        """diffusers' output cut to its RGB channels (the 2.1 VAE decodes RGBA; Omni returns RGB: see
        ``QwenImage21Pipeline.decode_latents``), and its final latents."""
        images, latents = super().reference(case)
        return images[:, :3], latents
