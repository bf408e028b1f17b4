"""Omni's WanImageToVideoPipeline against diffusers' own, on tiny random Wan 2.1 I2V, Wan 2.2 I2V-A14B (two
experts) and TI2V (``expand_timesteps``) folders, given the same PIL images.

Parity: each Omni video equals the video diffusers makes for the same prompt and image alone with
``generator=torch.Generator("cpu").manual_seed(seed)``: at most one level of 255 apart on every frame, final
latents within 5e-5.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.images import to_tensor
from omni_core.pipelines import StepState, resolve_model
from omni_core.request import OmniDiffusionRequest

#: as the plugin conftest: an in-process engine would otherwise set 2 threads
TEST_THREADS = int(os.environ.get("OMNI_TEST_THREADS", "1"))

#: with shift=7 the 4 timesteps are [1000, 934, 781, 47]: Wan 2.2's boundary 875 gives two steps per expert
STEPS = 4
FRAMES = 5
SIZE = 16
NEG = "blurry, static"
PROMPTS = ["a red fox jumps over a dog", "a cat", "an astronaut rides a horse"]


def _image(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


#: input images of different sizes and aspect ratios (each is resized to the output size)
IMAGES = [_image(0, 24, 20), _image(1, 16, 16), _image(2, 30, 40)]

_REFERENCES: dict = {}


def reference(pipe, prompt, image_index, seed, *, negative=None, g=6.0, g2=None, width=SIZE):
    """diffusers' video ``[1, F, 3, H, W]`` and final latents for one prompt and image (memoised)."""
    key = (id(pipe), prompt, image_index, seed, negative, g, g2, width)
    if key not in _REFERENCES:
        final = {}

        def keep(_pipe, _i, _t, kwargs):
            final["latents"] = kwargs["latents"]
            return kwargs

        kwargs = {"guidance_scale_2": g2} if g2 is not None else {}
        video = pipe(image=IMAGES[image_index], prompt=prompt, negative_prompt=negative, guidance_scale=g,
                     height=SIZE, width=width, num_frames=FRAMES, num_inference_steps=STEPS, output_type="pt",
                     generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=keep, **kwargs).frames
        _REFERENCES[key] = (video, final["latents"])
    return _REFERENCES[key]


def make_state(model_dir, prompt, image_index, seed, *, negative=None, g=6.0, g2=None, width=SIZE):
    from omni_model_wan.i2v import WanImageToVideoPipeline

    params = WanImageToVideoPipeline.check_sampling_params(
        SamplingParams(height=SIZE, width=width, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=g,
                       guidance_scale_2=g2, seed=seed), model_dir)
    request = OmniDiffusionRequest(prompt=prompt, negative_prompt=negative, sampling_params=params,
                                   images=[to_tensor(IMAGES[image_index])])
    return StepState(request=request, generator=torch.Generator("cpu").manual_seed(seed))


def assert_parity(state, output, ref, first_latent_frame=True):
    """Every frame within one level of 255; the final latents within 5e-5 (``first_latent_frame=False``: from
    the second latent frame on, for TI2V, whose callback sees the latents before the first frame is replaced
    by the condition)."""
    ref_video, ref_latents = ref
    assert output.tensor.shape == ref_video.shape
    levels = ((output.tensor * 255).round() - (ref_video * 255).round()).abs().max().item()
    assert levels <= 1, f"{levels} levels of 255 apart from diffusers"
    start = 0 if first_latent_frame else 1
    torch.testing.assert_close(state.latents[:, :, start:], ref_latents[:, :, start:], atol=5e-5, rtol=0)


