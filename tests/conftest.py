"""Shared test fixtures. Every test writes its estimator calibration cache under its own tmp folder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_calibration_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_CACHE", str(tmp_path / "sweeper-cache"))
