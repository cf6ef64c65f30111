"""Screenshot MLflow's view of a sweep's trials (docs/img/mlflow_trials.png) in headless Chromium.

    python scripts/mlflow_screenshot.py sweeps/quickstart [--store URI] [--out docs/img/mlflow_trials.png]

Starts ``mlflow server`` on a free loopback port over the sweep's tracking store, opens the comparison view the sweep
shared (``sweep.json`` names the experiment and the parent run), saves the page as a PNG, and stops the server by its
process id. Needs Debian's ``chromium`` (apt-get install chromium).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sweeper.record.tracking import comparison_view_url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow server did not answer at {url} within {timeout_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--store", help="the tracking store (default: the one sweep.json records)")
    parser.add_argument("--out", type=Path, default=Path("docs/img/mlflow_trials.png"))
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("chromium not found (apt-get install chromium)")
    mlflow = json.loads((args.sweep / "sweep.json").read_text())["mlflow"]
    store = args.store or mlflow["tracking_uri"]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store,
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait(f"{base}/health", 60)
        url = comparison_view_url(base, mlflow["experiment_id"], mlflow["parent_run_id"])
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                            "--disable-background-networking", "--disable-component-update", "--disable-sync",
                            f"--user-data-dir={profile}", "--window-size=1900,900", "--virtual-time-budget=20000",
                            f"--screenshot={args.out.resolve()}", url],
                           check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{url} -> {args.out}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its workers, by the group its process id leads
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
