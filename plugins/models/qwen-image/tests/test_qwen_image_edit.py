"""Omni's QwenImageEditPipeline against diffusers' own, on one tiny random folder and one PIL input image.

``TestQwenImageEditParity`` is the core's :class:`~omni_core.testing.DiffusersParityContract` with one input
image per request (request and step mode, CFG on and off, three prompts of different lengths padded and masked
in one call per step, staggered admission, one call per wave equal to each request alone) plus the edit's own:
the image stream of a row (noisy + condition tokens), the condition path and the mask in the parity check, the
engine end to end. Parity: at most one level of 255, final latents within 5e-5.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState, resolve_model
from omni_core.request import OmniDiffusionRequest
from omni_core.testing import DiffusersParityContract, levels_apart

STEPS = 3
SIZE = 64  # output side; the tiny VAE's packing multiple is 32
#: one seed for all (``Omni.generate`` gives every prompt of a call the same seed, so the engine test reuses the
#: references); each request still draws its noise from its own generator
SEED = 7
#: one byte token per character, so the lengths differ
PROMPTS = ("turn the fox into a red fox jumping over a lazy dog in the snow", "make it night",
           "add a green horse on the moon")


class TestQwenImageEditParity(DiffusersParityContract):
    tiny_model = "edit"
    sampling = {"num_inference_steps": STEPS, "height": SIZE, "width": SIZE}
    prompts = PROMPTS
    negative_prompt = "blurry, low quality"
    cfg_field, cfg_scale, cfg_off, cfg_needs_negative = "true_cfg_scale", 4.0, 1.0, True
    seeds = (SEED, SEED, SEED)
    images_per_request = 1
    alone_folds_branches = False
    #: diffusers' edit run costs ~1 s here (its VAE encodes a ~1 MP copy of the input): one request batch with
    #: CFG on, off, on serves every check (staggered admission and the engine reuse its three references)
    cfg_modes = ("mixed",)

    def staggered_cases(self):
        return self.request_cases("mixed")

    def batch_cases(self):
        return [*self.request_cases("mixed")[:2], self.case(2, SEED, negative="ugly")]

    @pytest.fixture(autouse=True)
    def _edit_image(self, edit_image):
        self.image = edit_image

    def input_images(self):
        return [self.image]

    def test_a_rows_image_stream_is_noisy_then_condition_tokens(self):
        """One wave: the cond rows of all three and the uncond rows of the guided ones in ONE transformer call
        per step (text padded and masked), each row's image stream = 4 noisy + 1036 condition tokens."""
        cases = self.request_cases("mixed")
        states = [self.make_state(c) for c in cases]
        calls = []
        hook = self.omni.transformer.register_forward_pre_hook(
            lambda mod, args, kwargs: calls.append((tuple(kwargs["hidden_states"].shape[:2]), kwargs["img_shapes"][0],
                                                    kwargs["encoder_hidden_states_mask"] is not None)),
            with_kwargs=True)
        try:
            outs = self.omni.forward(states)
        finally:
            hook.remove()
        assert len({s.prompt_embeds.shape[1] for s in states}) == 3
        assert calls == [((5, 4 + 37 * 28), [(1, 2, 2), (1, 28, 37)], True)] * STEPS  # 1184x896 input -> 37x28
        for state, out, case in zip(states, outs, cases):
            self.assert_parity(state, out, case)

    def test_edit_parity_check_has_teeth(self, monkeypatch):
        """Another input image (the condition path), or dropping the text padding mask, moves the result far
        outside the tolerance (another seed or CFG scale: the contract's check)."""
        from PIL import ImageOps

        import omni_model_qwen_image.pipeline as mod

        case = self.request_cases("mixed")[1]
        ref = self.reference(case)
        self.image, image = ImageOps.invert(self.image), self.image
        try:
            inverted = self.make_state(case)
        finally:
            self.image = image
        (out,) = self.omni.forward([inverted])
        assert levels_apart(out.tensor, ref[0]) > 3 and (inverted.latents - ref[1]).abs().max() > 1e-2
        pad = mod.QwenImagePipeline.pad_text
        monkeypatch.setattr(mod.QwenImagePipeline, "pad_text", staticmethod(lambda *a: (pad(*a)[0], None)))
        states = [self.make_state(c) for c in self.request_cases("mixed")[:2]]
        self.omni.forward(states)
        assert (states[1].latents - ref[1]).abs().max() > 1e-3

    def test_engine_matches_diffusers(self, omni_engine):
        """``Omni(model=<folder>).generate`` with ``{"prompt", "image"}`` dicts, step-wise: PIL images within 1
        level of diffusers'."""
        import numpy as np
        from diffusers.image_processor import VaeImageProcessor

        cases = self.request_cases("mixed")
        prompts = [{"prompt": c["prompt"], "image": self.image,
                    **({"negative_prompt": c["negative_prompt"]} if c["negative_prompt"] else {})} for c in cases]
        outs = omni_engine.generate(prompts, seed=SEED, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                                    true_cfg_scale=4.0, use_tqdm=False)
        for out, case in zip(outs, cases):
            ref = self.reference(case)[0][0]
            ref = np.asarray(VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(ref[None]))[0],
                             dtype=np.int16)
            assert np.abs(np.asarray(out.images[0], dtype=np.int16) - ref).max() <= 1


