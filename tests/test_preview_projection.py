"""Preview projections (omni_core/pipelines/preview.py, issue #37): the least-squares fit, where a pipeline's
projection comes from (the model folder's file before the plugin's shipped entries, matched by VAE config), the
rendering of images and videos (four frames tiled 2x2, still ``[3, h, w]``), the tiny-decoder engine option, and
the ``omni preview calibrate`` command. Model-specific fidelity is checked in each model plugin's tests."""

from __future__ import annotations

import json

import pytest
import torch

from omni_core.config import OmniDiffusionConfig, SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines.preview import (PROJECTION_FILE, LatentProjection, channel_preview, find_projection,
                                         render_preview, tile_frames, write_projection)
from omni_core.pipelines.preview_fit import choose_kernel, fit_projection, pool_target, psnr
from omni_core.pipelines.state import StepState, remember_flow_step
from omni_core.request import OmniDiffusionRequest

W = [[0.2, -0.1, 0.05, 0.0], [0.0, 0.15, -0.2, 0.1], [-0.05, 0.0, 0.1, 0.25]]
B = [0.5, 0.45, 0.55]


def test_least_squares_recovers_a_linear_map_and_a_neighbourhood_one():
    gen = torch.Generator().manual_seed(0)
    true = LatentProjection(W, B)
    lats = [torch.randn(4, 6, 8, generator=gen) * 0.25 for _ in range(3)]  # inside [0, 1]: no clamping
    fitted = fit_projection(((lat, true.apply(lat)) for lat in lats), ridge=1e-9)
    assert fitted.kernel == 1 and fitted.channels == 4
    assert torch.allclose(torch.tensor(fitted.weight), torch.tensor(W), atol=2e-3)
    assert torch.allclose(torch.tensor(fitted.bias), torch.tensor(B), atol=2e-3)
    # a 3x3 map (a linear convolution) is recovered by kernel=3, and the held-out choice prefers it
    conv = LatentProjection((torch.randn(3, 4, 3, 3, generator=gen) * 0.05).tolist(), B)
    recs = [{"prompt": f"p{i}", "seed": i, "latents": lat, "target": conv.apply(lat)}
            for i, lat in enumerate(lats + [torch.randn(4, 6, 8, generator=gen) * 0.25])]
    k, scores = choose_kernel(recs)
    assert k == 3 and scores[3] > scores[1] + 10, scores
    fitted3 = fit_projection(((r["latents"], r["target"]) for r in recs), kernel=3, ridge=1e-9)
    assert psnr(fitted3.apply(lats[0]), conv.apply(lats[0])) > 50


def test_video_latents_project_per_frame_and_pool_by_causal_groups():
    proj = LatentProjection(W, B)
    video = torch.randn(4, 3, 5, 6)
    out = proj.apply(video)
    assert out.shape == (3, 3, 5, 6)
    assert torch.allclose(out[:, 1], proj.apply(video[:, 1]))
    # 9 pixel frames over 3 latent frames: frame 0 alone, then groups of 4
    decoded = torch.arange(9, dtype=torch.float32).view(9, 1, 1, 1).expand(9, 3, 10, 12)
    target = pool_target(decoded, video)
    assert target.shape == (3, 3, 5, 6)
    assert target[0, :, 0, 0].tolist() == [0.0, 2.5, 6.5]
    grid = tile_frames(torch.rand(4, 3, 5, 6))
    assert grid.shape == (3, 10, 12)  # 2x2 keeps the aspect ratio


def test_comfy_factors_map_minus_one_one_to_unit_range():
    proj = LatentProjection.from_comfy_factors([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], [0.0, -1.0, 1.0])
    assert proj.weight == ((0.5, 0.0), (0.0, 1.0), (0.0, 0.0)) and proj.bias == (0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="3 x C"):
        LatentProjection([[1.0, 2.0]], [0.0, 0.0, 0.0])


class _Shipped:
    preview_projections = "omni_test_preview_pkg:projections.json"


@pytest.fixture
def shipped_package(tmp_path, monkeypatch):
    pkg = tmp_path / "omni_test_preview_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "projections.json").write_text(json.dumps({"projections": [
        {"match": {"_class_name": "VaeA", "scaling_factor": 0.5, "sizes": [1, 2]}, **LatentProjection(W, B, "A").to_json()},
        {"match": {"_class_name": "VaeB"}, **LatentProjection([[0.0] * 2] * 3, B, "B").to_json()}]}))
    monkeypatch.syspath_prepend(str(tmp_path))
    return pkg


