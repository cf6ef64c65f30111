"""Choosing the best *stable* layout and exporting it in the forms a user pastes into a pretraining launch.

Stable = passed every check and used at most (1 - memory_headroom) of GPU memory. Candidates are ranked on
the objective; confirmation runs re-run the top ones with more steps, and the winner is the candidate that
passed all its confirmations with the best median throughput.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.export.bridge import dotted_overrides
from sweeper.export.megatron_lm import layout_args
from sweeper.models.proxy import PROXY_NOTE, is_proxy
from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.search.decide.objective import copies, objective_name, objective_value, production_gpus
from sweeper.space.layout import Layout


@dataclass
class Candidate:
    number: int
    layout: Layout
    explore: TrialRecord  # the exploration record
    confirmations: list[TrialRecord] = field(default_factory=list)

    @property
    def runs(self) -> list[TrialRecord]:
        """The runs that measured it: the exploration, then its confirmations."""
        return [self.explore, *self.confirmations]

    def measured(self, metric: str) -> list[float]:
        """A metric as each run measured it (the trial's own size, not projected)."""
        return [float(getattr(r.result.metrics, metric) or 0.0) for r in self.runs]

    def values(self, cfg: SweepConfig) -> list[float]:
        """The objective of each run: projected to the production run (``search.objective``)."""
        return [objective_value(r.result, cfg, self.layout) for r in self.runs]

    def median(self, cfg: SweepConfig) -> float:
        """The median objective over its runs: what the choice compares."""
        return statistics.median(self.values(cfg))

    def median_run(self, cfg: SweepConfig) -> TrialRecord:
        """The run whose objective is the median's (the lower middle one of an even count)."""
        ranked = sorted(zip(self.values(cfg), range(len(self.runs))))
        return self.runs[ranked[(len(ranked) - 1) // 2][1]]

    def confirmed(self, cfg: SweepConfig) -> bool:
        """Every confirmation run passed and its step time stayed steady (``search.confirm_max_step_time_drift``)."""
        return all(r.result.passed and steady(r.result, cfg) for r in self.confirmations)


MIN_STEPS_FOR_DRIFT = 8  # fewer timed steps than this: too few for two quarters to mean anything


def step_time_drift(result: TrialResult, warmup_steps: int) -> float | None:
    """The median step time of the last quarter of the steps over that of the first quarter (warm-up steps left
    out); None when too few steps were timed."""
    times = result.step_times_s[warmup_steps:]
    if len(times) < MIN_STEPS_FOR_DRIFT:
        return None
    quarter = len(times) // 4
    first = statistics.median(times[:quarter])
    return statistics.median(times[-quarter:]) / first if first > 0 else None


def steady(result: TrialResult, cfg: SweepConfig) -> bool:
    """The step time did not drift past the limit. On the CPU backend (host memory) trials share the machine's
    cores, so another trial starting slows this one: the drift is recorded there, not held against the layout."""
    if result.memory_kind == "host":
        return True
    drift = step_time_drift(result, cfg.training.warmup_steps)
    return drift is None or drift <= cfg.search.confirm_max_step_time_drift


# Failures that say nothing about the layout: the infrastructure (a node or rank lost) or a bug in sweeper itself
# (internal).
NOT_THE_LAYOUTS = ("infra", "internal")


# The note a sweep adds to a trial it ran without its equivalence reference (the reference could not be made).
GATE_OFF = "equivalence gate off: the sweep has no reference"


def is_stable(result: TrialResult, cfg: SweepConfig) -> bool:
    """Passed, ran against the equivalence reference (unless ``search.require_equivalence`` is false), within the
    memory headroom (under routing stress too, when the trial ran it), and (unless ``search.allow_cross_node_tp``)
    no TP or ETP group ran across nodes."""
    if not result.passed:
        return False
    if GATE_OFF in result.notes and cfg.search.require_equivalence:
        return False
    if result.placement_warnings and not cfg.search.allow_cross_node_tp:
        return False
    # A GPU holds torch's reserved memory and what lives outside it (context, NCCL), as the estimator counts both;
    # the CPU's resident set already holds everything.
    outside = result.metrics.non_torch_memory_gib or 0.0
    peak, stressed = result.metrics.peak_memory_gib, result.metrics.stress_peak_memory_gib
    if stressed is not None and stressed + outside > cfg.memory_limit_gib:
        return False
    return peak is not None and peak + outside <= cfg.memory_limit_gib


def trials_without_improvement(records: list[TrialRecord], cfg: SweepConfig) -> int:
    """Explored trials that ended (the layout's own outcome, not an infrastructure failure) since the best stable
    objective last improved; 0 until a trial is stable."""
    best: float | None = None
    since = 0
    for rec in records:
        if rec.phase != "explore" or rec.attempt < 1 or rec.result.failure_kind in NOT_THE_LAYOUTS:
            continue
        value = objective_value(rec.result, cfg, Layout.from_dict(rec.layout)) if is_stable(rec.result, cfg) else None
        if value is not None and (best is None or value > best):
            best, since = value, 0
        elif best is not None:
            since += 1
    return since


def candidates(records: list[TrialRecord], cfg: SweepConfig) -> list[Candidate]:
    """Stable explored trials, best first, with their confirmation records attached."""
    explore: dict[int, Candidate] = {}
    confirms: dict[int, list[TrialRecord]] = {}
    for rec in records:
        if rec.phase == "confirm":
            if rec.result.failure_kind not in NOT_THE_LAYOUTS:  # a lost node says nothing: the run is made again
                confirms.setdefault(rec.number, []).append(rec)
        elif is_stable(rec.result, cfg):
            explore[rec.number] = Candidate(rec.number, Layout.from_dict(rec.layout), rec)
    for number, recs in confirms.items():
        if number in explore:
            explore[number].confirmations = recs
    return sorted(explore.values(), key=lambda c: -objective_value(c.explore.result, cfg, c.layout))


def confirm_attempts(records: list[TrialRecord], number: int) -> tuple[int, int]:
    """(confirmation runs of trial ``number`` so far, how many of them failed for reasons not the layout's)."""
    runs = [r for r in records if r.phase == "confirm" and r.number == number]
    return len(runs), sum(1 for r in runs if r.result.failure_kind in NOT_THE_LAYOUTS)


def choose(cands: list[Candidate], cfg: SweepConfig, confirmed_only: bool = True) -> Candidate | None:
    """The winner: among candidates whose confirmation runs all passed and stayed stable (or, with
    ``confirmed_only`` off, every stable candidate), the best median objective."""
    ok = [
        c for c in cands
        if (c.confirmations or not confirmed_only) and c.confirmed(cfg)
        and all(is_stable(r.result, cfg) for r in c.confirmations)
    ]
    return max(ok, key=lambda c: c.median(cfg), default=None)


def checkpoint_moves(cands: list[Candidate]) -> dict[str, Any]:
    """The stable layouts a checkpoint of this model is proven to move into: each loaded the sweep's reference
    checkpoint (torch_dist, written by the reference layout) resharded into its own layout and computed the
    reference's loss and gradient norm on the reference batch (issue 17)."""
    proven = [c for c in cands if c.explore.result.checks.equivalence_rel_err is not None]
    writers = sorted({str(c.explore.result.reference_load["from_layout"]) for c in proven
                      if c.explore.result.reference_load})
    return {
        "layouts": [c.layout.short() for c in proven],
        "written_by": writers,
        "note": ("a torch_dist checkpoint of the model's weights loads into each of these layouts (resharded) and "
                 "computes the same loss; `sweeper migrate SPACE --from LAYOUT --to LAYOUT` proves one move with "
                 "your own layouts, steps and save included"),
    }


def best_layout_document(cfg: SweepConfig, winner: Candidate, mlflow_uri: str | None,
                         cands: list[Candidate] | None = None) -> dict[str, Any]:
    chosen_by = winner.median_run(cfg)  # the run whose objective is the median that chose the winner
    result = chosen_by.result
    layout = winner.layout
    production = cfg.production_layout(layout) or layout  # what the exports launch (issue 43)
    return {
        "name": cfg.name,
        "model": cfg.model.name,
        "proxy": PROXY_NOTE if is_proxy(cfg.model) else False,
        "trial": winner.number,
        "layout": layout.to_dict(),
        "layout_string": layout.to_string(),
        "production": {"gpus": production.world_size, "copies": copies(cfg, layout),
                       "layout_string": production.to_string(), "global_batch_size": production.gbs},
        "megatron_args": layout_args(cfg, production),
        "megatron_bridge_overrides": dotted_overrides(cfg, production),
        "run": {"framework": cfg.run.framework, **cfg.run.model_dump(exclude_defaults=True)},
        "measured": dict(vars(result.metrics)),
        "measured_run": {"phase": chosen_by.phase, "attempt": chosen_by.attempt},
        "measured_median_over_runs": {
            cfg.search.objective: statistics.median(winner.measured(cfg.search.objective)),
            "runs": len(winner.runs),
        },
        "objective": {
            "name": objective_name(cfg),
            "production_gpus": production_gpus(cfg),
            "copies": copies(cfg, layout),
            "median": winner.median(cfg),
            "runs": [{"phase": r.phase, "attempt": r.attempt, "projected": v,
                      "measured": getattr(r.result.metrics, cfg.search.objective)}
                     for r, v in zip(winner.runs, winner.values(cfg), strict=True)],
        },
        "confirmation": {
            "runs": len(winner.confirmations),
            "steps": [len(r.result.step_times_s) for r in winner.confirmations],
            "step_time_drift": [step_time_drift(r.result, cfg.training.warmup_steps) for r in winner.confirmations],
            "max_step_time_drift": cfg.search.confirm_max_step_time_drift,
        },
        "memory": {
            "predicted_gib": winner.explore.predicted_memory_gib,
            "measured_gib": result.metrics.peak_memory_gib,
            "measured_kind": "host RSS (CPU backend)" if result.memory_kind == "host" else "device reserved",
            "gpu_memory_gib": cfg.cluster.gpu_memory_gib,
            "headroom": cfg.search.memory_headroom,
        },
        "checkpoint_moves_to": checkpoint_moves(cands if cands is not None else [winner]),
        "backend": result.backend,
        "mlflow": {
            "tracking_uri": mlflow_uri,
            "run_id": winner.explore.mlflow_run_id,
            "confirmation_run_ids": [r.mlflow_run_id for r in winner.confirmations],
        },
    }
