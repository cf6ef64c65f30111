"""The sweep's one-line progress summary: trials running / passed / failed / pruned, the current best, and how much
of the budget is spent with an ETA from the average trial time so far. Presentation only."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sweeper.record.schema import TrialRecord


@dataclass
class Progress:
    max_trials: int
    objective: str
    started: float

    def line(self, records: list[TrialRecord], running: int, launched: int, best: tuple[str, float] | None) -> str:
        explore = [r for r in records if r.phase == "explore"]
        passed = sum(1 for r in explore if r.result.status == "passed")
        failed = sum(1 for r in explore if r.result.status == "failed")
        pruned = sum(1 for r in explore if r.result.status == "pruned")
        elapsed = time.monotonic() - self.started
        eta = ""
        if 0 < launched < self.max_trials:
            remaining = (self.max_trials - launched) * elapsed / launched
            eta = f", ETA ~{_duration(remaining)} at this pace"
        best_text = f"best {best[0]} {best[1]:,.1f} {self.objective}" if best else "no stable layout yet"
        return (f"{_duration(elapsed)} | running {running} | passed {passed} | failed {failed} | pruned {pruned} | "
                f"{best_text} | budget {launched}/{self.max_trials} trials{eta}")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
