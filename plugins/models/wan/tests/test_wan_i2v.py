"""Omni's WanImageToVideoPipeline against diffusers' own, on tiny random Wan 2.1 I2V, Wan 2.2 I2V-A14B (two
experts) and TI2V (``expand_timesteps``) folders, given the same PIL images.

Each layout is the core's :class:`~omni_core.testing.DiffusersParityContract` with one input image per request
(request i takes image i: sizes and aspect ratios differ, and they share a wave): a request batch of three
prompts in one call per step with CFG mixed on every layout (all on: Wan 2.1 I2V; all off: TI2V), staggered
admission, several outputs at a non-square size (Wan 2.2 I2V, TI2V: diffusers' Wan 2.1 I2V cannot), one call
per wave equal to each request alone (Wan 2.1 I2V, TI2V), the engine end to end (Wan 2.1 I2V, step mode) and
the check's teeth. A check that one layout runs for all covers code the three share; each layout runs the
checks its own path (image embeddings, experts, per-token timesteps) changes, to keep the file's CI time near
its hand-written predecessor's. Plus the I2V specifics: image embeddings per row (2.1), no image encoder and
two experts (2.2), the condition frame's timestep-0 tokens (TI2V), what makes the parity check see the image,
and the refusals. Parity: at most one level of 255 per frame value, final latents within 5e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines import resolve_model
from omni_core.testing import DiffusersParityContract

#: with shift=7 the 3 timesteps are [1000, 876.5, 46.8]: Wan 2.2's boundary 875 gives two steps to the first
#: expert, one to the second (3 is the fewest for the staggered check: one wave holds steps 0, 1 and 2)
STEPS = 3
FRAMES = 5
SIZE = 16
NEG = "blurry, static"
#: token lengths differ (the character tokenizer gives one token per character), all under ``MSL``
PROMPTS = ("a red fox jumps over a dog", "a cat", "an astronaut rides a horse")
#: Wan 2.2 I2V and TI2V run at 32 text tokens (diffusers' text encoder at 512 is most of a tiny run); Wan 2.1
#: I2V must take 512 (its image tokens come first: ``test_wan21_max_sequence_length_must_be_512``)
MSL = 32


def _image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


#: input images of different sizes and aspect ratios (each is resized to the output size)
IMAGES = [_image(0, 24, 20), _image(1, 16, 16), _image(2, 30, 40)]


class WanI2VParity(DiffusersParityContract):
    """What the three layouts share (not collected: no ``Test`` prefix)."""

    sampling = {"num_inference_steps": STEPS, "height": SIZE, "width": SIZE, "num_frames": FRAMES}
    prompts = PROMPTS
    negative_prompt = NEG
    cfg_field, cfg_scale, cfg_off = "guidance_scale", 6.0, 1.0
    outputs_kwarg = "num_videos_per_prompt"
    images_per_request = 1
    other_size = {"width": 32}
    #: several outputs at a non-square size: on Wan 2.2 I2V and TI2V; diffusers' own WanImageToVideoPipeline
    #: cannot make two videos per prompt with CLIP image embeddings (its transformer gets one image row for two)
    non_square = {}
    engine_requests = 2
    #: the engine end to end on Wan 2.1 I2V in step mode (its request path and the image hand-off are the
    #: same for every layout; ``test_request_without_image_refused_before_any_work`` starts one on Wan 2.2)
    engine_modes = ()

    def input_images(self):
        return IMAGES

    def case(self, i, seed, *, images=None, **fields):
        """Prompt ``i`` with image ``i``."""
        return super().case(i, seed, images=(i % len(IMAGES),) if images is None else images, **fields)


class TestWan21I2VParity(WanI2VParity):
    tiny_model = "i2v21"
    #: its diffusers run is the slow one (text at 512 tokens): the all-off batch runs on TI2V
    cfg_modes = ("on", "mixed")
    engine_modes = ("step-batch",)

    def test_every_attention_is_omni_and_each_row_carries_its_image_embeddings(self):
        """Self, text cross and image cross attention are Omni layers; one call per step holds every row (3 cond
        + 2 uncond), each with the CLIP embeddings of its request's image."""
        omni = self.omni
        assert omni.uses_image_embeds and not type(omni).image_input.size_splits_batch
        assert {layer.role for layer in omni.attention_layers} == {"self", "cross", "cross_image"}
        assert "ftfy" in resolve_model(self.model_path).spec.requires
        states = [self.make_state(c) for c in self.request_cases("mixed")]
        seen = []
        hook = omni.experts["transformer"].register_forward_pre_hook(
            lambda mod, args, kw: seen.append((kw["hidden_states"].shape[:2], kw["encoder_hidden_states_image"])),
            with_kwargs=True)
        try:
            omni.forward(states)
        finally:
            hook.remove()
        assert len(seen) == STEPS and all(shape == (5, 36) and image.shape[0] == 5 for shape, image in seen)
        rows = seen[0][1]
        assert not torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[3])  # cond rows, then uncond

    def test_i2v_parity_check_has_teeth(self, monkeypatch):
        """Another image, a zeroed condition, or another image's CLIP embeddings each move the result far
        outside the parity tolerance: the check sees both ways the image reaches the transformer."""
        from omni_model_wan.i2v import WanImageToVideoPipeline

        case = self.case(1, self.seeds[1], cfg=False)  # the mixed batch's second request: image 1, CFG off
        ref = self.reference(case)[1]

        def gap(image_index=1):
            state = self.make_state({**case, "images": (image_index,)})
            self.omni.forward([state])
            return (state.latents - ref).abs().max().item()

        assert gap() <= 5e-5
        assert gap(0) > 1e-3  # image 0 instead of 1
        model_input = WanImageToVideoPipeline.model_input
        monkeypatch.setattr(WanImageToVideoPipeline, "model_input", lambda self, s: model_input(self, s) * torch.tensor(
            [1.0] * 16 + [0.0] * 20).view(1, -1, 1, 1, 1))
        assert gap() > 1e-3
        monkeypatch.undo()
        encode_image = self.omni.pipe.encode_image
        monkeypatch.setattr(self.omni.pipe, "encode_image", lambda image, device: encode_image(IMAGES[0], device))
        assert gap() > 1e-3


