"""A sweep against a real MLflow tracking server over HTTP (issue 34): `mlflow server` on 127.0.0.1 with a sqlite
backend and artifacts served by the server (--serve-artifacts), started here and stopped by its process id. The
quickstart sweep (fewer trials) logs through it; everything is read back through MlflowClient over HTTP, and a dummy
MLFLOW_TRACKING_TOKEN the sweep ran with appears in none of the sweep's files or output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "dummy-token-4f1c9e"  # what a lab's MLflow gateway would check; this server ignores it


@pytest.fixture
def mlflow_server(mlflow_server_process: Any) -> str:
    return str(mlflow_server_process.url)


@pytest.mark.e2e
@pytest.mark.slow  # 2.3 minutes on 2 cores with its server; CI keeps the tracking-server loss test (test_search_loop)
def test_a_sweep_logs_everything_through_a_tracking_server(tmp_path: Path, mlflow_server: str) -> None:
    out = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_TOKEN": TOKEN}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper", "search", "quickstart", "--out", str(out), "-q",
         "--set", f"tracking.mlflow_tracking_uri={mlflow_server}", "--set", "search.max_trials=3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    client = MlflowClient(tracking_uri=mlflow_server)
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["mlflow"]["tracking_uri"] == mlflow_server
    experiment = meta["mlflow"]["experiment_id"]
    parent = client.get_run(meta["mlflow"]["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["sweeper.kind"] == "sweep"
    assert parent.data.tags["sweeper.best"] == meta["best"]["layout"]

    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines() if line.strip()]
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_id for r in children) == sorted(r["mlflow_run_id"] for r in records)
    for run in children:
        record = next(r for r in records if r["mlflow_run_id"] == run.info.run_id)
        assert run.data.tags["sweeper.status"] == record["result"]["status"]
        assert run.data.params["tensor_model_parallel_size"] == str(record["layout"]["tp"])
        if record["result"]["status"] == "passed":
            assert run.data.metrics["tokens_per_s"] == pytest.approx(record["result"]["metrics"]["tokens_per_s"])
        logged = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"result.json", "logs"} <= logged

    # The parent's artifacts went through the server (--serve-artifacts) and come back byte for byte.
    logged = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"best_layout.yaml", "launch_megatron_lm.sh", "megatron_bridge_overrides.yaml", "report.html",
            "trials.jsonl", "sweep.json", "trials_table.json", "figures", "space.yaml"} <= logged, logged
    fetched = Path(client.download_artifacts(parent.info.run_id, "best_layout.yaml", str(tmp_path)))
    assert fetched.read_bytes() == (out / "best_layout.yaml").read_bytes()
    assert client.list_artifacts(parent.info.run_id, "figures")

    # The token the sweep ran with is in none of its files, nor in what it printed.
    for path in [p for p in out.rglob("*") if p.is_file()]:
        assert TOKEN.encode() not in path.read_bytes(), path
    assert TOKEN not in proc.stdout + proc.stderr