class CallCounter:
    """Forward pre-hooks on every expert: calls per expert and the batch rows of each call."""

    def __init__(self, omni):
        self.calls: dict[str, list] = {name: [] for name in omni.experts}
        self.hooks = [m.register_forward_pre_hook(lambda mod, a, kw, n=name: self.calls[n].append(kw), with_kwargs=True)
                      for name, m in omni.experts.items()]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def test_registered_and_resolved(i2v21_dir, i2v21):
    from omni_core.plugins.manager import get_plugin_manager
    from omni_model_wan.i2v import WanImageToVideoPipeline

    spec = get_plugin_manager().get_component("pipeline", "WanImageToVideoPipeline")
    assert spec.provider == "omni-model-wan" and "ftfy" in spec.requires
    assert resolve_model(i2v21_dir).spec.name == "WanImageToVideoPipeline"
    _, omni = i2v21
    assert isinstance(omni, WanImageToVideoPipeline) and omni.uses_image_embeds
    assert not WanImageToVideoPipeline.image_input.size_splits_batch
    # every attention of the transformer (self, text cross, image cross) is an Omni layer
    assert {layer.role for layer in omni.attention_layers} == {"self", "cross", "cross_image"}


#: CFG on, off, on (one wave holds both kinds); also the first three requests of the wan21 step batch
WAN21_CASES = [dict(prompt=PROMPTS[0], image_index=0, seed=10, negative=NEG, g=6.0),
               dict(prompt=PROMPTS[1], image_index=1, seed=11, g=1.0),
               dict(prompt=PROMPTS[2], image_index=2, seed=12, negative=NEG, g=6.0)]


def ref_of(pipe, case):
    case = dict(case)
    return reference(pipe, case.pop("prompt"), case.pop("image_index"), case.pop("seed"), **case)


def test_wan21_request_batch_three_prompts(i2v21_dir, i2v21):
    """Three prompts of different lengths with three different images, CFG on and off, in one wave: one
    transformer call per step holding every row (3 cond + 2 uncond), each with its image embeddings."""
    ref_pipe, omni = i2v21
    states = [make_state(i2v21_dir, **c) for c in WAN21_CASES]
    with CallCounter(omni) as counter:
        outs = omni.forward(states)
    calls = counter.calls["transformer"]
    assert len(calls) == STEPS
    assert all(kw["hidden_states"].shape[:2] == (5, 36) and kw["encoder_hidden_states_image"].shape[0] == 5
               for kw in calls)
    for case, state, out in zip(WAN21_CASES, states, outs):
        assert_parity(state, out, ref_of(ref_pipe, case))


def test_wan22_two_experts_request_batch(i2v22_dir, i2v22):
    ref_pipe, omni = i2v22
    assert set(omni.experts) == {"transformer", "transformer_2"} and not omni.uses_image_embeds
    states = [make_state(i2v22_dir, p, i, 20 + i, negative=NEG, g=5.0, g2=2.0) for i, p in enumerate(PROMPTS)]
    with CallCounter(omni) as counter:
        outs = omni.forward(states)
    # 2 steps each, ONE call per step holding cond + uncond of all three
    assert {n: [kw["hidden_states"].shape[0] for kw in c] for n, c in counter.calls.items()} == \
        {"transformer": [6, 6], "transformer_2": [6, 6]}
    assert all(kw.get("encoder_hidden_states_image") is None for c in counter.calls.values() for kw in c)
    for i, (state, out) in enumerate(zip(states, outs)):
        assert_parity(state, out, reference(ref_pipe, PROMPTS[i], i, 20 + i, negative=NEG, g=5.0, g2=2.0))


