"""docs/plugins/models.md's joint-attention example is true: the guide shows ``docs/examples/joint_attention.py``
verbatim, and the script runs as the guide says (CPU, random weights, seconds)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "examples" / "joint_attention.py"
BLOCK = re.compile(r"<!-- example-script: joint_attention\.py -->\n\n?```python\n(.*?)```", re.S)


def test_guide_shows_the_script_verbatim():
    (shown,) = BLOCK.findall((ROOT / "docs" / "plugins" / "models.md").read_text())
    assert shown == SCRIPT.read_text(), "models.md's copy of docs/examples/joint_attention.py differs from the file"


def test_script_runs_and_its_checks_hold():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_") or k == "OMNI_STRICT_PLUGINS"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ok: 2 joint blocks, carried ['image', 'text']")
