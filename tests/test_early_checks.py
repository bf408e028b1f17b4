"""What needs no model is refused before the model loads (issue #37): the shape rules on the ``PipelineSpec``
record (``is_video``, ``size_multiple``, ``frame_multiple``, ``size_rules``), checked by ``omni generate`` and
``omni serve`` at once, agree with the classes; the server names the request field the client sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import pytest

from omni_core import hookimpl
from omni_core.errors import ConfigError, RecordMismatchError
from omni_core.plugins.types import PipelineSpec
from omni_core.pipelines.shape_check import check_shape, shape_rules

FIRST_PARTY = ("ShapesPipeline", "FluxPipeline", "QwenImagePipeline", "QwenImageEditPipeline",
               "QwenImageEditPlusPipeline", "WanPipeline", "WanImageToVideoPipeline", "ZImagePipeline")


def _omni(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    script = os.path.join(os.path.dirname(sys.executable), "omni")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
    t0 = time.perf_counter()
    proc = subprocess.run([script, *args], capture_output=True, text=True, timeout=120, env=env)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize(("args", "said"), [
    (("--height", "30"), "--height 30 is not allowed for ShapesPipeline: it must be a multiple of 4 (e.g. 28 or 32)"),
    (("--width", "33"), "--width 33 is not allowed for ShapesPipeline"),
    (("--num-frames", "5"), "--num-frames 5 is not allowed: ShapesPipeline makes images"),
    (("--steps", "0"), "--steps 0 is invalid: must be >= 1"),
])
def test_omni_generate_refuses_what_needs_no_model_in_under_2_s(args, said):
    proc, wall = _omni("generate", "--prompt", "a red circle", *args)
    assert proc.returncode == 1, proc.stderr
    assert said in proc.stderr, proc.stderr
    assert "loading" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr  # the model never loaded
    assert wall < 2.0, f"omni generate took {wall:.2f} s to refuse {args}"


def test_omni_serve_refuses_bad_start_up_options_before_loading():
    proc, wall = _omni("serve", "shapes", "--max-steps", "0", "--port", "0")
    assert proc.returncode == 1 and "--max-steps 0 is invalid" in proc.stderr, proc.stderr
    assert "loading" not in proc.stderr and wall < 5.0, (wall, proc.stderr)


@pytest.mark.parametrize("name", FIRST_PARTY)
def test_first_party_records_state_the_shape_rules_and_their_classes_agree(omni_plugin_manager, name):
    spec = omni_plugin_manager.get_component("pipeline", name)
    cls = omni_plugin_manager.load_component("pipeline", name)  # a disagreeing class is a RecordMismatchError
    assert spec.is_video is not None and spec.size_multiple is not None, f"{name}'s record states no shape rules"
    assert (spec.is_video, spec.size_multiple) == (bool(cls.is_video), cls.size_multiple)
    if spec.is_video:
        assert spec.frame_multiple == cls.frame_multiple
    # the released checkpoints (no folder): the early rules are the class's
    hm, wm, fm = shape_rules(spec, None)
    assert (hm, wm) == (cls.size_multiple, cls.size_multiple) and fm == (cls.frame_multiple if cls.is_video else None)


@pytest.mark.parametrize("name", ["FluxPipeline", "QwenImagePipeline", "ZImagePipeline", "WanPipeline"])
def test_folder_rules_match_the_pipelines_own_check(omni_plugin_manager, tmp_path, name):
    """A folder whose VAE halves the usual factor: the early check and check_sampling_params agree on what is
    allowed (no pipeline refuses what the early check let through, and the reverse)."""
    from omni_core.config import SamplingParams

    vae = {"FluxPipeline": {"block_out_channels": [4, 8, 16]}, "ZImagePipeline": {"block_out_channels": [4, 8, 16]},
           "QwenImagePipeline": {"temperal_downsample": [False, True]},
           "WanPipeline": {"scale_factor_spatial": 4, "scale_factor_temporal": 4}}[name]
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps(vae))
    spec = omni_plugin_manager.get_component("pipeline", name)
    cls = omni_plugin_manager.load_component("pipeline", name)
    hm, _, _ = shape_rules(spec, str(tmp_path))
    assert hm == 8
    frames = {"num_frames": 5} if spec.is_video else {}
    for height in (8, 24, 12, 30):
        params = SamplingParams.from_kwargs(height=height, width=16, num_inference_steps=2, **frames)
        try:
            cls.check_sampling_params(params, str(tmp_path))
            model_ok = True
        except ConfigError as exc:
            model_ok = exc.field != "height"
        try:
            check_shape(spec, str(tmp_path), height=height, width=16, **frames)
            early_ok = True
        except ConfigError:
            early_ok = False
        assert early_ok == model_ok == (height % 8 == 0), (name, height)


def test_a_class_restating_a_shape_rule_must_agree(register_omni_plugin, omni_plugin_manager, monkeypatch):
    from omni_core.pipelines.base import OmniPipeline

    module = types.ModuleType("omni_test_shape_mismatch")
    module.Eight = type("Eight", (OmniPipeline,), {"size_multiple": 8})
    module.Quiet = type("Quiet", (OmniPipeline,), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Plugin:
        @hookimpl
        def omni_register_pipelines(self):
            return [PipelineSpec(name="Eight", impl="omni_test_shape_mismatch:Eight", size_multiple=16),
                    PipelineSpec(name="Quiet", impl="omni_test_shape_mismatch:Quiet", is_video=True,
                                 size_multiple=32, frame_multiple=8)]

    register_omni_plugin(Plugin(), "shape-mismatch", dist="omni-shape-mismatch")
    with pytest.raises(RecordMismatchError) as info:
        omni_plugin_manager.load_component("pipeline", "Eight")
    assert info.value.field == "size_multiple" and "states size_multiple=8" in str(info.value)
    quiet = omni_plugin_manager.load_component("pipeline", "Quiet")  # left out: the class takes the record's
    assert (quiet.is_video, quiet.size_multiple, quiet.frame_multiple) == (True, 32, 8)


def test_a_record_without_shape_rules_checks_nothing_early():
    spec = PipelineSpec(name="Loose", impl="x:Loose")
    check_shape(spec, None, height=30, width=31, num_frames=7)  # the pipeline's own check decides, after loading


def test_a_bad_size_over_http_is_reported_as_size():
    from omni_core.serve.errors import APIError, config_error
    from omni_core.serve.protocol import parse_image_request

    with pytest.raises(APIError) as info:
        parse_image_request({"prompt": "x", "size": "100000x100000"})
    assert info.value.param == "size"
    assert info.value.message.startswith("'size' (WIDTHxHEIGHT): ") and "SamplingParams" not in info.value.message
    # the engine's refusal of a size the model cannot make, as the server reports it
    err = config_error(ConfigError("height=30 is not allowed for ShapesPipeline: it must be a multiple of 4",
                                   field="height"))
    assert err.param == "size" and err.message.startswith("'size' (WIDTHxHEIGHT): height=30 is not allowed")
