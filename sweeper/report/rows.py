"""The report's rows: one per line of trials.jsonl (a ``TrialRecord``), with the layout rebuilt where it can be and
the report's category of the attempt (passed, not stable, failed, pruned)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sweeper.errors import LayoutError
from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.record.sweepdir import read_trials
from sweeper.space.layout import Layout


@dataclass
class TrialRow:
    """One line of trials.jsonl, with the report's category of it."""

    number: int
    attempt: int
    phase: str
    layout: Layout | None  # None when the recorded layout cannot be rebuilt (the raw dict is still shown)
    layout_raw: dict[str, Any]
    result: TrialResult
    predicted_memory_gib: float | None
    mlflow_run_id: str | None
    started_at: str | None
    ended_at: str | None
    category: str = "pruned"  # passed | not stable | failed | pruned (set by _classify)

    @property
    def name(self) -> str:
        if self.layout is not None:
            return self.layout.short()
        return ",".join(f"{k}={v}" for k, v in self.layout_raw.items() if v is not None) or "?"

    @property
    def tokens_per_s(self) -> float | None:
        return self.result.metrics.tokens_per_s

    @property
    def peak_memory_gib(self) -> float | None:
        return self.result.metrics.peak_memory_gib

    @property
    def duration_s(self) -> float | None:
        try:
            start, end = datetime.fromisoformat(self.started_at or ""), datetime.fromisoformat(self.ended_at or "")
            return (end - start).total_seconds()
        except (ValueError, TypeError):  # missing or naive-vs-aware timestamps: show no duration
            return None


def _row(record: TrialRecord) -> TrialRow:
    try:
        layout: Layout | None = Layout.from_dict(record.layout)
    except (LayoutError, TypeError):
        layout = None
    return TrialRow(
        number=record.number, attempt=record.attempt, phase=record.phase, layout=layout, layout_raw=record.layout,
        result=record.result, predicted_memory_gib=record.predicted_memory_gib, mlflow_run_id=record.mlflow_run_id,
        started_at=record.started_at, ended_at=record.ended_at,
    )


def load_trials(path: Path) -> tuple[list[TrialRow], int]:
    """The readable rows of trials.jsonl and the number of lines skipped (a torn last line after a crash)."""
    records, skipped = read_trials(path)
    return [_row(r) for r in records], skipped
