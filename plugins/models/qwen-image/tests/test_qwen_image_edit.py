"""Omni's QwenImageEditPipeline against diffusers' own, on one tiny random folder and one PIL input image.

Parity: each Omni image equals the image diffusers' ``QwenImageEditPipeline`` makes for the same prompt and
image alone with ``generator=torch.Generator("cpu").manual_seed(seed)`` -- at most one level of 255 apart --
and the final latents agree to 5e-5. diffusers' call costs seconds of CPU here (its VAE encodes a ~1 MP copy
of the input), so three references serve every test: a request batch of three prompts
of different lengths, two guided (true CFG, different negative prompts) and one not.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import StepState, resolve_model
from omni_core.request import OmniDiffusionRequest

STEPS = 3
SIZE = 64  # output side; the tiny VAE's packing multiple is 32
#: one seed for all (``Omni.generate`` gives every prompt of a call the same seed, so the engine test reuses the
#: references); each request still draws its noise from its own generator
SEED = 7
#: prompt, seed, negative prompt (None: CFG off); one byte token per character, so the lengths differ
CASES = [("turn the fox into a red fox jumping over a lazy dog in the snow", SEED, "blurry, low quality"),
         ("make it night", SEED, None),
         ("add a green horse on the moon", SEED, "ugly")]
CFG = 4.0

_REFERENCES: dict = {}


def reference(pipe, image, prompt, seed, negative):
    """diffusers' image ``[1, 3, H, W]`` and final packed latents for one case (memoised for the session)."""
    key = (prompt, seed, negative)
    if key not in _REFERENCES:
        final = {}

        def keep(_pipe, _i, _t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        images = pipe(image=image, prompt=prompt, negative_prompt=negative, true_cfg_scale=CFG, height=SIZE,
                      width=SIZE, num_inference_steps=STEPS, output_type="pt",
                      generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep).images
        _REFERENCES[key] = (images, final["latents"])
    return _REFERENCES[key]


def make_state(model_dir, image, prompt, seed, negative=None):
    from omni_core.images import to_tensor
    from omni_model_qwen_image.edit import QwenImageEditPipeline

    params = QwenImageEditPipeline.check_sampling_params(
        SamplingParams(height=SIZE, width=SIZE, num_inference_steps=STEPS, true_cfg_scale=CFG, seed=seed), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params)
    request.images = [to_tensor(image)]
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def levels_apart(a, b):
    return ((a * 255).round() - (b * 255).round()).abs().max().item()


def assert_parity(state, output, ref):
    ref_images, ref_latents = ref
    assert output.tensor.shape == ref_images.shape
    assert levels_apart(output.tensor, ref_images) <= 1
    torch.testing.assert_close(state.latents, ref_latents, atol=5e-5, rtol=0)


def test_registered_through_entry_point(edit_dir):
    from omni_core.plugins.manager import get_plugin_manager
    from omni_model_qwen_image.edit import QwenImageEditPipeline

    spec = get_plugin_manager().get_component("pipeline", "QwenImageEditPipeline")
    assert spec.provider == "omni-model-qwen-image"
    assert resolve_model(edit_dir).spec.name == "QwenImageEditPipeline"
    assert QwenImageEditPipeline.image_input.size_splits_batch and QwenImageEditPipeline.image_input.max_images == 1


def test_request_batch_of_three_prompts_is_one_call_per_step_and_matches_diffusers(
        edit_dir, edit_image, omni_edit, diffusers_edit):
    """One wave: the cond rows of all three and the uncond rows of the two guided ones in ONE transformer
    call per step (text padded and masked), each row's image stream = 4 noisy + 1036 condition tokens."""
    states = [make_state(edit_dir, edit_image, *c) for c in CASES]
    calls = []
    hook = omni_edit.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append((tuple(kwargs["hidden_states"].shape[:2]), kwargs["img_shapes"][0],
                                                kwargs["encoder_hidden_states_mask"] is not None)),
        with_kwargs=True)
    try:
        outs = omni_edit.forward(states)
    finally:
        hook.remove()
    assert len({s.prompt_embeds.shape[1] for s in states}) == 3
    assert calls == [((5, 4 + 37 * 28), [(1, 2, 2), (1, 28, 37)], True)] * STEPS  # 1184x896 input -> 37x28
    for state, out, case in zip(states, outs, CASES):
        assert_parity(state, out, reference(diffusers_edit, edit_image, *case))


def test_step_batch_requests_admitted_at_different_steps(edit_dir, edit_image, omni_edit, diffusers_edit):
    from omni_core.testing.driver import run_step_batch

    states = [make_state(edit_dir, edit_image, *c) for c in CASES]
    seen = []
    denoise = omni_edit.denoise_step

    def spy(batch):
        seen.append(sorted(s.step_index for s in batch))
        return denoise(batch)

    omni_edit.denoise_step = spy
    try:
        outs = run_step_batch(omni_edit, states, admit_at=[0, 1, 2])
    finally:
        del omni_edit.denoise_step
    assert [0, 1, 2] in seen  # one denoise_step held all three at different steps
    for state, out, case in zip(states, outs, CASES):
        assert_parity(state, out, reference(diffusers_edit, edit_image, *case))


def test_parity_check_has_teeth(edit_dir, edit_image, omni_edit, diffusers_edit):
    """Another input image (the condition path), or dropping the text padding mask, moves the result far
    outside the tolerance."""
    from PIL import ImageOps

    import omni_model_qwen_image.pipeline as mod

    ref = reference(diffusers_edit, edit_image, *CASES[1])
    inverted = make_state(edit_dir, ImageOps.invert(edit_image), *CASES[1])
    (out,) = omni_edit.forward([inverted])
    assert levels_apart(out.tensor, ref[0]) > 3 and (inverted.latents - ref[1]).abs().max() > 1e-2
    pad = mod.QwenImagePipeline.pad_text
    mod.QwenImagePipeline.pad_text = staticmethod(lambda *a: (pad(*a)[0], None))
    try:
        states = [make_state(edit_dir, edit_image, *c) for c in CASES[:2]]
        omni_edit.forward(states)
    finally:
        mod.QwenImagePipeline.pad_text = staticmethod(pad)
    assert (states[1].latents - ref[1]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def omni_engine(edit_dir):
    from omni_core import Omni

    with Omni(edit_dir, dtype="float32", warmup=False, max_num_seqs=3, step_execution=True) as omni:
        yield omni


def test_engine_matches_diffusers(edit_image, omni_engine, diffusers_edit):
    """``Omni(model=<folder>).generate`` with ``{"prompt", "image"}`` dicts, step-wise: PIL images within 1
    level of diffusers'."""
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor

    prompts = [{"prompt": p, "image": edit_image, **({"negative_prompt": n} if n else {})} for p, _, n in CASES]
    outs = omni_engine.generate(prompts, seed=SEED, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                                true_cfg_scale=CFG, use_tqdm=False)
    for out, case in zip(outs, CASES):
        ref = reference(diffusers_edit, edit_image, *case)[0][0]
        ref = np.asarray(VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(ref[None]))[0], dtype=np.int16)
        assert np.abs(np.asarray(out.images[0], dtype=np.int16) - ref).max() <= 1


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
