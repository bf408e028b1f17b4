"""``omni generate``: the README's first command, run as written (the console script in a subprocess), prints the
seed it used; ``--seed`` reproduces an image, different seeds differ, ``--no-warmup`` skips the warm-up and
``--image`` feeds an edit model (the command's ``main`` in this process: the script's own start is checked once,
above, and each start costs ~8 s of imports on the 2 CI cores)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

README_COMMAND = ["generate", "--prompt", "a red circle in the top left", "--out", "circle.png"]


def omni(omni_env, cwd, *args):
    """The installed ``omni`` console script, run in ``cwd`` (relative ``--out`` paths as in the README)."""
    return subprocess.run([str(Path(sys.executable).parent / "omni"), *args], capture_output=True, text=True,
                          env=omni_env(), cwd=cwd, timeout=300)


def generate(omni_env, cwd, *args):
    proc = omni(omni_env, cwd, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture
def omni_main(capsys, monkeypatch, tmp_path):
    """``omni_main(*args) -> (exit code, stdout, stderr)``: the ``omni`` command's ``main`` in this process, in
    ``tmp_path`` (relative ``--out`` paths as in the README)."""
    from omni_core.cli.main import main

    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err
    return run


def generated(omni_main, *args) -> str:
    code, out, err = omni_main(*args)
    assert code == 0, err[-3000:]
    return out


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_readme_command_prints_its_seed_and_seeds_reproduce_images(omni_env, omni_main, tmp_path):
    out = generate(omni_env, tmp_path, *README_COMMAND)
    assert "wrote circle.png" in out
    seed = int(re.search(r"\bseed=(\d+)\b", out).group(1))
    first = pixels(tmp_path / "circle.png")

    again = generated(omni_main, *README_COMMAND[:-1], "again.png", "--seed", str(seed))
    assert f"seed={seed} " in again
    assert np.array_equal(pixels(tmp_path / "again.png"), first)  # the printed seed is the one that was used

    # another seed, another image (that one seed gives one image is the run above)
    assert "seed=0 " in generated(omni_main, *README_COMMAND[:-1], "zero.png", "--seed", "0")
    assert seed != 0 and not np.array_equal(pixels(tmp_path / "zero.png"), first)


def test_no_warmup_skips_a_failing_warmup(omni_main, tiny_model, tmp_path):
    model = tmp_path / "failing-warmup"
    model.mkdir()
    shutil.copy(f"{tiny_model}/denoiser.pt", model / "denoiser.pt")
    (model / "model_index.json").write_text(json.dumps({"_class_name": "FailingWarmupPipeline"}))
    args = ["generate", "--model", str(model), "--prompt", "x", "--out", "x.png"]
    code, _, err = omni_main(*args)
    assert code != 0 and "warmup=False" in err and "--no-warmup" in err
    assert not (tmp_path / "x.png").exists()
    assert "wrote x.png" in generated(omni_main, *args, "--no-warmup")
    assert (tmp_path / "x.png").exists()


def test_image_input_for_an_edit_model(omni_main, tiny_model, tmp_path):
    """``--image PATH`` feeds an edit model (the test-only TinyEditTestPipeline); the image changes the result; a
    missing file or a text model is refused naming the image."""
    model = tmp_path / "tiny-edit"
    model.mkdir()
    shutil.copy(f"{tiny_model}/denoiser.pt", model / "denoiser.pt")
    (model / "model_index.json").write_text(json.dumps({"_class_name": "TinyEditTestPipeline"}))
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / name)
    args = ["generate", "--model", str(model), "--prompt", "edit it", "--seed", "1", "--steps", "2", "--native-size"]
    generated(omni_main, *args, "--image", "a.png", "--out", "from-a.png")
    generated(omni_main, *args, "--image", "b.png", "--out", "from-b.png")
    assert np.abs(pixels(tmp_path / "from-a.png") - pixels(tmp_path / "from-b.png")).max() > 10
    code, _, err = omni_main(*args, "--image", "nope.png", "--out", "x.png")
    assert code != 0 and "--image 'nope.png': no such file" in err
    code, _, err = omni_main("generate", "--model", tiny_model, "--prompt", "x", "--image", "a.png", "--no-warmup",
                             "--out", "x.png")
    assert code != 0 and "does not take input images" in err


def test_fps_sets_the_frame_rate_of_a_model_whose_frames_have_one():
    """``--fps`` is LTX-2's ``frame_rate`` (its sound follows it) and defaults to it; for other models it only
    writes the file (16 by default); both flags disagreeing is refused before anything loads."""
    import argparse

    from omni_core.cli.generate import video_fps
    from omni_core.errors import ConfigError
    from omni_core.plugins.types import PipelineSpec
    from omni_core.sampling_fields import SamplingField

    field = SamplingField(name="frame_rate", type="float", default=24.0)
    own = PipelineSpec(name="P", impl="m:P", sampling_fields=(field,), fps_field="frame_rate")
    plain = PipelineSpec(name="Q", impl="m:Q", sampling_fields=(field,))
    args = argparse.Namespace(fps=None, model="ltx2")
    sampling: dict = {}
    assert video_fps(args, own, sampling) == 24.0 and sampling == {}
    assert video_fps(argparse.Namespace(fps=30, model="ltx2"), own, sampling) == 30 and sampling == {"frame_rate": 30}
    assert video_fps(args, own, {"frame_rate": 25.0}) == 25.0
    assert video_fps(args, plain, {}) == 16 and video_fps(argparse.Namespace(fps=8, model="m"), plain, {}) == 8
    with pytest.raises(ConfigError, match="--fps 30 and --frame-rate 25.0 disagree") as err:
        video_fps(argparse.Namespace(fps=30, model="ltx2"), own, {"frame_rate": 25.0})
    assert err.value.field == "fps"
