"""Omni's FLUX.2 pipelines against diffusers' own, on tiny random [klein] and [dev] folders (float32, CPU).

``TestKleinParity`` / ``TestDevParity`` are the core's :class:`~omni_core.testing.DiffusersParityContract` (request
and step mode, three prompts of different lengths in one batch, CFG off / on / mixed for [klein], staggered
admission, several outputs at a non-square size, a wave equal to each request alone, the engine end to end) plus
FLUX.2's own checks. Parity: at most one level of 255 per value, final packed latents within 5e-5.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import resolve_model
from omni_core.testing import DiffusersParityContract, levels_apart

STEPS = 3
#: text tokens; the tiny byte-level tokenizers make one per character (the chat template's too), so no prompt of
#: the contract is cut
MSL = 96
SAMPLING = {"num_inference_steps": STEPS, "height": 16, "width": 16, "max_sequence_length": MSL}


class Flux2Reference:
    """diffusers' FLUX.2 calls take no ``negative_prompt`` ([dev] has no CFG; [klein] encodes "" for its uncond
    branch but takes ``negative_prompt_embeds``): a case's negative prompt goes in as those embeddings."""

    def reference(self, case):
        from omni_core.testing import parity_harness as h

        key = (id(self.diffusers), tuple(sorted(case.items())))
        if key not in h._REFERENCES:
            prompt, seed, negative, _, _ = self._split(case)
            kwargs = self.reference_kwargs(case)
            if negative and self.cfg_needs_negative is False and self.pipeline_takes_negative:
                kwargs["negative_prompt_embeds"] = self.diffusers.encode_prompt(
                    prompt=[negative], max_sequence_length=case["max_sequence_length"])[0]
            final = {}

            def keep(_pipe, _i, _t, kw):
                final["latents"] = kw["latents"]
                return kw

            out = self.diffusers(prompt=prompt, output_type="pt", generator=torch.Generator("cpu").manual_seed(seed),
                                 callback_on_step_end=keep, **kwargs)
            h._REFERENCES[key] = (out[0], final["latents"])
        return h._REFERENCES[key]


def pictures():
    """Reference images: 72x64 and 64x64 RGB noise (PIL; diffusers refuses a side under 64), deterministic."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 72), (64, 64))]


class TestKleinParity(Flux2Reference, DiffusersParityContract):
    tiny_model = "klein"
    pipeline_takes_negative = True
    sampling = SAMPLING
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "guidance_scale", 4.0, 1.0, False
    other_size = {"width": 24}
    non_square = {"height": 24, "width": 16}

    def test_uncond_branch_is_the_empty_prompt_without_a_negative(self):
        """diffusers' [klein] always encodes "" for CFG; Omni does too when a request has no negative prompt, and
        a negative prompt really reaches the uncond branch (its image is far from the "" one)."""
        plain = self.case(1, 11, negative=None)
        state = self.make_state(plain)
        (out,) = self.omni.forward([state])
        assert state.extra["do_cfg"]
        self.assert_parity(state, out, plain)
        neg = self.case(1, 11)
        (other,) = self.omni.forward([self.make_state(neg)])
        assert levels_apart(other.tensor, out.tensor) > 1

    def input_images(self):
        return pictures()

    def test_reference_image_sets_the_size_and_matches_diffusers(self):
        """A reference image and no size: diffusers makes an image of the reference's size (cropped to the
        packing multiple); its tokens follow the noisy ones and change the image."""
        case = self.case(0, 3, images=(0,), height=None, width=None)
        state = self.make_state(case)
        (out,) = self.omni.forward([state])
        assert tuple(out.tensor.shape[-2:]) == (64, 72)
        self.assert_parity(state, out, case)
        (plain,) = self.omni.forward([self.make_state(self.case(0, 3, height=64, width=72))])
        assert levels_apart(plain.tensor, out.tensor) > 1  # the reference really conditions the image

    def test_reference_image_requests_batch_in_one_call(self):
        """Requests with a reference image of one size share every call (CFG on and off, other prompts, two
        outputs), each equal to diffusers' run alone."""
        cases = [self.case(0, 4, images=(0,)), self.case(1, 5, cfg=False, images=(0,), num_outputs_per_prompt=2),
                 self.case(2, 6, images=(0,), negative=None)]
        states = [self.make_state(c) for c in cases]
        outs, _ = self.forward_one_call_per_step(states, "reference-image requests")
        for state, out, case in zip(states, outs, cases):
            self.assert_parity(state, out, case)


class TestDevParity(Flux2Reference, DiffusersParityContract):
    tiny_model = "dev"
    pipeline_takes_negative = False
    sampling = SAMPLING
    #: [dev]'s guidance is embedded: no uncond branch ever; "mixed" puts guidance 4 and 1 rows in one call
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 4.0, 1.0
    cfg_modes = ("off", "mixed")
    other_size = {"width": 24}
    non_square = {"height": 24, "width": 16}
    engine_modes = ("step-batch",)

    def guided_at(self, state, step):
        return False

    def input_images(self):
        return pictures()

    def test_two_reference_images_match_diffusers(self):
        """Several references: their tokens one after the other, each with its own time coordinate."""
        case = self.case(2, 7, images=(0, 1))
        state = self.make_state(case)
        (out,) = self.omni.forward([state])
        self.assert_parity(state, out, case)

    def test_guidance_is_per_row_and_reaches_the_transformer(self):
        cases = [self.case(1, 5, cfg=1.5), self.case(1, 5, cfg=7.0)]
        states = [self.make_state(c) for c in cases]
        outs = self.omni.forward(states)
        for case, state, out in zip(cases, states, outs):
            self.assert_parity(state, out, case)
        assert levels_apart(outs[0].tensor, outs[1].tensor) > 1


def test_folders_resolve_to_the_two_pipelines(klein_dir, dev_dir):
    assert resolve_model(klein_dir).spec.name == "Flux2KleinPipeline"
    assert resolve_model(dev_dir).spec.name == "Flux2Pipeline"
    assert resolve_model(dev_dir).spec.supported_parallel == ("tensor", "ulysses", "ring", "cfg")


def test_bad_sizes_and_lengths_are_refused_naming_the_field(klein_dir):
    from omni_model_flux2.pipeline import Flux2KleinPipeline

    with pytest.raises(ConfigError, match=r"height=17 .*a multiple of 2 .*e\.g\. 16 or 18") as err:
        Flux2KleinPipeline.check_sampling_params(SamplingParams(height=17, width=16), klein_dir)  # tiny VAE: 1 x 2
    assert err.value.field == "height"
    with pytest.raises(ConfigError, match=r"width=1000 .*a multiple of 16 .*e\.g\. 992 or 1008") as err:
        Flux2KleinPipeline.check_sampling_params(SamplingParams(height=1024, width=1000))
    assert err.value.field == "width"
    with pytest.raises(ConfigError, match="max_sequence_length=513 .*at most 512") as err:
        Flux2KleinPipeline.check_sampling_params(SamplingParams(max_sequence_length=513), klein_dir)
    with pytest.raises(ConfigError, match="num_frames=5"):
        Flux2KleinPipeline.check_sampling_params(SamplingParams(num_frames=5), klein_dir)
    p = Flux2KleinPipeline.check_sampling_params(SamplingParams(), klein_dir)
    assert (p.height, p.width, p.num_inference_steps, p.guidance_scale, p.max_sequence_length) == \
        (None, None, 50, 4.0, 512)
