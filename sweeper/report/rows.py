"""The report's rows: one per line of trials.jsonl (a ``TrialRecord``), with the layout rebuilt where it can be and
the report's category of the attempt (passed, not stable, failed, pruned)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sweeper.errors import LayoutError
from sweeper.record.schema import TrialRecord
from sweeper.record.sweepdir import read_trials
from sweeper.space.layout import Layout


@dataclass
class TrialRow(TrialRecord):
    """One line of trials.jsonl, with its layout rebuilt and the report's category of it."""

    built: Layout | None = None  # the recorded layout rebuilt; None when it cannot be (the raw dict is still shown)
    category: str = "pruned"  # passed | not stable | failed | pruned (set by _classify)

    @property
    def name(self) -> str:
        if self.built is not None:
            return self.built.short()
        return ",".join(f"{k}={v}" for k, v in self.layout.items() if v is not None) or "?"

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
        built: Layout | None = Layout.from_dict(record.layout)
    except (LayoutError, TypeError):
        built = None
    return TrialRow(**vars(record), built=built)


def load_trials(path: Path) -> tuple[list[TrialRow], int]:
    """The readable rows of trials.jsonl and the number of lines skipped (a torn last line after a crash)."""
    records, skipped = read_trials(path)
    return [_row(r) for r in records], skipped
