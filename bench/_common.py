"""Shared set-up for the benchmarks: which model to run (the test pipeline plugin by default)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_test_model() -> str:
    """Install the test-only pipeline plugin into a temp dir (as the tests do) and save its tiny model."""
    target = tempfile.mkdtemp(prefix="omni-bench-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    target, str(ROOT / "tests/fixtures/dists/omni-test-pipeline")], check=True)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (target, os.environ.get("PYTHONPATH")) if p)
    from omni_test_pipeline.pipeline import TinyTestPipeline

    path = tempfile.mkdtemp(prefix="omni-bench-model-")
    TinyTestPipeline.save(path)
    return path


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--model", default=None, help="model name or folder (default: the tiny test pipeline)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps per request (default: model default)")
    p.add_argument("--size", type=int, default=None, help="height and width (default: model default)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads per model process, the same for every row (default: the engine's policy)")
    return p


def engine_config(args, **config) -> dict:
    """Engine keyword arguments every row of a benchmark shares: limits that admit ``--size``/``--steps``
    and the thread policy."""
    out = {"limits": limits(args), **config}
    if args.cpu_threads is not None:
        out["cpu_threads"] = args.cpu_threads
    return out


def thread_header(args) -> str:
    """The thread policy every row ran with, for the header."""
    import os

    from omni_core.config import OmniDiffusionConfig
    from omni_core.platforms.threads import thread_policy

    policy = thread_policy(OmniDiffusionConfig(model="-", cpu_threads=args.cpu_threads))
    return f"{policy}; load average {os.getloadavg()[0]:.2f}"


def resolve(args) -> str:
    return args.model or tiny_test_model()


def sampling(args, **extra):
    from omni_core import SamplingParams

    kw = {k: v for k, v in (("num_inference_steps", args.steps), ("height", args.size), ("width", args.size))
          if v is not None}
    return SamplingParams(**kw, **extra)


def limits(args) -> dict:
    """Engine limits that admit this run's ``--size``/``--steps`` (a benchmark may go past a model's defaults)."""
    out = {}
    if args.size is not None:
        out["max_pixels"] = args.size * args.size
    if args.steps is not None:
        out["max_steps"] = args.steps
    return out
