"""The pytest plugin's thread policy (``omni_core.testing``): each test starts at ``OMNI_TEST_THREADS`` torch threads,
whatever an earlier test's in-process engine set (its ``cpu_threads`` policy would otherwise outlive it)."""

from __future__ import annotations

import os
import subprocess
import sys

SUITE = '''
import torch

def test_an_in_process_engine_sets_its_own_count():
    torch.set_num_threads(2)

def test_the_next_test_starts_at_the_test_count():
    assert torch.get_num_threads() == 1
'''


def test_each_test_starts_at_the_test_thread_count(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "OMP_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path / "test_suite.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
