"""Shared test set-up: no usage reporting from Ray or MLflow; every test writes its estimator calibration cache
under its own tmp folder; a real MLflow tracking server on 127.0.0.1 for the tests that need one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

# Nothing in a test run reports usage anywhere: Ray's usage stats (whose head also probes the cloud metadata
# address) and MLflow's telemetry are off in this process and every process it starts. Set at collection, before
# any test imports Ray or MLflow (MLflow reads its switches at import).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"


@pytest.fixture(autouse=True)
def _isolated_calibration_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_CACHE", str(tmp_path / "sweeper-cache"))


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 (sqlite backend, artifacts served by the server: --serve-artifacts),
    started and stopped by its process id (its process group); ``stop`` and ``start`` again keep the port and the
    store, as a lab's server restarting would."""

    def __init__(self, store: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.store = store
        store.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers",
             "1", "--backend-store-uri", f"sqlite:///{self.store / 'mlflow.db'}", "--serve-artifacts",
             "--artifacts-destination", str(self.store / "artifacts")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start (exit {self.proc.poll()})")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # the server and its workers: the group its process id leads
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture
def mlflow_server_process(tmp_path: Path) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()
    try:
        yield server
    finally:
        server.stop()
