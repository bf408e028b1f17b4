"""``scripts/gpu_check.sh`` dry-runs on the CPU (``DEVICE=cpu``: the same steps, shrunken) in under a minute, so
the one GPU script cannot rot between the rare runs on a real device (issue #36)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_every_section(tmp_path):
    # a clean shell's environment: not this session's pytest options, OMNI_ switches or test-only PYTHONPATH
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "OMNI_")) and k != "PYTHONPATH"}
    env.update(DEVICE="cpu", OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert result["device"] == "cpu" and result["seconds"] < 60, result["seconds"]
    for name in ("tests", "sdpa"):  # the gpu selection collects
        assert sections[name]["exit"] == 0, sections[name]["tail"]
        assert any("collected" in line for line in sections[name]["tail"]), sections[name]["tail"]
    for name in ("probe_kernels", "probe_engine_process", "probe_peak_memory_per_request",
                 "bench_qwen_transformer"):
        assert sections[name]["ok"], (name, sections[name].get("error"), sections[name].get("traceback"))
    engine = sections["probe_engine_process"]
    assert engine["engine_cuda_initialised"] is False and engine["output_device"] == "cpu"
    rows = sections["bench_qwen_transformer"]["rows"]
    assert rows["diffusers"]["s_per_step"] > 0
    assert rows["omni TORCH_SDPA"]["max_abs_diff_vs_diffusers"] < 1e-4, rows["omni TORCH_SDPA"]
    assert not [k for k in sections if k.endswith(" process")], sections