class TestWan22I2VParity(WanI2VParity):
    tiny_model = "i2v22"
    sampling = {**WanI2VParity.sampling, "max_sequence_length": MSL}
    cfg_modes = ("mixed",)
    cfg_scale = 5.0
    non_square = {"height": 16, "width": 32}

    def staggered_cases(self):
        """The first request with its own second-expert scale (``guidance_scale_2``)."""
        cases = super().staggered_cases()
        cases[0]["guidance_scale_2"] = 2.0
        return cases

    def test_a_wave_is_one_call_per_step_and_equals_each_alone(self):
        pytest.skip("its batching is Wan 2.1 I2V's (condition rows, two outputs) with Wan 2.2 T2V's experts: "
                    "both run this check; the request batch and the staggered waves run here")

    def test_two_experts_and_no_image_embeddings(self):
        omni = self.omni
        assert set(omni.experts) == {"transformer", "transformer_2"} and not omni.uses_image_embeds
        states = [self.make_state(self.case(i, 20 + i, guidance_scale_2=2.0)) for i in range(3)]
        seen = []
        hooks = [m.register_forward_pre_hook(lambda mod, args, kw, n=name: seen.append(
            (n, kw["hidden_states"].shape[0], kw.get("encoder_hidden_states_image"))), with_kwargs=True)
            for name, m in omni.experts.items()]
        try:
            omni.forward(states)
        finally:
            for h in hooks:
                h.remove()
        # 2 steps, then 1: ONE call per step holding cond + uncond of all three, no image embeddings
        assert [(n, rows) for n, rows, _ in seen] == [("transformer", 6)] * 2 + [("transformer_2", 6)]
        assert all(image is None for _, _, image in seen)


