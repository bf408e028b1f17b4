"""A two-node Ray cluster on this machine, started once per module: a head and a second node process with its
own custom resource (``node_b``), each with 2 logical CPUs. Both run with ``--block`` so the fixture stops
exactly its own processes (SIGTERM drains a node and ends its raylet and workers) instead of ``ray stop``,
which would kill every Ray process of the user."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["RAY_AUTH_MODE"] = "disabled"  # token auth is on by default and breaks `ray start --address`

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp = tempfile.mkdtemp(prefix="omni-ray-")
        self.procs: dict[str, subprocess.Popen] = {}

    def _start(self, name: str, *args: str) -> None:
        log = open(os.path.join(self.temp, f"{name}.log"), "w")
        self.procs[name] = subprocess.Popen([RAY, "start", "--block", "--num-cpus=2", "--disable-usage-stats", *args],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        import ray

        self._start("head", "--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}")
        deadline = time.monotonic() + 60
        while True:  # the head is up once a driver can connect
            try:
                ray.init(address=self.address, include_dashboard=False, configure_logging=False)
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline or self.procs["head"].poll() is not None:
                    raise
                time.sleep(0.5)
        self._start("node_b", f"--address={self.address}", '--resources={"node_b": 1}')
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if time.monotonic() > deadline or self.procs["node_b"].poll() is not None:
                raise RuntimeError(f"the second Ray node did not join; see {self.temp}/node_b.log")
            time.sleep(0.3)
        self.node_b = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" in n["Resources"])
        self.head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" not in n["Resources"])

    def stop_node(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:  # a node drains for up to 30 s before it stops; nothing of ours runs on it any more
                proc.wait(8)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node's CPUs are free again (a killed actor's are released asynchronously, and "spread"
        placement is best effort: it uses whatever nodes have room)."""
        import ray

        deadline = time.monotonic() + timeout
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray resources still in use: {ray.available_resources()}")
            time.sleep(0.2)

    def kill_node(self, name: str) -> None:
        """SIGKILL a node's Ray processes, as when its machine drops off the network (its actor workers run in
        their own sessions and exit once their raylet is gone)."""
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        import ray

        ray.shutdown()
        for name in ("node_b", "head"):
            self.stop_node(name)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ours_left():
    """The function below, for tests (plugin tests import no module of their own under importlib mode)."""
    return _ours_left


def _ours_left() -> tuple[list, list]:
    """(our actors that are not DEAD, our placement groups that are not REMOVED), as Ray's GCS reports them."""
    import ray

    actors = [a for a in ray._private.state.actors().values()
              if a.get("Name", "").startswith("omni-") and a["State"] != "DEAD"]
    groups = [g for g in ray.util.placement_group_table().values()
              if g.get("name", "").startswith("omni-") and g["state"] != "REMOVED"]
    return actors, groups
