"""A two-node Ray cluster on this machine, started on first use and shared by the session's modules (one per xdist
worker): a head and a second node process with its own custom resource (``node_b``), each with 2 logical CPUs. Both run with ``--block`` so the
fixture stops exactly its own processes (their process groups) instead of ``ray stop``, which would kill every Ray
process of the user.

One cluster serves every module: starting one costs some ten Python processes (GCS, raylets, agents, monitors) and
10-15 s on two busy cores. A test that kills the second node (the lost-node test) leaves it dead for the rest of
its module; the next module that asks for ``ray_cluster`` gets a new second node (``ensure_two_nodes``). The
cluster stops right after the session's last test that uses it (an idle cluster still costs some 5 % of a core,
and later tests of the same pytest process may be unrelated), or at the session's end.

Every test that uses the cluster names the ``xdist_group`` "omni-ray-cluster", so under ``pytest -n N --dist
loadgroup`` they all run on one worker, in collection order: one cluster, one set of references, not one each."""

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


def pytest_configure(config):
    # pytest-xdist's mark, registered by it where installed; not in check_dists' venv of this plugin alone
    config.addinivalue_line("markers", "xdist_group(name): the tests of a group run on one pytest-xdist worker")


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
        self.node_b: str | None = None

    def _start(self, name: str, *args: str) -> None:
        log = open(os.path.join(self.temp, f"{name}.log"), "a")
        self.procs[name] = subprocess.Popen([RAY, "start", "--block", "--num-cpus=2", "--disable-usage-stats", *args],
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _start_node_b(self) -> None:
        self._start("node_b", f"--address={self.address}", '--resources={"node_b": 1}')

    def start(self) -> None:
        import ray

        self._start("head", "--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}")
        self._start_node_b()  # at once: its `ray start` waits for the head's GCS (2-3 s sooner than after it)
        deadline = time.monotonic() + 60
        while True:  # the head is up once a driver can connect
            try:
                ray.init(address=self.address, include_dashboard=False, configure_logging=False)
                break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline or self.procs["head"].poll() is not None:
                    raise
                time.sleep(0.2)
        if self.procs["node_b"].poll() is not None:  # gave up waiting for the GCS: once more, now that it is up
            self._start_node_b()
        self._wait_node_b(deadline)
        self.head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" not in n["Resources"])

    def _wait_node_b(self, deadline: float) -> None:
        import ray

        while not (joined := [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" in n["Resources"]]):
            if time.monotonic() > deadline or self.procs["node_b"].poll() is not None:
                raise RuntimeError(f"the second Ray node did not join; see {self.temp}/node_b.log")
            time.sleep(0.2)
        self.node_b = joined[0]

    def ensure_two_nodes(self, timeout: float = 60) -> None:
        """A new second node if a test killed the last one: once the GCS has declared the old one dead (so no
        placement group lands on it), a ``ray start`` with the same ``node_b`` resource, waited for until it joined."""
        import ray

        if self.procs["node_b"].poll() is None:
            return
        deadline = time.monotonic() + timeout
        while any(n["Alive"] and n["NodeID"] == self.node_b for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray still reports the killed node {self.node_b} alive")
            time.sleep(0.3)
        self._start_node_b()
        self._wait_node_b(deadline)

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
        """Disconnect, then end both nodes' process groups: SIGTERM, and SIGKILL after a second. Nothing of ours
        runs on them any more, and a raylet given SIGTERM drains for up to 30 s (the head's took the whole 8 s the
        fixture used to wait); the workers exit once their raylet is gone, as in :meth:`kill_node`."""
        import ray

        ray.shutdown()
        running = [p for p in self.procs.values() if p.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 1
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in running:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        shutil.rmtree(self.temp, ignore_errors=True)


_running: list[Cluster] = []  # the cluster while it runs (at most one)


def _running_cluster() -> Cluster:
    """The running cluster, started on first use (and again should a test need one after it stopped)."""
    if not _running:
        cluster = Cluster()
        _running.append(cluster)
        try:
            cluster.start()
        except BaseException:
            _stop_running()  # what did start of it
            raise
    return _running[0]


def _stop_running() -> None:
    while _running:
        _running.pop().stop()


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's cluster, with two live nodes when the module starts."""
    cluster = _running_cluster()
    cluster.ensure_two_nodes()
    return cluster


def _uses_cluster(item) -> bool:
    return "ray_cluster" in getattr(item, "fixturenames", ())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Once the item's fixtures are torn down: stop the cluster if no later item of the run uses it (in collection
    order, which is the order of a run and of the one xdist worker that runs the group)."""
    try:
        return (yield)
    finally:
        if _running and _uses_cluster(item):
            items = item.session.items
            later = items[items.index(item) + 1:] if item in items else []
            if not any(_uses_cluster(i) for i in later):
                _stop_running()


def pytest_sessionfinish(session):
    _stop_running()


@pytest.fixture(scope="session")
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
