"""The frontier's memory verdicts over a whole space as arrays (issue 54) equal ``MemoryEvidence.verdict`` asked layout by
layout with the estimator's own predictions: the same layouts launchable in the same order, the same
``memory_pruned`` elements with the same reasons, after OOM and fitted trials, a calibration change and more trials.

The trial results are TrialResult values written by hand: this tests the verdicts, not a trial.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.estimate import Calibration, Estimator
from sweeper.estimate.calibrator import Calibrator
from sweeper.plan.assess import PlanEntry
from sweeper.record.schema import TrialMetrics, TrialResult
from sweeper.search.decide.objective import predicted_objective
from sweeper.search.propose.frontier import Frontier
from tests.search.stand_ins import EverythingSupported

ROOT = Path(__file__).resolve().parents[2]
WIDE = ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml"  # 2,040 valid layouts: fit, inside and over the band


def _passed(peak: float) -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(peak_memory_gib=peak), memory_kind="device")


def _oom() -> TrialResult:
    return TrialResult(status="failed", failure_kind="oom", error="CUDA out of memory")


def _layout_by_layout(frontier: Frontier, cfg: SweepConfig) -> tuple[list[PlanEntry], list[dict[str, Any]]]:
    """The launchable entries (best predicted objective first) and sweep.json's memory_pruned as the frontier chose
    them before issue 54: each valid layout's verdict asked of the evidence with a fresh uncalibrated prediction."""
    raw = Estimator.for_config(cfg)
    kept: list[PlanEntry] = []
    pruned: list[dict[str, Any]] = []
    for e in frontier.assessed:
        if not e.valid:
            continue
        assert e.predicted is not None
        why = frontier.evidence.verdict(e.predicted, raw(e.layout))
        if why is None:
            kept.append(e)
        else:
            pruned.append({"layout": e.layout.short(), **e.predicted.to_json(), "reason": why})
    order = sorted(kept, key=lambda e: predicted_objective(cfg, e.layout, e.predicted) or 0.0, reverse=True)
    return order, sorted(pruned, key=lambda p: p["memory_gib"])


def _same_as_layout_by_layout(frontier: Frontier, cfg: SweepConfig) -> list[dict[str, Any]]:
    frontier.launchable = frontier._launchable()  # what learn() does on evidence or a calibration change
    want_launchable, want_pruned = _layout_by_layout(frontier, cfg)
    assert [e.layout for e in frontier.launchable] == [e.layout for e in want_launchable]
    assert [e.predicted for e in frontier.launchable] == [e.predicted for e in want_launchable]
    pruned = frontier.verdict_lists()["memory_pruned"]
    assert pruned == want_pruned
    return pruned


def test_array_verdicts_equal_the_evidence_asked_layout_by_layout(tmp_path: Path) -> None:
    cfg = load_config(WIDE)
    frontier = Frontier(cfg, EverythingSupported(), Calibrator(cfg, tmp_path, shared=False), [],  # type: ignore[arg-type]
                        lambda layout: False)
    valid = [e for e in frontier.assessed if e.valid and e.predicted is not None]
    band = sorted((e for e in valid if e.predicted.may_fit and not e.predicted.fits),  # type: ignore[union-attr]
                  key=lambda e: e.predicted.memory_gib)  # type: ignore[union-attr]
    over = sorted((e for e in valid if not e.predicted.may_fit),  # type: ignore[union-attr]
                  key=lambda e: e.predicted.memory_gib)  # type: ignore[union-attr]
    before = _same_as_layout_by_layout(frontier, cfg)
    assert {p["reason"].split(" ")[-1] for p in before} == {"end"}  # nothing measured: only over the band

    def add(number: int, entry: PlanEntry, result: TrialResult) -> None:
        frontier.evidence.add(number, entry.layout.short(), frontier.raw_estimate(entry.layout), result)

    add(1, band[len(band) // 2], _oom())  # prunes band layouts needing as much in every part
    add(2, band[len(band) // 4], _oom())  # a later, smaller proof: the first one found stays the reason
    add(3, over[len(over) // 2], _passed(0.9 * cfg.memory_limit_gib))  # un-prunes over-band layouts needing less
    add(4, band[0], _passed(0.5 * cfg.memory_limit_gib))
    pruned = _same_as_layout_by_layout(frontier, cfg)
    reasons = " ".join(p["reason"] for p in pruned)
    assert "trial #1 " in reasons and "trial #2 " in reasons and "lower end" in reasons
    assert len(pruned) < len(before) + len(band)  # the fitted trial's proof let over-band layouts in

    frontier.calibrator.current = Calibration(activation_factor=1.3, state_factor=0.8, overhead_gib=1.5,
                                              step_time_factor=1.2, samples=3)
    _same_as_layout_by_layout(frontier, cfg)
    add(5, over[-1], _passed(0.95 * cfg.memory_limit_gib))  # after the change: checked against the trials since
    add(6, band[1], _oom())
    _same_as_layout_by_layout(frontier, cfg)