class TestTI2VParity(WanI2VParity):
    tiny_model = "ti2v"
    sampling = {**WanI2VParity.sampling, "max_sequence_length": MSL}
    cfg_modes = ("off", "mixed")
    cfg_scale = 5.0
    non_square = {"height": 32, "width": 16}

    def compare_latents(self, latents, ref_latents):
        """From the second latent frame on: diffusers' callback sees the latents before the first frame is
        replaced by the condition."""
        super().compare_latents(latents[:, :, 1:], ref_latents[:, :, 1:])

    def test_condition_tokens_run_at_timestep_zero(self):
        """The condition is the first latent frame: its tokens at timestep 0, the rest at the step's."""
        omni = self.omni
        assert omni.expand_timesteps and not omni.uses_image_embeds
        states = [self.make_state(self.case(0, 5)), self.make_state(self.case(1, 6, cfg=False))]
        seen = []
        hook = omni.experts["transformer"].register_forward_pre_hook(
            lambda mod, args, kw: seen.append(kw["timestep"]), with_kwargs=True)
        try:
            omni.forward(states)
        finally:
            hook.remove()
        tokens_per_frame = (SIZE // 8 // 2) ** 2
        assert seen[0].shape == (3, ((FRAMES - 1) // 4 + 1) * tokens_per_frame)
        assert bool((seen[0][:, :tokens_per_frame] == 0).all()) and bool((seen[0][:, tokens_per_frame:] == 1000).all())


def test_request_without_image_refused_before_any_work(i2v22_dir, omni_i2v22, monkeypatch):
    """The engine refuses it at submission, naming ``image`` (no worker step runs); a pipeline driven directly
    refuses it too."""
    from omni_core import Omni
    from omni_core.testing import make_state
    from omni_model_wan.i2v import WanImageToVideoPipeline

    encoded = []
    monkeypatch.setattr(WanImageToVideoPipeline, "prepare_encode", lambda self, s: encoded.append(s))
    with Omni(i2v22_dir, dtype="float32", warmup=False, cpu_threads=1) as engine:
        with pytest.raises(ConfigError, match=r"needs the first frame of the video: give 'image'") as err:
            engine.generate("a cat", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                            use_tqdm=False)
    assert err.value.field == "image" and encoded == []
    monkeypatch.undo()
    state = make_state(omni_i2v22, PROMPTS[1], seed=1, height=SIZE, width=SIZE, num_frames=FRAMES,
                       num_inference_steps=STEPS)
    with pytest.raises(ConfigError, match="give 'image'") as err:
        omni_i2v22.prepare_encode(state)
    assert err.value.field == "image"


def test_folder_naming_the_pil_image_processor_loads(i2v21_dir, tmp_path):
    """Saved without torchvision, diffusers names ``CLIPImageProcessorPil`` in model_index.json; released
    folders name ``CLIPImageProcessor`` (the fixture's folder): both load."""
    import json
    import shutil

    from omni_core.testing import load_model

    folder = shutil.copytree(i2v21_dir, tmp_path / "pil")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    index["image_processor"][1] = "CLIPImageProcessorPil"
    (folder / "model_index.json").write_text(json.dumps(index))
    assert type(load_model(str(folder)).pipe.image_processor).__name__.startswith("CLIPImageProcessor")


def test_wan21_max_sequence_length_must_be_512(i2v21_dir, i2v22_dir):
    from omni_model_wan.i2v import WanImageToVideoPipeline

    with pytest.raises(ConfigError, match=r"max_sequence_length=64 .*exactly 512 text tokens") as err:
        WanImageToVideoPipeline.check_sampling_params(SamplingParams(max_sequence_length=64, height=16, width=16,
                                                                     num_frames=5), i2v21_dir)
    assert err.value.field == "max_sequence_length"
    ok = WanImageToVideoPipeline.check_sampling_params(SamplingParams(max_sequence_length=64, height=16, width=16,
                                                                      num_frames=5), i2v22_dir)
    assert ok.max_sequence_length == 64  # Wan 2.2 I2V has no image tokens: any length
