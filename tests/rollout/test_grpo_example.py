"""The example trainer (``docs/examples/grpo_shapes.py``, issue #52), short: GRPO on ``shapes`` sampling through
Omni with log-probs and syncing its weights back each iteration; the last rollout's mean reward exceeds the
first's by more than three standard errors (of the first's mean). The script itself checks that its recomputed
log-probs equal Omni's at the first update and that each sync's checksum is the engine's."""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "examples" / "grpo_shapes.py"


def test_the_reward_rises_by_more_than_three_standard_errors():
    spec = importlib.util.spec_from_file_location("grpo_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.train(iterations=7, log=lambda line: None)
    first, last = history[0], history[-1]
    se = statistics.stdev(first) / math.sqrt(len(first))
    assert statistics.mean(last) > statistics.mean(first) + 3 * se, [round(statistics.mean(h), 3) for h in history]
