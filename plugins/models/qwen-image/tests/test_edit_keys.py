"""What a Qwen-Image-Edit request's text encoding and output size are keyed on.

* The prompt is encoded together with the input image, so two requests of one wave with the same instruction
  and different images (same size: they share the wave) must not share an encoding: each gets the image it
  sent, exactly as when it runs alone.
* Edit Plus with no size asked for makes the last input image's ~1 MP size (diffusers'
  ``QwenImageEditPlusPipeline``: ``image[-1].size``), not the first's.
"""

from __future__ import annotations

import numpy as np
import torch

from omni_core.images import to_tensor
from omni_core.testing.driver import make_state

PROMPT = "make it red"
NEGATIVE = "blurry"  # true CFG: the wave then has two distinct texts, so its encodings are batched and shared


def picture(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def edit_state(pipeline, images, **params):
    state = make_state(pipeline, PROMPT, seed=5, negative_prompt=NEGATIVE, num_inference_steps=2,
                       true_cfg_scale=4.0, output_type="pt", **params)
    state.request.images = [to_tensor(im) for im in images]
    return state


def test_same_instruction_on_different_images_in_one_wave_keeps_each_images_encoding(omni_edit, edit_image):
    other = picture(edit_image.width, edit_image.height, seed=3)  # the same size: the two share a wave
    batch = [edit_state(omni_edit, [im], height=64, width=64) for im in (edit_image, other)]
    outs = omni_edit.forward(batch)
    alone = []
    for im in (edit_image, other):
        state = edit_state(omni_edit, [im], height=64, width=64)
        (out,) = omni_edit.forward([state])
        alone.append((state, out))
    for i, (state, out) in enumerate(alone):
        torch.testing.assert_close(batch[i].prompt_embeds, state.prompt_embeds, atol=1e-5, rtol=0,
                                   msg=lambda m: f"request {i}'s prompt encoding in the wave is not its own: {m}")
        torch.testing.assert_close(outs[i].tensor, out.tensor, atol=1e-4, rtol=0)
    assert (alone[0][0].prompt_embeds - alone[1][0].prompt_embeds).abs().max() > 1e-3, \
        "the input image must change the prompt's encoding"


def test_edit_plus_default_size_is_the_last_images(omni_plus):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

    first, last = picture(64, 48, seed=1), picture(40, 64, seed=2)  # landscape, then portrait
    multiple = omni_plus.pipe.vae_scale_factor * 2

    def default_size(image):
        width, height = calculate_dimensions(1024 * 1024, image.width / image.height)
        return height // multiple * multiple, width // multiple * multiple

    assert default_size(first) != default_size(last)
    state = make_state(omni_plus, PROMPT, seed=5, num_inference_steps=1, output_type="pt")
    state.request.images = [to_tensor(first), to_tensor(last)]
    (out,) = omni_plus.forward([state])
    assert tuple(out.tensor.shape[-2:]) == default_size(last), \
        f"output {tuple(out.tensor.shape[-2:])}: the last image's size is {default_size(last)}"
