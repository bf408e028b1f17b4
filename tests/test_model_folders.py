"""Reading diffusers-format folders: a model_index.json (or config.json) that is not a JSON object is a
ConfigError naming the file, and component weights that exist only as pickles are refused before any loader
opens them (checked on the real Wan loader with a real ``torch.save`` file)."""

from __future__ import annotations

import json
import os

import pytest

from omni_core.errors import ConfigError
from omni_core.pipelines.base import read_model_index
from omni_core.pipelines.diffusers_folder import check_model_index, read_json, refuse_pickled_weights

BAD_JSON = [("{\"_class_name\": ", "not valid JSON"), ("[\"WanPipeline\"]", "JSON list, not an object"),
            ("\"WanPipeline\"", "JSON str, not an object"), ("\xff\xfe", "not valid JSON")]


@pytest.mark.parametrize("content, what", BAD_JSON)
def test_model_index_that_is_not_a_json_object_is_a_config_error(tmp_path, content, what):
    index = tmp_path / "model_index.json"
    index.write_bytes(content.encode("latin-1"))
    for read in (lambda: read_model_index(str(tmp_path)), lambda: check_model_index(str(tmp_path), "WanPipeline"),
                 lambda: read_json(str(index))):
        with pytest.raises(ConfigError, match=what) as info:
            read()
        assert str(index) in str(info.value) and info.value.field == "model"


def test_model_folder_resolution_names_the_bad_file(tmp_path):
    from omni_core.pipelines import resolve_model

    (tmp_path / "model_index.json").write_text("not json")
    with pytest.raises(ConfigError, match="model_index.json.* is not valid JSON"):
        resolve_model(str(tmp_path))


def test_good_and_missing_files_read_as_before(tmp_path):
    assert read_model_index(str(tmp_path)) is None and read_json(None) is None
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "X", "unet": ["diffusers", "U"]}))
    assert read_model_index(str(tmp_path)) == {"_class_name": "X", "unet": ["diffusers", "U"]}


def test_pickle_only_component_is_refused_and_mixed_is_accepted(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "diffusion_pytorch_model.ckpt").write_bytes(b"\x80\x04N.")
    with pytest.raises(ConfigError, match=r"vae.*diffusion_pytorch_model\.ckpt.*pickle"):
        refuse_pickled_weights(str(tmp_path), ["vae", "absent"])
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    refuse_pickled_weights(str(tmp_path), ["vae"])


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


@pytest.fixture(scope="module")
def tiny_wan_dir(tmp_path_factory):
    pytest.importorskip("omni_model_wan")
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny-wan"))


@pytest.mark.parametrize("component, weights", [("transformer", "diffusion_pytorch_model"),
                                                ("text_encoder", "model")])
def test_wan_loader_refuses_pickled_weights_before_unpickling(tiny_wan_dir, tmp_path, monkeypatch, component,
                                                              weights):
    import shutil

    import torch
    from omni_model_wan.pipeline import WanPipeline

    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, folder)
    marker = str(tmp_path / "unpickled.txt")
    os.remove(folder / component / f"{weights}.safetensors")
    pickle_path = str(folder / component / ("pytorch_model.bin" if weights == "model" else f"{weights}.bin"))
    torch.save({"weight": _RunsCodeWhenUnpickled(marker)}, pickle_path)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    with pytest.raises(ConfigError, match="pickle") as info:
        WanPipeline.load(str(folder))
    assert pickle_path in str(info.value)
    assert loads == [] and not os.path.exists(marker)


def test_qwen_image_loader_refuses_pickled_weights_before_unpickling(tmp_path, monkeypatch):
    pytest.importorskip("omni_model_qwen_image")
    import torch
    from omni_model_qwen_image.pipeline import QwenImagePipeline
    from omni_model_qwen_image.testing import build_tiny_qwen_image

    folder = build_tiny_qwen_image(tmp_path / "qwen", num_layers=1)
    marker = str(tmp_path / "unpickled.txt")
    os.remove(os.path.join(folder, "vae", "diffusion_pytorch_model.safetensors"))
    pickle_path = os.path.join(folder, "vae", "diffusion_pytorch_model.bin")
    torch.save({"weight": _RunsCodeWhenUnpickled(marker)}, pickle_path)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    with pytest.raises(ConfigError, match="pickle") as info:
        QwenImagePipeline.load(folder)
    assert pickle_path in str(info.value) and loads == [] and not os.path.exists(marker)


def test_diffusers_own_pipeline_modules_are_components_and_other_libraries_are_remote_code(tmp_path):
    """LTX-2's folders name their connectors and vocoder by diffusers' pipeline module (``"ltx2"``): they load
    from ``diffusers.pipelines.ltx2`` as diffusers' loader does; a library that is neither is refused."""
    from omni_core.utils.diffusers_folder import library_module

    assert library_module("ltx2") == "diffusers.pipelines.ltx2"
    assert library_module("transformers") == "transformers"
    for remote in ("my_models", "os", "../ltx2", "ltx2.evil", None):
        assert library_module(remote) is None, remote
    index = {"_class_name": "LTX2Pipeline", "vocoder": ["ltx2", "LTX2Vocoder"], "scheduler": [None, None]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert check_model_index(str(tmp_path), "LTX2Pipeline")["vocoder"] == ["ltx2", "LTX2Vocoder"]
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "vocoder": ["my_models", "Vocoder"]}))
    with pytest.raises(ConfigError, match="component 'vocoder' .* comes from library 'my_models'"):
        check_model_index(str(tmp_path), "LTX2Pipeline")


def test_a_config_only_stand_in_keeps_what_init_derives_from_the_config(tmp_path):
    """A stage's stand-in for a component it does not load (no weights) answers what the pipeline reads from it,
    also what ``__init__`` computes rather than stores (LTX-2's VAE compression ratios)."""
    import torch
    from diffusers import AutoencoderKLLTX2Video

    from omni_core.pipelines.stages import config_only_component

    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=2, patch_size_t=1)
    vae.save_pretrained(tmp_path / "vae")
    stand_in = config_only_component(str(tmp_path), "vae", "diffusers", "AutoencoderKLLTX2Video", torch.bfloat16)
    assert (stand_in.spatial_compression_ratio, stand_in.temporal_compression_ratio) == (4, 2) == \
        (vae.spatial_compression_ratio, vae.temporal_compression_ratio)
    assert sum(p.numel() for p in stand_in.parameters()) == 0 and stand_in.dtype == torch.bfloat16
