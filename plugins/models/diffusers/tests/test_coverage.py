"""``omni env --diffusers`` and ``omni plugins list`` say, per diffusers pipeline class, how it runs here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_diffusers_class_is_native_own_call_or_refused_with_the_reason():
    from omni_core.cli.coverage import coverage_rows
    from omni_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    rows = {r["class"]: r for r in coverage_rows(pm)}
    native = {n for n, s in pm.components("pipeline").items() if not s.serves_any_folder}
    assert len(rows) > 200
    for name in native & set(rows):
        assert rows[name]["runs"] == "native"
    assert rows["StableDiffusionPipeline"]["runs"] == "own call" and "no step mode" in rows["StableDiffusionPipeline"][
        "gives"]
    # tier 2 where diffusers maps the class to modular blocks (what ModularPipeline.from_pretrained would load)
    for name in ("StableDiffusion3Pipeline", "StableDiffusionXLPipeline", "LTXPipeline"):
        assert rows[name]["runs"] == "modular steps" and "ModularPipeline" in rows[name]["gives"], rows[name]
    assert rows["StableDiffusionImg2ImgPipeline"]["runs"] == "own call"
    assert rows["WanImageToVideoPipeline"]["runs"] == ("native" if "WanImageToVideoPipeline" in native
                                                       else "modular steps")
    refused = {"StableDiffusionInpaintPipeline": "mask image", "AudioLDMPipeline": "makes audio",
               "DDPMPipeline": "takes no prompt", "CogVideoXVideoToVideoPipeline": "input video"}
    for name, words in refused.items():
        assert rows[name]["runs"] == "not served" and words in rows[name]["gives"], rows[name]


def test_omni_env_and_plugins_list_say_it():
    omni = [str(Path(sys.executable).parent / "omni")]
    env = json.loads(subprocess.run([*omni, "env", "--diffusers", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    runs = {r["class"]: r["runs"] for r in env["diffusers_classes"]}
    assert runs["SanaPipeline"] == "own call" and runs["StableDiffusion3Pipeline"] == "modular steps"
    assert "'diffusers' (omni-model-diffusers" in env["any_folder"]
    listed = subprocess.run([*omni, "plugins", "list"], capture_output=True, text=True, check=True).stdout
    assert "any other diffusers folder runs through 'diffusers'" in listed and "omni env --diffusers" in listed
