"""A real ``ray start`` head node on loopback for the tests that must see a user's own Ray cluster (issue 51): not
the simulated one, which connects with its own settings and hides what a real cluster shows.

Every Ray process stays on 127.0.0.1: ``--node-ip-address 127.0.0.1`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
(Ray's one-machine mode, in which it refuses workers joining, hence one node with several logical GPUs). The node
gets a temp folder of its own (its sessions, logs and the address file ``ray start`` writes, so neither
``/tmp/ray`` nor another cluster's address file is touched) and free ports for everything with a fixed default.
``ray start --block`` stays in the foreground as the leader of a new process group that every process it starts
joins; stopping kills that group by its id, then any process left whose command line names the node's own temp
folder, by pid. ``ray stop`` is never used: it kills every Ray process on the machine by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ONE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RayStartNode:
    """``ray start --head`` with ``gpus`` logical GPUs and ``cpus`` CPUs on 127.0.0.1; ``env`` is what a driver
    joining it needs in its environment."""

    def __init__(self, gpus: int, cpus: int) -> None:
        self.gpus, self.cpus = gpus, cpus
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Short: Ray's unix sockets live under it, and their paths may not exceed ~107 characters.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
        self.env = {**os.environ, **ONE_MACHINE_ENV}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        command = [
            ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
            "--num-gpus", str(self.gpus), "--num-cpus", str(self.cpus), "--temp-dir", str(self.temp_dir),
            "--include-dashboard", "false", "--disable-usage-stats", "--object-store-memory", str(100 * 2**20),
            "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
            "--metrics-export-port", str(free_port()),
        ]
        log = (self.temp_dir / "ray-start.log").open("wb")
        # Its own folder as the working folder of every Ray process: a relative path a rank writes lands there.
        self.proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.temp_dir)
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        from sweeper.cluster.discovery import probe

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"ray start exited {self.proc.returncode}: {self.log_tail()}")
            if probe(self.address, 5.0).problem is None and self._raylet_up():
                return
            if time.monotonic() > deadline:
                pytest.fail(f"ray start did not answer within {START_TIMEOUT_S:.0f} s: {self.log_tail()}")
            time.sleep(1.0)

    def _raylet_up(self) -> bool:
        # The GCS answers before the raylet registers; a driver joining then finds no local node.
        return any(p.name().startswith("raylet") for p in self._processes())

    def log_tail(self) -> str:
        path = self.temp_dir / "ray-start.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def _processes(self) -> list[psutil.Process]:
        """Every process of this node: its process group, and any process naming its own temp folder."""
        if self.proc is None:
            return []
        found = []
        marker = str(self.temp_dir)
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.pid == self.proc.pid or os.getpgid(proc.pid) == self.proc.pid or any(
                        marker in part for part in proc.cmdline()):
                    found.append(proc)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return found

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with_pids = self._processes()
            if not with_pids:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for proc in with_pids:
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
            psutil.wait_procs(with_pids, timeout=5)
        self.proc.wait(timeout=10)
        left = [f"{p.pid} {p.name()}" for p in self._processes() if _running(p)]
        self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not left, f"ray start node: processes left running: {left}"


@pytest.fixture
def ray_start_node(request: pytest.FixtureRequest) -> Iterator[RayStartNode]:
    """A ``ray start`` head on loopback; ``@pytest.mark.parametrize("ray_start_node", [(gpus, cpus)],
    indirect=True)`` sizes it (default 4 logical GPUs, 5 CPUs)."""
    gpus, cpus = getattr(request, "param", (4, 5))
    node = RayStartNode(gpus, cpus)
    try:
        node.start()
        yield node
    finally:
        node.stop()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
