"""``performance_mode`` presets (never overriding what the user set), ``stats()["model_bytes"]``, the metrics
endpoint, and ``omni env``'s quantization rows and ``--model`` preset line."""

from __future__ import annotations

from omni_core.config import OmniDiffusionConfig
from omni_core.optimize.presets import choose


def test_memory_preset_fills_unset_options_only(qwen_dir):
    changes, report = choose(OmniDiffusionConfig(model=qwen_dir, performance_mode="memory"), qwen_dir, _cpu())
    assert changes == {"quantization": "int8", "vae_tiling": True, "vae_slicing": True}  # no offload on CPU
    changes, report = choose(OmniDiffusionConfig(model=qwen_dir, performance_mode="memory", quantization="none",
                                                 vae_slicing=False), qwen_dir, _cpu())
    assert changes == {"vae_tiling": True}
    assert report["kept"] == {"quantization": "none", "vae_slicing": False}


def test_speed_and_auto_presets(qwen_dir):
    assert choose(OmniDiffusionConfig(model="shapes", performance_mode="speed"), qwen_dir, _cpu())[0] == {
        "compile": True}
    assert choose(OmniDiffusionConfig(model="shapes", performance_mode="speed", compile=False), qwen_dir,
                  _cpu())[0] == {}
    changes, report = choose(OmniDiffusionConfig(model=qwen_dir, performance_mode="auto"), qwen_dir, _cpu())
    assert report["fits"] and changes == {}  # a few MB fit; nothing is worth a compile on CPU
    assert choose(OmniDiffusionConfig(model=qwen_dir), qwen_dir, _cpu())[0] == {}  # no preset: nothing


def _cpu():
    import torch

    return torch.device("cpu")


def test_stats_model_bytes_and_metrics(qwen_dir):
    from omni_core.entrypoints.omni import Omni
    from omni_core.serve.metrics import ServerMetrics

    with Omni("shapes", performance_mode="memory", warmup=False) as omni:
        stats = omni.engine.stats()
        assert omni.engine.config.quantization == "int8"  # the preset's choice reached the engine
        text = ServerMetrics().render({"shapes": stats}, video_jobs={})
    mb = stats["model_bytes"]
    assert set(mb) == {"text_encoder", "transformer"} and all(v > 0 for v in mb.values())
    assert mb["transformer"] < 0.35 * 8503488  # int8 (float32: 8503488 bytes)
    assert f'omni_model_bytes{{model="shapes",component="transformer"}} {mb["transformer"]}' in text


def test_omni_env_lists_methods_and_the_preset(qwen_dir, capsys):
    from omni_core.cli.env import collect_env, format_env

    env = collect_env(model=qwen_dir)
    rows = {r["name"]: r for r in env["quantization"]}
    assert rows["int8"]["usable"] and rows["gguf"]["usable"]
    preset = env["performance_modes"]
    assert preset["memory"]["chose"] == {"quantization": "int8", "vae_tiling": True, "vae_slicing": True}
    text = format_env(env)
    assert "quantization methods (usable here?)" in text and "performance_mode=memory" in text