@pytest.mark.parametrize("layout", ["wan21", "wan22"])
def test_step_batch_requests_admitted_at_different_steps(layout, request):
    """Requests join at steps 0, 1, 2, 2 (CFG on and off, a non-square size), so one denoise_step holds
    requests at different steps (on Wan 2.2: on both experts)."""
    from omni_core.testing.driver import run_step_batch

    model_dir = request.getfixturevalue(f"i2v{layout[3:]}_dir")
    ref_pipe, omni = request.getfixturevalue(f"i2v{layout[3:]}")
    if layout == "wan21":  # as in the request-batch test (its diffusers runs are reused)
        cases = list(WAN21_CASES)
    else:
        cases = [dict(prompt=PROMPTS[0], image_index=0, seed=20, negative=NEG, g=5.0, g2=2.0),
                 dict(prompt=PROMPTS[1], image_index=1, seed=2, g=1.0),
                 dict(prompt=PROMPTS[2], image_index=2, seed=22, negative=NEG, g=5.0, g2=2.0)]
    cases.append(dict(prompt=PROMPTS[1], image_index=2, seed=4, g=4.0, width=32))
    states = [make_state(model_dir, **c) for c in cases]
    waves = []
    denoise = omni.denoise_step

    def spy(batch):
        waves.append(sorted((s.step_index, omni.expert_for(s)[0]) for s in batch))
        return denoise(batch)

    omni.denoise_step = spy
    try:
        outs = run_step_batch(omni, states, admit_at=[0, 1, 2, 2])
    finally:
        del omni.denoise_step
    assert any(len({step for step, _ in w}) == 3 for w in waves)  # three different steps in one wave
    if layout == "wan22":
        assert any({e for _, e in w} == {"transformer", "transformer_2"} for w in waves)
    for c, state, out in zip(cases, states, outs):
        assert_parity(state, out, ref_of(ref_pipe, c))


