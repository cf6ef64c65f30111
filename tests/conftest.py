"""Shared test set-up: no usage reporting from Ray or MLflow; every test writes its estimator calibration cache
under its own tmp folder."""

from __future__ import annotations

import os
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
