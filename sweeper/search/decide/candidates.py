"""The candidates: stable explored trials with their confirmation runs, ranked on the objective, and the winner
chosen among them (``choose``). What makes a run stable or a confirmation good is ``decide.verdicts``.

Trials whose layouts the production run runs alike (TP1-DP8 on 8 GPUs and TP1-DP16 on 16 are both TP1-DP1024 on
1,024) are one candidate (issue 53): the trial of the largest W stands for it, since the less of its production step
is projected (``objective.extra_step_s``), the more of it was measured. A candidate that ran at scale
(``search.confirm_at_scale``: its production layout itself on N GPUs, or the most copies the cluster held) has that
run's measurement as its figure (``Candidate.figure``), what the choice compares."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from sweeper.config.schema import SweepConfig
from sweeper.estimate.calibration import Calibration
from sweeper.record.schema import TrialRecord
from sweeper.search.decide.objective import objective_value
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS, good_confirmation, is_stable
from sweeper.space.layout import Layout


@dataclass
class Candidate:
    number: int
    layout: Layout
    explore: TrialRecord  # the exploration record
    # Its confirmation runs that say something about the layout (a run lost to a node says nothing: it is made again)
    confirmations: list[TrialRecord] = field(default_factory=list)
    # Every confirmation attempt, the ones lost to faults that were not the layout's included (best_layout.yaml)
    attempts: list[TrialRecord] = field(default_factory=list)
    # The sweep's step-time calibration the production run's larger data parallelism is priced with (objective)
    calibration: Calibration | None = None

    @property
    def runs(self) -> list[TrialRecord]:
        """The runs that measured it: the exploration, then its confirmations (at scale too)."""
        return [self.explore, *self.confirmations]

    @property
    def trial_runs(self) -> list[TrialRecord]:
        """The runs on the trial's own W GPUs: the exploration and its confirmations at that size."""
        return [r for r in self.runs if run_gpus(r) == self.layout.world_size]

    @property
    def at_scale(self) -> TrialRecord | None:
        """Its passed confirmation on more GPUs than the trial's, the largest (``search.confirm_at_scale``: the
        production layout itself, or the largest data parallelism the cluster held), or None."""
        larger = [r for r in self.confirmations if r.result.passed and run_gpus(r) > self.layout.world_size]
        return max(larger, key=run_gpus, default=None)

    @property
    def figure_runs(self) -> list[TrialRecord]:
        """The runs its figure is made of: its run at scale, where it has one, else its runs on the trial's GPUs
        (``figure``, the decision's measured layout, ``sweeper replan``'s starting point)."""
        at_scale = self.at_scale
        return [at_scale] if at_scale is not None else self.trial_runs

    def measured(self, metric: str) -> list[float]:
        """A metric as each run on the trial's GPUs measured it (its own size, not projected)."""
        return [float(getattr(r.result.metrics, metric) or 0.0) for r in self.trial_runs]

    def value(self, run: TrialRecord, cfg: SweepConfig) -> float:
        """The objective of one of its runs, projected from that run's own size to the production run."""
        return objective_value(run.result, cfg, Layout.from_dict(run.layout), self.calibration)

    def values(self, cfg: SweepConfig) -> list[float]:
        """The objective of each run (``runs``), projected to the production run (``search.objective``)."""
        return [self.value(r, cfg) for r in self.runs]

    def median(self, cfg: SweepConfig) -> float:
        """The median objective over its runs on the trial's GPUs, each projected to the production run."""
        return statistics.median(self.value(r, cfg) for r in self.trial_runs)

    def figure(self, cfg: SweepConfig) -> float:
        """What the choice compares: its run at scale's objective where it has one (measured on the production
        run's N GPUs, or the nearest the cluster held), else the median over its runs on the trial's GPUs."""
        return statistics.median(self.value(r, cfg) for r in self.figure_runs)

    def figure_run(self, cfg: SweepConfig) -> TrialRecord:
        """The run its figure is: the one whose objective is the median of ``figure_runs`` (the lower middle one of
        an even count; the run at scale where it has one)."""
        runs = self.figure_runs
        ranked = sorted((self.value(r, cfg), i) for i, r in enumerate(runs))
        return runs[ranked[(len(ranked) - 1) // 2][1]]

    def confirmed(self, cfg: SweepConfig) -> bool:
        """It has confirmation runs and every one confirms (``verdicts.good_confirmation``)."""
        return bool(self.confirmations) and all(good_confirmation(r.result, cfg) for r in self.confirmations)


def run_gpus(run: TrialRecord) -> int:
    """The GPUs a run ran on (its own layout's: a confirmation at scale runs more than its trial)."""
    return Layout.from_dict(run.layout).world_size


def trials_without_improvement(records: list[TrialRecord], cfg: SweepConfig,
                               calibration: Calibration | None = None) -> int:
    """Explored trials that ended (the layout's own outcome, not an infrastructure failure) since the best stable
    objective last improved; 0 until a trial is stable."""
    best: float | None = None
    since = 0
    for rec in records:
        if rec.phase != "explore" or rec.attempt < 1 or rec.result.failure_kind in NOT_THE_LAYOUTS:
            continue
        layout = Layout.from_dict(rec.layout)
        value = objective_value(rec.result, cfg, layout, calibration) if is_stable(rec.result, cfg) else None
        if value is not None and (best is None or value > best):
            best, since = value, 0
        elif best is not None:
            since += 1
    return since


def candidates(records: list[TrialRecord], cfg: SweepConfig,
               calibration: Calibration | None = None) -> list[Candidate]:
    """Stable explored trials, one per production layout (the largest W's), best first, with their confirmation
    records attached; ``calibration``: the sweep's current one, which prices their projection."""
    explore: dict[int, Candidate] = {}
    confirms: dict[int, list[TrialRecord]] = {}
    for rec in records:
        if rec.phase == "confirm":
            confirms.setdefault(rec.number, []).append(rec)
        elif is_stable(rec.result, cfg):
            explore[rec.number] = Candidate(rec.number, Layout.from_dict(rec.layout), rec, calibration=calibration)
    explore = {c.number: c for c in _one_per_production_layout(explore.values(), cfg)}
    for number, recs in confirms.items():
        if number in explore:
            explore[number].attempts = recs
            # a lost node says nothing: the run is made again
            explore[number].confirmations = [r for r in recs if r.result.failure_kind not in NOT_THE_LAYOUTS]
    return sorted(explore.values(), key=lambda c: -objective_value(c.explore.result, cfg, c.layout, calibration))


def _one_per_production_layout(cands: Iterable[Candidate], cfg: SweepConfig) -> list[Candidate]:
    """The trial of the largest W for each production layout (of equal W, the earliest: the layout explored again
    keeps its first number, so they are one trial)."""
    kept: dict[Layout, Candidate] = {}
    for cand in sorted(cands, key=lambda c: (-c.layout.world_size, c.number)):
        kept.setdefault(cfg.production_layout(cand.layout) or cand.layout, cand)
    return list(kept.values())


def confirm_attempts(records: list[TrialRecord], number: int) -> tuple[int, int]:
    """(confirmation runs of trial ``number`` so far, how many of them failed for reasons not the layout's)."""
    runs = [r for r in records if r.phase == "confirm" and r.number == number]
    return len(runs), sum(1 for r in runs if r.result.failure_kind in NOT_THE_LAYOUTS)


def choose(cands: list[Candidate], cfg: SweepConfig, confirmed_only: bool = True) -> Candidate | None:
    """The winner: among confirmed candidates (``Candidate.confirmed``; with ``confirmed_only`` off, every stable
    candidate whose confirmations, if any, confirm), the best figure (``Candidate.figure``)."""
    ok = [c for c in cands if c.confirmed(cfg) or (not confirmed_only and not c.confirmations)]
    return max(ok, key=lambda c: c.figure(cfg), default=None)
