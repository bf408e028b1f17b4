"""The engine-side rules read from the folder without torch: the size buckets equal diffusers' own function, the
T2V default size and guidance come from the folder, and a size off the VAE x patch multiple is refused naming it."""

from __future__ import annotations

import pytest

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_model_hunyuan_video15.fields import bucket_size, shape_rules
from omni_model_hunyuan_video15.pipeline import HunyuanVideo15Pipeline


@pytest.mark.parametrize("target,spatial", [(640, 16), (960, 16), (32, 4)])
def test_buckets_equal_diffusers(target, spatial):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    proc = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial)
    for h, w in [(9, 16), (16, 9), (1, 1), (480, 848), (1080, 1920), (37, 101), (700, 300)]:
        assert bucket_size(h, w, target, spatial) == tuple(proc.calculate_default_height_width(h, w, target))


def test_defaults_and_sizes_come_from_the_folder(hv_dir):
    assert shape_rules(hv_dir) == (4, 4, 4) and shape_rules(None) == (16, 16, 4)
    params = HunyuanVideo15Pipeline.check_sampling_params(SamplingParams(), hv_dir)
    assert (params.height, params.width) == bucket_size(9, 16, 32, 4)
    assert params.guidance_scale == 6.0 and params.num_frames == 121 and params.num_inference_steps == 50
    assert HunyuanVideo15Pipeline.check_sampling_params(SamplingParams(), None).width == 848
    with pytest.raises(ConfigError, match="width=18 is not allowed") as info:
        HunyuanVideo15Pipeline.check_sampling_params(SamplingParams(height=16, width=18), hv_dir)
    assert info.value.field == "width"
    assert HunyuanVideo15Pipeline.check_sampling_params(SamplingParams(num_frames=7), hv_dir).num_frames == 5