def test_the_folder_file_comes_first_then_the_shipped_entry_matching_the_vae(shipped_package, tmp_path):
    vae = {"_class_name": "VaeA", "scaling_factor": 0.50000001, "sizes": [1, 2], "other": 3}
    proj, where = find_projection(_Shipped, None, 4, vae)
    assert proj is not None and proj.source == "A" and "omni_test_preview_pkg" in where
    assert find_projection(_Shipped, None, 4, {**vae, "sizes": [1, 3]})[0] is None  # another VAE
    assert find_projection(_Shipped, None, 2, {"_class_name": "VaeB"})[0].source == "B"
    assert find_projection(_Shipped, None, 5, vae)[0] is None  # channel count differs
    folder = tmp_path / "model"
    folder.mkdir()
    write_projection(str(folder), LatentProjection([[1.0] * 4] * 3, [0.0] * 3, "mine"), fit={"psnr": 1.0})
    assert find_projection(_Shipped, str(folder), 4, vae)[0].source == "mine"
    assert find_projection(_Shipped, str(folder), 2, {"_class_name": "VaeB"})[0].source == "B"  # wrong size: skipped
    (folder / PROJECTION_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match=PROJECTION_FILE):
        find_projection(_Shipped, str(folder), 4, vae)


class _FakePipeline:
    """The preview side of a pipeline: latents [1, C, (F,) h, w], preview_latents the first row."""

    preview_projections = None

    def __init__(self, model_path=None):
        self.omni_model_path = model_path

    def preview_latents(self, state):
        return state.latents[0]


def _state(latents, x0=None):
    st = StepState(request=OmniDiffusionRequest(prompt="p", sampling_params=SamplingParams()), latents=latents)
    if x0 is not None:  # x0 = sample - sigma * velocity with sigma 1
        remember_flow_step(st, x0 + 1.0, torch.tensor(1.0), torch.ones_like(x0))
    return st


def test_render_uses_the_clean_estimate_and_tiles_video_frames(tmp_path):
    write_projection(str(tmp_path), LatentProjection(W, B))
    pipe = _FakePipeline(str(tmp_path))
    lat, x0 = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    shown = render_preview(pipe, _state(lat, x0))
    # the clean estimate is (x0 + 1) - 1 in float32: x0 up to rounding (where the projection clamps at 0, a value
    # that rounds to +3e-8 is not clamped: allclose's atol of 1e-8 failed 56 seeds in 3000)
    close = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shown, LatentProjection(W, B).apply(x0[0]), **close)
    assert torch.allclose(render_preview(pipe, _state(lat)), LatentProjection(W, B).apply(lat[0]))  # no step yet
    video = torch.randn(1, 4, 7, 6, 8)
    shown = render_preview(pipe, _state(video, video * 0.5))
    frames = LatentProjection(W, B).apply(video[0] * 0.5)
    assert shown.shape == (3, 12, 16)
    torch.testing.assert_close(shown[:, :6, :8], frames[:, 0], **close)
    torch.testing.assert_close(shown[:, 6:, 8:], frames[:, 6], **close)
    # without any projection: the old channel preview (first three channels min-max scaled)
    bare = _FakePipeline(None)
    assert torch.allclose(render_preview(bare, _state(lat, x0)), channel_preview(x0[0]))
    assert render_preview(bare, _state(None)) is None


def test_a_tiny_decoder_named_by_the_engine_option_decodes_the_preview(tmp_path):
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8), num_encoder_blocks=(1, 1),
                    num_decoder_blocks=(1, 1), latent_channels=4).save_pretrained(tmp_path / "taesd")
    folder = str(tmp_path / "taesd")
    assert OmniDiffusionConfig(model="m", preview_decoder=folder).preview_decoder == folder
    with pytest.raises(ConfigError) as err:
        OmniDiffusionConfig(model="m", preview_decoder=str(tmp_path))
    assert err.value.field == "preview_decoder"
    pipe = _FakePipeline(None)
    pipe.omni_preview_decoder = folder
    shown = render_preview(pipe, _state(torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)))
    assert shown.dim() == 3 and shown.shape[0] == 3 and shown.shape[1] * 8 == shown.shape[2] * 6
    assert shown.shape[1] > 6 and 0 <= float(shown.min()) and float(shown.max()) <= 1  # decoded: upsampled
    assert pipe._omni_preview_plans[4][0] == "decoder"
    wrong = _FakePipeline(None)  # a decoder for other latents: the projection (here: channels) instead
    wrong.omni_preview_decoder = folder
    assert render_preview(wrong, _state(torch.randn(1, 3, 6, 8))).shape == (3, 6, 8)


def test_the_preview_command_is_registered():
    from omni_core.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["preview", "calibrate", "--model", "m", "--kernel", "1", "--write"])
    assert args.kernel == "1" and args.write and callable(args.func)


def test_calibrate_command_writes_a_projection_the_folder_then_uses(tmp_path, capsys):
    from omni_model_shapes.testing import build_random_shapes

    from omni_core.cli.main import main

    folder = build_random_shapes(tmp_path / "shapes")
    out = tmp_path / "fit.json"
    assert main(["preview", "calibrate", "--model", str(folder), "--prompts", "2", "--steps", "2", "--kernel", "1",
                 "--write", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PSNR" in printed and PROJECTION_FILE in printed
    report = json.loads(out.read_text())["fit"]
    assert report["decodes"] == 4 and report["kernel"] == 1
    assert report["psnr_projection"] > report["psnr_channel_preview"] + 6
    proj, where = find_projection(type("P", (), {}), str(folder), 3, {})
    assert where.endswith(PROJECTION_FILE) and proj.source.startswith("fitted by omni preview calibrate")
