"""Every verdict on a measured run, in one place: passed and stable (``is_stable``), steady (``steady``), what a
failure says about the layout (``NOT_THE_LAYOUTS``). The candidates, the frontier, the confirmation and the choice of
the winner all ask here."""

from __future__ import annotations

import statistics

from sweeper.config.schema import SweepConfig
from sweeper.record.schema import TrialResult

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


