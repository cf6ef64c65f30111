"""The sweep's one-line progress summary: trials running / passed / failed / pruned, the current best, and how much
of the budget is spent, with an ETA from the measured trials' time. Presentation only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sweeper.record.schema import TrialRecord


@dataclass
class Progress:
    max_trials: int
    objective: str
    started: float
    # The confirmations still to come once the budget is spent, in explorations' worth of time (confirm_top runs of
    # confirm_steps over the exploration's steps).
    confirm_runs: float = 0.0
    clock: Callable[[], float] = time.monotonic  # a rehearsal's virtual clock (trial.rehearsal)
    modelled: bool = False  # a rehearsal: the best's figure is modelled, and the line says so (issue 54)
    # The production run's GPUs the best's figure is projected to (issue 53: the line printed the production
    # objective under the trial's unit, right after that trial printed half of it); 0: not said
    production_gpus: int = 0

    def line(self, records: list[TrialRecord], running: int, launched: int, best: tuple[str, float] | None,
             others: int = 0, waiting: bool = False, at_scale_gpus: int = 0) -> str:
        """``others``: GPUs other jobs hold on the sweep's nodes; ``waiting``: a trial waits for GPUs;
        ``at_scale_gpus``: the best's figure was measured by its run at scale on that many GPUs (issue 53)."""
        explore = [r for r in records if r.phase == "explore"]
        passed = sum(1 for r in explore if r.result.status == "passed")
        failed = sum(1 for r in explore if r.result.status == "failed")
        pruned = sum(1 for r in explore if r.result.status == "pruned")
        elapsed = self.clock() - self.started
        measured = "modelled" if self.modelled else "measured"
        if at_scale_gpus and at_scale_gpus >= self.production_gpus:
            kinds = [f"{measured} on the production run's {at_scale_gpus} GPUs"]
        else:
            kinds = [k for k in (f"{measured} on {at_scale_gpus} GPUs" if at_scale_gpus else
                                 "modelled" if self.modelled else "",
                                 f"projected to {self.production_gpus} GPUs" if self.production_gpus else "") if k]
        best_text = (f"best {best[0]} {best[1]:,.1f} {self.objective}" + (f" ({', '.join(kinds)})" if kinds else "")
                     if best else "no stable layout yet")
        held = ""
        if others:
            held = f" | {'waiting for ' if waiting else ''}{others} GPUs held by other jobs"
        return (f"{_duration(elapsed)} | running {running} | passed {passed} | failed {failed} | pruned {pruned} | "
                f"{best_text} | budget {launched}/{self.max_trials} trials{self._eta(records, running, launched)}"
                f"{held}")

    def _eta(self, records: list[TrialRecord], running: int, launched: int) -> str:
        """Time left: the trials still to launch and the confirmations, each at the median time of the trials
        that ran so far (the running ones at half of it), over as many at once as run now."""
        confirming = any(r.phase == "confirm" for r in records)
        durations = [d for d in map(_seconds, records) if d is not None]
        to_launch = max(self.max_trials - launched, 0)
        if not durations:
            return ", ETA after the first trial" if to_launch or running else ""
        left = (to_launch + 0.5 * running + (0.0 if confirming else self.confirm_runs)) * statistics.median(durations)
        return f", ETA ~{_duration(left / max(running, 1))}" if left > 0 else ""


def _seconds(record: TrialRecord) -> float | None:
    """The wall time of a trial that ran (None for one recorded without running: pruned, refused)."""
    if record.attempt < 1 or not record.started_at or not record.ended_at:
        return None
    return (datetime.fromisoformat(record.ended_at) - datetime.fromisoformat(record.started_at)).total_seconds()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
