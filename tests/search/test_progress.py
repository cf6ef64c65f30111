"""The progress line's ETA: from the trials that ran (their median wall time), the budget left and the
confirmations to come; no figure before a trial has ended."""

from __future__ import annotations

import time

from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.search.progress import Progress


def _record(number: int, seconds: float, phase: str = "explore", attempt: int = 1) -> TrialRecord:
    result = TrialResult(status="passed") if attempt else TrialResult.pruned("does not fit")
    return TrialRecord(number=number, layout={"tp": 1}, result=result, attempt=attempt, phase=phase,  # type: ignore[arg-type]
                       started_at="2026-12-03T10:00:00+00:00",
                       ended_at=f"2026-12-03T10:{int(seconds) // 60:02d}:{int(seconds) % 60:02d}+00:00")


def test_no_eta_is_made_up_before_a_trial_has_ended() -> None:
    progress = Progress(max_trials=4, objective="tokens_per_s", started=time.monotonic(), confirm_runs=1.0)
    assert progress.line([], running=1, launched=1, best=None).endswith("budget 1/4 trials, ETA after the first trial")
    # A pruned layout never ran: it says nothing about a trial's time.
    assert "ETA after the first trial" in progress.line([_record(1, 0, attempt=0)], running=0, launched=0, best=None)


def test_the_eta_counts_the_trials_left_the_running_one_and_the_confirmation() -> None:
    progress = Progress(max_trials=4, objective="tokens_per_s", started=time.monotonic(), confirm_runs=1.5)
    records = [_record(1, 60), _record(2, 100), _record(3, 80)]
    # Median 80 s: one trial to launch, one running (half done), 1.5 trials' worth of confirmation = 3 x 80 s.
    assert progress.line(records, running=1, launched=3, best=("TP1", 5.0)).endswith("ETA ~4m00s")
    confirming = records + [_record(4, 80), _record(2, 120, phase="confirm")]
    assert progress.line(confirming, running=0, launched=4, best=("TP1", 5.0)).endswith("budget 4/4 trials")


def test_the_best_measured_at_scale_says_where_it_was_measured() -> None:
    # issue 53: after the winner's run at scale, its figure is that run's, not a projection
    progress = Progress(max_trials=4, objective="tokens_per_s", started=0.0, clock=lambda: 60.0, production_gpus=16)
    line = progress.line([], running=0, launched=4, best=("TP1-PP2", 1234.5), at_scale_gpus=16)
    assert "best TP1-PP2 1,234.5 tokens_per_s (measured on the production run's 16 GPUs) |" in line
    nearest = progress.line([], running=0, launched=4, best=("TP1-PP2", 1234.5), at_scale_gpus=8)
    assert "(measured on 8 GPUs, projected to 16 GPUs) |" in nearest
    modelled = Progress(max_trials=4, objective="tokens_per_s", started=0.0, clock=lambda: 60.0, production_gpus=16,
                        modelled=True)
    assert "(modelled on the production run's 16 GPUs)" in modelled.line([], 0, 4, ("TP1-PP2", 1.0), at_scale_gpus=16)
