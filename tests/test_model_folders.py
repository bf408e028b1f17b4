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