def test_registered_through_entry_point(edit_dir):
    from omni_core.plugins.manager import get_plugin_manager
    from omni_model_qwen_image.edit import QwenImageEditPipeline

    spec = get_plugin_manager().get_component("pipeline", "QwenImageEditPipeline")
    assert spec.provider == "omni-model-qwen-image"
    assert resolve_model(edit_dir).spec.name == "QwenImageEditPipeline"
    assert QwenImageEditPipeline.image_input.size_splits_batch and QwenImageEditPipeline.image_input.max_images == 1


@pytest.fixture(scope="module")
def omni_engine(edit_dir):
    from omni_core import Omni

    with Omni(edit_dir, dtype="float32", warmup=False, max_num_seqs=3, step_execution=True) as omni:
        yield omni


@pytest.mark.parametrize("image, match", [
    (None, r"needs the image to edit: give 'image' with 1 image \(got 0\)"),
    ("two", r"takes at most 1 input image, got 2"),
    ("not an image", r"image must be a PIL image"),
], ids=["missing", "two-images", "not-an-image"])
def test_bad_image_input_is_refused_naming_image_before_any_work(edit_image, omni_engine, image, match):
    prompt = {"prompt": "make it night"}
    if image == "two":
        prompt["image"] = [edit_image, edit_image]
    elif image is not None:
        prompt["image"] = image
    with pytest.raises(ConfigError, match=match) as err:
        omni_engine.generate([{"prompt": "fine", "image": edit_image}, prompt], num_inference_steps=STEPS,
                             height=SIZE, width=SIZE, use_tqdm=False)
    assert err.value.field == "image"


def test_input_sizes_split_batches_and_set_the_default_output_size(edit_dir, edit_image, omni_edit):
    """Different input sizes never share a wave (the scheduler's key and the pipeline's step key agree); with
    no height/width the output takes diffusers' ~1 MP size of the input, floored to the packing multiple."""
    from omni_core.sched import RequestScheduler, StepScheduler
    from omni_model_qwen_image.edit import QwenImageEditPipeline

    def request(image):
        req = OmniDiffusionRequest(prompt="x", sampling_params=QwenImageEditPipeline.check_sampling_params(
            SamplingParams(num_inference_steps=STEPS), edit_dir))
        req.images = [image]
        return QwenImageEditPipeline.check_images(req, QwenImageEditPipeline.request_limits())

    small, big = request(edit_image), request(edit_image.resize((96, 48)))
    assert small.sampling_params.height is None  # the worker derives it from the input
    for sched in (RequestScheduler(), StepScheduler()):
        assert sched.batch_key(small) == sched.batch_key(request(edit_image))
        assert sched.batch_key(small) != sched.batch_key(big)
    s_small, s_big = StepState(request=small), StepState(request=big)
    assert omni_edit.output_size(s_small) == (896, 1184) and omni_edit.output_size(s_big) == (736, 1440)
    s_small.latents = s_big.latents = torch.zeros(1, 4, 16)
    s_small.extra.update(height=64, width=64)
    s_big.extra.update(height=64, width=64)
    assert omni_edit.batch_key(s_small) != omni_edit.batch_key(s_big)


def test_tiny_folder_names_the_released_processor_and_reloads_offline(edit_dir, edit_image, diffusers_edit):
    """The folder says ``transformers`` / ``Qwen2VLProcessor`` as released folders do; it reloads without a
    download (and without torchvision, as the image-only stand-in), and its processor expands the image pad
    into the vision tower's merged patch tokens."""
    import json
    import os

    from omni_model_qwen_image.processor import has_torchvision, load_processor

    with open(os.path.join(edit_dir, "model_index.json")) as f:
        assert json.load(f)["processor"] == ["transformers", "Qwen2VLProcessor"]
    processor = load_processor(edit_dir)
    assert type(processor).__name__ == ("Qwen2VLProcessor" if has_torchvision() else "ImageOnlyQwen2VLProcessor")
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>x"], images=[edit_image], return_tensors="pt")
    grid = inputs["image_grid_thw"][0]
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == pad_id).sum()) == int(grid.prod()) // 4 > 1
    assert diffusers_edit.text_encoder.config.image_token_id == pad_id
