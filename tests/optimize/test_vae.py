"""VAE slicing and tiling (diffusers' own ``enable_slicing`` / ``enable_tiling`` on the pipeline's VAE)."""

from __future__ import annotations

import pytest
import torch

from omni_core.errors import ConfigError

from .conftest import QWEN_SIZE, load, run_qwen

#: tiles smaller than the 32x32 image (latent tiles of 2x2, overlapping): the seams are blended
SMALL_TILES = {"tile_sample_min_height": 16, "tile_sample_min_width": 16, "tile_sample_stride_height": 12,
               "tile_sample_stride_width": 12}


@pytest.fixture(scope="module")
def plain(qwen_plain):
    return qwen_plain[1:]


def test_slicing_matches_the_batched_decode(qwen_dir, plain):
    got, _ = run_qwen(load(qwen_dir, vae_slicing=True))
    torch.testing.assert_close(got, plain[0], atol=1e-5, rtol=0)


def test_tiling_with_a_tile_covering_the_image_is_exact(qwen_dir, plain):
    got, _ = run_qwen(load(qwen_dir, vae_tiling=True))  # default tiles: 256 px
    # the same computation; only float rounding may differ (the session fixture may have run at another torch
    # thread count: an engine with cpu_threads=1 earlier in the session sets it for the process)
    torch.testing.assert_close(got, plain[0], atol=1e-6, rtol=0)


def test_small_tiles_equal_diffusers_tiled_decode_of_the_same_latents(qwen_dir, plain):
    import os

    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline
    from diffusers.image_processor import VaeImageProcessor

    got, states = run_qwen(load(qwen_dir, vae_tiling=SMALL_TILES))
    assert (got - plain[0]).abs().max() > 1e-3  # the tiles really changed the decode
    vae = AutoencoderKLQwenImage.from_pretrained(os.path.join(qwen_dir, "vae"))  # diffusers' own, from the folder
    vae.enable_tiling(**SMALL_TILES)
    vsf = 2 ** len(vae.temperal_downsample)
    latents = torch.cat([s.latents for s in states])
    with torch.no_grad():  # diffusers QwenImagePipeline.__call__'s decode, step by step
        lat = QwenImagePipeline._unpack_latents(latents, QWEN_SIZE["height"], QWEN_SIZE["width"], vsf)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
        image = vae.decode(lat / std + mean, return_dict=False)[0][:, :, 0]
        expected = VaeImageProcessor(vae_scale_factor=vsf * 2).postprocess(image, output_type="pt")
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_vae_options_on_a_model_without_a_vae_are_refused():
    with pytest.raises(ConfigError, match="has no VAE") as exc:
        load("shapes", vae_tiling=True)
    assert exc.value.field == "vae_tiling"


def test_bad_tile_options_name_the_field(qwen_dir):
    with pytest.raises(ConfigError, match="refused the options") as exc:
        load(qwen_dir, vae_tiling={"tile_size": 3})
    assert exc.value.field == "vae_tiling"
