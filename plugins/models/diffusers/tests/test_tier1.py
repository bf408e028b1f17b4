"""Any diffusers pipeline through Omni: the pipeline's own output bit for bit, alone and as one batched call of four
prompts of different lengths (one seed each), over ten tiny families (UNet and DiTs, images and videos, flow
matching and DDPM-style schedulers, image inputs)."""

from __future__ import annotations

import pytest
import torch

from omni_model_diffusers.parity import PROMPTS, omni_fields, reference, reference_call
from omni_model_diffusers.testing import FAMILIES, example_image

SEEDS = [11, 12, 13, 14]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_omni_gives_the_pipelines_own_output_alone_and_batched(family, name):
    from omni_core import Omni
    from omni_core.config import SamplingParams

    fam = FAMILIES[name]
    path = family(name)
    image = example_image(32, 32) if fam.image_input else None
    fields = omni_fields(fam.call_kwargs)
    prompt = (lambda p: {"prompt": p, "image": image}) if image is not None else (lambda p: p)
    with Omni(path, pipeline="diffusers", warmup=False, cpu_threads=1, max_num_seqs=4) as omni:
        assert omni.engine.pipeline_cls.diffusers_class == fam.pipeline_class
        (alone,) = omni.generate(prompt(PROMPTS[0]), seed=SEEDS[0], output_type="pt", use_tqdm=False, **fields)
        params = [SamplingParams(seed=s, output_type="pt", **fields) for s in SEEDS]
        batch = omni.generate([prompt(p) for p in PROMPTS], sampling_params=params, use_tqdm=False)
        waves = omni.stats()["timing"]["waves"]
    pipe = reference(path)
    ref_alone = reference_call(pipe, fam, PROMPTS[:1], SEEDS[:1], image)
    try:
        ref_batch = reference_call(pipe, fam, PROMPTS, SEEDS, image)
    except ValueError:  # a pipeline that takes one input image per call (Wan image-to-video): one call each
        ref_batch = [reference_call(pipe, fam, [p], [s], image)[0] for p, s in zip(PROMPTS, SEEDS)]
    assert alone.status == "completed" and torch.equal(alone.images[0], ref_alone[0])
    assert [o.status for o in batch] == ["completed"] * 4
    for i, out in enumerate(batch):
        assert torch.equal(out.images[0], ref_batch[i]), f"{name}: row {i} differs from diffusers' batched call"
    assert waves == 2, "the four requests ran as one wave"


@pytest.mark.parametrize("name", ["sd", "sd3", "flux", "wan", "ltx", "wan-i2v"])
def test_the_start_up_warm_up_fits_every_size_rule(family, name):
    """The warm-up runs one step at 32 px (a multiple of the sizes diffusers' pipelines hard-code: SD's 8, LTX's
    and Sana's 32), whatever the folder's own multiple. (FLUX Kontext resizes its input to ~1 MP by default, which
    this tiny one-level VAE cannot take at start-up, and PixArt's and Sana's default resolution binning has no bucket
    for a tiny transformer's sample size: their tests start without the warm-up; real folders have both.)"""
    from omni_core import Omni

    with Omni(family(name), cpu_threads=1) as omni:
        assert omni.stats()["requests_completed"] == 1
