"""The CPU thread policy: the cgroup quota caps the thread budget, and a contended CPU drops a model process to
one thread until the pressure is gone (``omni_core.platforms.threads``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_core.platforms.threads import ContentionGauge, cgroup_cpu_quota, threads_per_process, usable_cpu_cores

AFFINITY = len(os.sched_getaffinity(0))
PSI = Path("/proc/pressure/cpu")


def fake_cgroup(tmp_path: Path, files: dict[str, str], self_cgroup: str = "0::/pod/app\n") -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "self").write_text(self_cgroup)
    return str(root), str(tmp_path / "self")


@pytest.mark.parametrize("files, want", [
    ({"pod/app/cpu.max": "100000 100000\n"}, 1.0),                              # v2, the process's own cgroup
    ({"pod/app/cpu.max": "max 100000\n", "pod/cpu.max": "150000 100000\n"}, 1.5),  # a parent's quota holds
    ({"pod/app/cpu.max": "300000 100000\n", "pod/cpu.max": "200000 100000\n"}, 2.0),  # the smallest along the way
    ({"pod/app/cpu.max": "max 100000\n"}, None),                                 # unlimited
    ({}, None),                                                                  # no cgroup files at all
])
def test_cgroup_v2_quota_is_read_along_the_process_cgroup(tmp_path, files, want):
    root, self_cgroup = fake_cgroup(tmp_path, files)
    assert cgroup_cpu_quota(root, self_cgroup) == want


def test_cgroup_v1_cfs_quota(tmp_path):
    root, self_cgroup = fake_cgroup(tmp_path, {"cpu,cpuacct/job/cpu.cfs_quota_us": "100000\n",
                                               "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"},
                                    self_cgroup="4:memory:/job\n2:cpu,cpuacct:/job\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 1.0
    (Path(root) / "cpu,cpuacct/job/cpu.cfs_quota_us").write_text("-1\n")  # v1's unlimited
    assert cgroup_cpu_quota(root, self_cgroup) is None


@pytest.mark.skipif(AFFINITY < 2, reason="needs two usable cores to show a quota below them")
def test_a_quota_below_the_cores_gives_that_many_threads(tmp_path):
    root, self_cgroup = fake_cgroup(tmp_path, {"pod/app/cpu.max": "150000 100000\n"})
    assert usable_cpu_cores(root, self_cgroup) == 1  # 1.5 cores: one thread, not two at a barrier
    root, self_cgroup = fake_cgroup(tmp_path / "b", {"pod/app/cpu.max": f"{100000 * (AFFINITY + 4)} 100000\n"})
    assert usable_cpu_cores(root, self_cgroup) == AFFINITY  # a quota above the cores changes nothing


@pytest.mark.skipif(AFFINITY < 2, reason="needs two usable cores to show a quota below them")
def test_omni_env_reports_the_quota_capped_budget(tmp_path):
    """End to end, as a user sees it: ``OMNI_CGROUP_ROOT`` points the policy at a cgroup tree whose root has a
    one-core quota (this process's own ``/proc/self/cgroup`` lines all resolve to that root's files)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("100000 100000\n")
    for v1 in ("cpu", "cpu,cpuacct"):
        (root / v1).mkdir()
        (root / v1 / "cpu.cfs_quota_us").write_text("100000\n")
        (root / v1 / "cpu.cfs_period_us").write_text("100000\n")
    env = {**os.environ, "OMNI_CGROUP_ROOT": str(root)}
    env.pop("OMP_NUM_THREADS", None)  # the test plugin sets it, and an explicit count would be the budget
    out = subprocess.run([sys.executable, "-m", "omni_core.cli", "env", "--json"], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    threads = json.loads(out.stdout)["cpu_threads"]
    assert threads["usable_cores"] == 1 and threads["per_model_process"] == 1, threads


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def psi_file(tmp_path: Path) -> tuple[Path, callable]:
    path = tmp_path / "cpu"
    total = [0]

    def stall(seconds: float) -> None:  # the kernel's "some" counter, in microseconds
        total[0] += int(seconds * 1e6)
        path.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total[0]}\n"
                        f"full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    stall(0)
    return path, stall


def test_gauge_drops_to_one_thread_under_pressure_and_comes_back_with_backoff(tmp_path):
    path, stall = psi_file(tmp_path)
    clock = FakeClock()
    gauge = ContentionGauge(str(path), interval_s=0.25, clock=clock)
    assert gauge.available
    seq = []

    def tick(dt: float, stalled: float) -> int:
        clock.now += dt
        stall(stalled)
        seq.append(gauge.threads(4))
        return seq[-1]

    assert tick(0.5, 0.0) == 4            # quiet: the budget
    assert tick(0.1, 0.1) == 4            # not sampled yet (interval 0.25 s)
    assert tick(0.2, 0.05) == 1           # 0.15 s stalled in 0.3 s: contended
    assert tick(0.5, 0.0) == 1            # pressure gone, but the back-off (1 s) is not over
    assert tick(0.6, 0.0) == 4            # 1.1 s down and quiet: back up
    assert tick(0.3, 0.3) == 1            # straight back down (our threads are the pressure)...
    assert tick(1.2, 0.0) == 1            # ...so the next try waits longer (2 s)
    assert tick(1.0, 0.0) == 4
    assert tick(0.3, 0.0) == 4            # a quiet machine stays at its budget
    assert ContentionGauge(str(path), clock=clock).threads(1) == 1  # a budget of one has nothing to lower


def test_gauge_without_pressure_information_keeps_the_budget(tmp_path):
    gauge = ContentionGauge(str(tmp_path / "missing"))
    assert not gauge.available and gauge.threads(8) == 8


@pytest.mark.skipif(not PSI.exists() or AFFINITY < 2, reason="needs the kernel's CPU pressure and two cores")
def test_a_contended_engine_runs_one_thread_and_a_fixed_count_stays(tmp_path, monkeypatch):
    """A real engine under real busy processes: the default drops to one thread, ``cpu_threads`` stays put."""
    from omni_core import Omni, SamplingParams

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the budget from the cores, as without the test plugin
    params = SamplingParams(num_inference_steps=4, seed=0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(AFFINITY + 1)]
    try:
        time.sleep(0.5)
        took = 30.0  # the default's reaction time; the fixed count is then watched twice as long (3 s at least)
        for cpu_threads, want in ((None, 1), (AFFINITY, AFFINITY)):
            with Omni("shapes", cpu_threads=cpu_threads) as omni:
                lanes = omni.engine.executor.runner.lanes
                assert lanes.budget == threads_per_process(omni.engine.config) == AFFINITY
                t0 = time.monotonic()
                deadline = t0 + (30 if cpu_threads is None else max(3.0, 2 * took))
                while time.monotonic() < deadline:
                    omni.generate(["a red circle in the top left"] * 2, params)
                    if lanes.threads != AFFINITY:
                        break
                took = time.monotonic() - t0
                assert lanes.threads == want, (cpu_threads, lanes.threads)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