def test_expand_timesteps_layout(ti2v_dir, ti2v):
    """TI2V: condition in the first latent frame, its tokens at timestep 0, final blend; two requests batched."""
    ref_pipe, omni = ti2v
    assert omni.expand_timesteps and not omni.uses_image_embeds
    states = [make_state(ti2v_dir, PROMPTS[0], 0, 5, negative=NEG, g=5.0), make_state(ti2v_dir, PROMPTS[1], 2, 6, g=1.0)]
    with CallCounter(omni) as counter:
        outs = omni.forward(states)
    timestep = counter.calls["transformer"][0]["timestep"]
    tokens_per_frame = (SIZE // 8 // 2) ** 2
    assert timestep.shape == (3, ((FRAMES - 1) // 4 + 1) * tokens_per_frame)
    assert bool((timestep[:, :tokens_per_frame] == 0).all()) and bool((timestep[:, tokens_per_frame:] == 1000).all())
    for state, out, (p, i, seed, neg, g) in zip(states, outs, [(PROMPTS[0], 0, 5, NEG, 5.0), (PROMPTS[1], 2, 6, None, 1.0)]):
        assert_parity(state, out, reference(ref_pipe, p, i, seed, negative=neg, g=g), first_latent_frame=False)


def test_parity_check_has_teeth(i2v21_dir, i2v21, monkeypatch):
    """Another image, a zeroed condition, or another image's CLIP embeddings each move the result far outside
    the parity tolerance: the check sees both ways the image reaches the transformer."""
    from omni_model_wan.i2v import WanImageToVideoPipeline

    ref_pipe, omni = i2v21

    def gap(image_index=0):
        state = make_state(i2v21_dir, PROMPTS[1], image_index, 2, g=1.0)
        omni.forward([state])
        return (state.latents - reference(ref_pipe, PROMPTS[1], 0, 2, g=1.0)[1]).abs().max().item()

    assert gap(0) <= 5e-5
    assert gap(1) > 1e-3  # image 1 instead of 0
    model_input = WanImageToVideoPipeline.model_input
    monkeypatch.setattr(WanImageToVideoPipeline, "model_input",
                        lambda self, s: model_input(self, s) * torch.tensor([1.0] * 16 + [0.0] * 20).view(1, -1, 1, 1, 1))
    assert gap(0) > 1e-3
    monkeypatch.undo()
    encode_image = omni.pipe.encode_image
    monkeypatch.setattr(omni.pipe, "encode_image", lambda image, device: encode_image(IMAGES[1], device))
    assert gap(0) > 1e-3


def test_request_without_image_refused_before_any_work(i2v22_dir, i2v22, monkeypatch):
    """The engine refuses it at submission, naming ``image`` (no worker step runs); a pipeline driven directly
    refuses it too."""
    from omni_core import Omni
    from omni_model_wan.i2v import WanImageToVideoPipeline

    encoded = []
    monkeypatch.setattr(WanImageToVideoPipeline, "prepare_encode", lambda self, s: encoded.append(s))
    with Omni(i2v22_dir, dtype="float32", warmup=False, cpu_threads=TEST_THREADS) as engine:
        with pytest.raises(ConfigError, match=r"needs the first frame of the video: give 'image'") as err:
            engine.generate("a cat", height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=STEPS,
                            use_tqdm=False)
    assert err.value.field == "image" and encoded == []
    monkeypatch.undo()
    _, omni = i2v22
    state = make_state(i2v22_dir, PROMPTS[1], 0, 1)
    state.request.images = []
    with pytest.raises(ConfigError, match="give 'image'") as err:
        omni.prepare_encode(state)
    assert err.value.field == "image"


def test_folder_naming_the_pil_image_processor_loads(i2v21_dir, tmp_path):
    """Saved without torchvision, diffusers names ``CLIPImageProcessorPil`` in model_index.json; released
    folders name ``CLIPImageProcessor`` (the fixture's folder): both load."""
    import json
    import shutil

    from omni_core.config import OmniDiffusionConfig
    from omni_core.pipelines import load_pipeline

    folder = shutil.copytree(i2v21_dir, tmp_path / "pil")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    index["image_processor"][1] = "CLIPImageProcessorPil"
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(resolve_model(str(folder)), OmniDiffusionConfig(model=str(folder), dtype="float32"), "cpu",
                         torch.float32)
    assert type(pipe.pipe.image_processor).__name__.startswith("CLIPImageProcessor")


def test_wan21_max_sequence_length_must_be_512(i2v21_dir, i2v22_dir):
    from omni_model_wan.i2v import WanImageToVideoPipeline

    with pytest.raises(ConfigError, match=r"max_sequence_length=64 .*exactly 512 text tokens") as err:
        WanImageToVideoPipeline.check_sampling_params(SamplingParams(max_sequence_length=64, height=16, width=16,
                                                                     num_frames=5), i2v21_dir)
    assert err.value.field == "max_sequence_length"
    ok = WanImageToVideoPipeline.check_sampling_params(SamplingParams(max_sequence_length=64, height=16, width=16,
                                                                      num_frames=5), i2v22_dir)
    assert ok.max_sequence_length == 64  # Wan 2.2 I2V has no image tokens: any length


def test_engine_matches_diffusers(i2v21_dir, i2v21):
    """``Omni(model=<folder>, step_execution=True)`` end to end with ``{"prompt", "image"}`` and vLLM-Omni's
    ``multi_modal_data`` prompts: PIL frames within one level (the request path is ``forward``, tested above)."""
    from diffusers.image_processor import VaeImageProcessor

    from omni_core import Omni

    ref_pipe, _ = i2v21
    prompts = [{"prompt": PROMPTS[0], "negative_prompt": NEG, "image": IMAGES[0]},
               {"prompt": PROMPTS[1], "negative_prompt": NEG, "multi_modal_data": {"image": IMAGES[2]}}]
    with Omni(i2v21_dir, dtype="float32", warmup=False, max_num_seqs=2, step_execution=True,
              cpu_threads=TEST_THREADS) as omni:
        outs = omni.generate(prompts, seed=10, height=SIZE, width=SIZE, num_frames=FRAMES,
                             num_inference_steps=STEPS, guidance_scale=6.0, use_tqdm=False)
    assert [o.metrics["batch_size"] for o in outs] == [2, 2]  # images of different sizes share the wave
    for (p, i, neg), out in zip([(PROMPTS[0], 0, NEG), (PROMPTS[1], 2, NEG)], outs):
        video = reference(ref_pipe, p, i, 10, negative=neg, g=6.0)[0][0]
        ref = VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(video))
        frames = out.images[0]
        assert len(frames) == FRAMES
        for got, want in zip(frames, ref):
            assert np.abs(np.asarray(got, dtype=np.int16) - np.asarray(want, dtype=np.int16)).max() <= 1
