"""Pruning on memory under uncertainty (issue 13): the band, and what measured trials prove about their neighbours.

The trial results here are TrialResult values written by hand: this tests the pruning logic, not a trial.
"""

from __future__ import annotations

from sweeper.estimate import Estimate
from sweeper.record.schema import TrialMetrics, TrialResult
from sweeper.search.propose.memory_evidence import MemoryEvidence

LIMIT = 86.4  # 90% of 96 GiB


def _estimate(gib: float, limit: float = LIMIT, over: float = 0.2, under: float = 0.2,
              parts: dict[str, float] | None = None) -> Estimate:
    band = (gib / (1 + over), gib / (1 - under))
    return Estimate(memory_gib=gib, fits=gib <= limit, step_time_s=1.0, tokens_per_s=1.0,
                    memory_band_gib=band, may_fit=band[0] <= limit, breakdown=parts or {})


def _passed(peak: float, kind: str = "device") -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(peak_memory_gib=peak), memory_kind=kind)


def _oom() -> TrialResult:
    return TrialResult(status="failed", failure_kind="oom", error="CUDA out of memory")


def test_a_layout_inside_the_band_is_launched_and_one_over_it_is_pruned() -> None:
    evidence = MemoryEvidence(LIMIT)
    assert evidence.verdict(_estimate(80.0), _estimate(80.0)) is None  # fits
    assert evidence.verdict(_estimate(100.0), _estimate(100.0)) is None  # 100 / 1.2 = 83.3 may fit
    why = evidence.verdict(_estimate(110.0), _estimate(110.0))  # 110 / 1.2 = 91.7 does not
    assert why is not None and "110.0 GiB" in why and "91.7-137.5" in why and "lower end" in why


def test_a_measured_neighbour_that_fits_overrules_the_band() -> None:
    evidence = MemoryEvidence(LIMIT)
    evidence.add(3, "TP1-PP1-EP8", _estimate(115.0), _passed(84.0))
    assert evidence.verdict(_estimate(110.0), _estimate(110.0)) is None  # predicted to need less than #3
    assert evidence.verdict(_estimate(120.0), _estimate(120.0)) is not None  # more than #3: still pruned
    # Host RSS (the CPU backend) proves nothing about GPU memory; nor does a peak over the limit.
    cpu = MemoryEvidence(LIMIT)
    cpu.add(1, "a", _estimate(115.0), _passed(1.0, kind="host"))
    cpu.add(2, "b", _estimate(115.0), _passed(90.0))
    assert cpu.verdict(_estimate(110.0), _estimate(110.0)) is not None


def test_an_oom_prunes_band_layouts_predicted_to_need_more_and_says_so() -> None:
    evidence = MemoryEvidence(LIMIT)
    evidence.add(5, "TP1-PP1-EP4", _estimate(95.0), _oom())
    why = evidence.verdict(_estimate(98.0), _estimate(98.0))
    assert why is not None and "#5" in why and "inferred" in why
    assert evidence.verdict(_estimate(92.0), _estimate(92.0)) is None  # less than #5 needed: still a probe
    assert evidence.verdict(_estimate(80.0), _estimate(80.0)) is None  # predicted to fit: never inferred away


def test_comparisons_use_the_uncalibrated_prediction() -> None:
    """A calibration that lowers a prediction does not move it past the evidence: both sides are uncalibrated."""
    evidence = MemoryEvidence(LIMIT)
    evidence.add(2, "x", _estimate(115.0), _passed(80.0))
    calibrated, raw = _estimate(112.0), _estimate(118.0)
    assert evidence.verdict(calibrated, raw) is not None  # raw 118 > 115: #2 proves nothing about it


def test_an_oom_prunes_only_layouts_that_need_as_much_in_every_part() -> None:
    """Issue 43: a total orders structurally different layouts only within the estimator's per-layout error. A
    layout with more in total but fewer activations than the one that ran out may still fit: it stays a probe."""
    evidence = MemoryEvidence(LIMIT)
    evidence.add(7, "TP1-PP1-EP8-MBS4", _estimate(95.0, parts={"weights": 30.0, "activations": 65.0}), _oom())
    more_weights = _estimate(98.0, parts={"weights": 60.0, "activations": 38.0, "pipeline_rank": 0.0})
    assert evidence.verdict(more_weights, more_weights) is None
    more_of_each = _estimate(99.0, parts={"weights": 31.0, "activations": 68.0, "pipeline_rank": 3.0})
    why = evidence.verdict(more_of_each, more_of_each)
    assert why is not None and "#7" in why and "every part" in why


def test_a_layout_asked_again_is_checked_against_the_trials_added_since_with_the_same_answers() -> None:
    """Issue 54: every layout is asked on every event; a layout's proof is looked for among the OOM trials added
    since it was last asked, and its line written again only for a new prediction, with the answers of a fresh look."""
    evidence = MemoryEvidence(LIMIT)
    raw, predicted = _estimate(98.0), _estimate(98.0)
    assert evidence.verdict(predicted, raw) is None  # in the band, no OOM yet
    evidence.add(6, "TP1-PP1-EP2", _estimate(97.0, parts={"weights": 50.0}), _oom())  # a part over this layout's
    evidence.add(7, "TP1-PP1-EP4", _estimate(95.0), _oom())
    evidence.add(8, "TP1-PP1-EP8", _estimate(90.0), _oom())
    why = evidence.verdict(predicted, raw)
    assert why is not None and "#7" in why  # the first OOM trial that proves it, as a fresh look finds
    assert evidence.verdict(predicted, raw) == why == MemoryEvidence(LIMIT, ran_out=evidence.ran_out,
                                                                     _least_oom_gib=90.0).verdict(predicted, raw)
    over = _estimate(110.0)
    first = evidence.verdict(over, over)
    assert first is not None and evidence.verdict(over, over) is first  # the same prediction: the same line
    recalibrated = _estimate(120.0)
    assert "120.0 GiB" in (evidence.verdict(recalibrated, over) or "")


def test_a_fit_proof_is_looked_for_among_the_trials_added_since() -> None:
    evidence = MemoryEvidence(LIMIT)
    raw = _estimate(112.0)
    evidence.add(1, "a", _estimate(100.0), _passed(80.0))
    evidence.add(2, "b", _estimate(120.0), _passed(80.0))  # predicted to need more, and fitted: a proof
    assert evidence.verdict(raw, raw) is None
    assert evidence.proof_of_fit(raw) is evidence.fitted[1]
    evidence.add(3, "c", _estimate(130.0), _passed(80.0))
    assert evidence.proof_of_fit(raw) is evidence.fitted[1]  # the first proof stays the one a fresh look finds
    alone = MemoryEvidence(LIMIT)
    alone.add(1, "a", _estimate(100.0), _passed(80.0))
    assert alone.verdict(raw, raw) is not None
    alone.add(4, "d", _estimate(115.0), _passed(80.0))
    assert alone.verdict(raw, raw) is None  # a proof added after the layout was asked
