"""Every verdict on a measured run, in one place: passed and stable (``is_stable``), steady (``steady``), a
confirmation's trajectory held against the reference layout's (``held_to_trajectory``), what a failure says about
the layout (``NOT_THE_LAYOUTS``). The candidates, the frontier, the confirmation and the choice of
the winner all ask here."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from sweeper.config.schema import SweepConfig
from sweeper.record.schema import GATE_SKIPPED, TrialResult
from sweeper.trial.aggregate import NODE_LOST, RANK_FAULT
from sweeper.trial.reference import Trajectory

MIN_STEPS_FOR_DRIFT = 8  # fewer timed steps than this: too few for two quarters to mean anything


def step_time_drift(result: TrialResult, warmup_steps: int) -> float | None:
    """The mean step time of the last quarter of the steps over that of the first quarter (warm-up steps left out;
    the mean, so a quarter's stalls count); None when too few steps were timed."""
    times = result.step_times_s[warmup_steps:]
    if len(times) < MIN_STEPS_FOR_DRIFT:
        return None
    quarter = len(times) // 4
    first = statistics.fmean(times[:quarter])
    return statistics.fmean(times[-quarter:]) / first if first > 0 else None


def stall_ratio(result: TrialResult) -> float | None:
    """The timed steps' 90th percentile over their median (1.0: every step alike); None when not recorded."""
    m = result.metrics
    if not m.step_time_p90_s or not m.step_time_median_s:
        return None
    return m.step_time_p90_s / m.step_time_median_s


def unsteady_reasons(result: TrialResult, cfg: SweepConfig) -> list[str]:
    """What made a run unsteady, in words: its step time drifted, or it stalls, past the limits
    (``search.confirm_max_step_time_drift``, ``search.confirm_max_step_time_p90``); empty when neither."""
    reasons = []
    drift = step_time_drift(result, cfg.training.warmup_steps)
    if drift is not None and drift > cfg.search.confirm_max_step_time_drift:
        reasons.append(f"the last quarter of its steps took {drift:.2f}x the first "
                       f"(search.confirm_max_step_time_drift {cfg.search.confirm_max_step_time_drift:g})")
    stall = stall_ratio(result)
    if stall is not None and stall > cfg.search.confirm_max_step_time_p90:
        reasons.append(f"its steps' 90th percentile is {stall:.2f}x their median: it stalls "
                       f"(search.confirm_max_step_time_p90 {cfg.search.confirm_max_step_time_p90:g})")
    return reasons


def steady(result: TrialResult, cfg: SweepConfig) -> bool:
    """The step time neither drifted nor stalled past the limits (``search.confirm_max_step_time_drift``,
    ``search.confirm_max_step_time_p90``). On the CPU backend (host memory) trials share the machine's cores, so
    another trial starting slows this one: both are recorded there, not held against the layout."""
    return result.memory_kind == "host" or not unsteady_reasons(result, cfg)


# Failures that say nothing about the layout: the infrastructure (a node or rank lost) or a bug in sweeper itself
# (internal).
NOT_THE_LAYOUTS = ("infra", "internal")

# The notes ``attribute`` adds when it moves a failure to or from the layout.
HANG_WITH_NODE_LOST = "a hang while one of its nodes was lost: the node's, not the layout's"
CRASHED_AGAIN = "a rank failed on a live node on {n} attempts: the layout's"


def attribute(result: TrialResult, earlier: list[TrialResult]) -> TrialResult:
    """Whose fault an ended attempt is, given the earlier attempts of the same trial and phase (``earlier``). A rank
    that died (or failed with an error that is neither Megatron's nor a known environment fault) while Ray says its
    node stayed alive is retried once as ``infra``; the second time it is the layout's (``crash``): a kernel that
    segfaults or reads out of bounds in this layout does it again. The other way round, a hang while one of the
    trial's nodes was lost is the node's (``infra``), not the layout's ``timeout``."""
    node_lost = NODE_LOST in result.notes
    if result.failure_kind == "timeout" and node_lost:
        return replace(result, failure_kind="infra", notes=[*result.notes, HANG_WITH_NODE_LOST])
    if result.failure_kind != "infra" or RANK_FAULT not in result.notes or node_lost:
        return result
    before = sum(1 for r in earlier if RANK_FAULT in r.notes and NODE_LOST not in r.notes)
    if before < 1:
        return result
    return replace(result, failure_kind="crash", notes=[*result.notes, CRASHED_AGAIN.format(n=before + 1)])



# The note a sweep adds to a trial it ran without its equivalence reference (the reference could not be made).
GATE_OFF = "equivalence gate off: the sweep has no reference"


def proven(result: TrialResult) -> bool:
    """The equivalence gate ran on this trial: the sweep had its reference and the layout could take its batch (a
    gate skipped for the layout, e.g. a padded vocabulary TP does not divide, proves nothing either)."""
    return GATE_OFF not in result.notes and not any(n.startswith(GATE_SKIPPED) for n in result.notes)


def is_stable(result: TrialResult, cfg: SweepConfig) -> bool:
    """Passed, proven by the equivalence gate (unless ``search.require_equivalence`` is false), within the
    memory headroom (under routing stress too, when the trial ran it), and (unless ``search.allow_cross_node_tp``)
    no TP or ETP group ran across nodes."""
    if not result.passed:
        return False
    if cfg.search.require_equivalence and not proven(result):
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




def good_confirmation(result: TrialResult, cfg: SweepConfig) -> bool:
    """A confirmation run that confirms: stable (``is_stable``: passed, proven, within the memory headroom under
    routing stress, no TP across nodes) and steady. The confirmation phase and the choice of the winner both ask
    this, so a run that passed but is not stable neither fills a confirmation slot nor wins."""
    return is_stable(result, cfg) and steady(result, cfg)


# How far a correct layout's loss and gradient-norm trajectory strays from the reference layout's on the same data,
# global batch and starting weights, by precision: the largest per-step relative difference (loss or gradient
# norm) a layout that passed every check measured over 12 steps on the CPU backend, times TRAJECTORY_MARGIN, rounded
# up to one significant figure (tests/data/trajectory_band.json, scripts/measure_trajectory_band.py: tiny-gpt and
# tiny-moe, TP2+SP, PP2, DP2, EP2 and two four-rank layouts; tests/backends/test_trajectory_band.py holds the values
# to it; docs/how-it-works.md). A precision not measured here (FP16, FP8, FP4: no CPU run) is compared and
# recorded, not held against the layout.
TRAJECTORY_MARGIN = 3.0
TRAJECTORY_BAND: dict[str, float] = {
    # Worst 2.4e-7 (tiny-moe PP2): rounding only, no growth over the steps.
    "fp32": 8e-7,
    # Worst 1.0e-2 (tiny-moe EP2 at four ranks): MoE routing ties flip in BF16 and the paths part.
    "bf16": 4e-2,
}
TRAJECTORY_UNMEASURED = "trajectory compared, not held: no measured band for precision {precision}"


def trajectory_rel_errs(losses: list[float], grad_norms: list[float], ref_losses: list[float],
                        ref_grad_norms: list[float]) -> list[float]:
    """Each step's relative difference from the reference trajectory: the larger of the loss's and the gradient
    norm's (inf where a value is not finite), over the steps both ran."""
    def rel(value: float, ref: float) -> float:
        if not (math.isfinite(value) and math.isfinite(ref)):
            return math.inf
        return abs(value - ref) / max(abs(ref), 1e-12)

    steps = min(len(losses), len(grad_norms), len(ref_losses), len(ref_grad_norms))
    return [max(rel(losses[i], ref_losses[i]), rel(grad_norms[i], ref_grad_norms[i])) for i in range(steps)]


def diverged(result: TrialResult, reference: Trajectory, band: float) -> str | None:
    """Why the run's trajectory left the reference's (naming the first step beyond ``band``), or None."""
    errs = trajectory_rel_errs(result.losses, result.grad_norms, reference.losses, reference.grad_norms)
    step = next((i for i, err in enumerate(errs) if err > band), None)
    if step is None:
        return None
    return (f"its loss and gradient-norm trajectory left the reference layout {reference.layout}'s at step "
            f"{step + 1} (of {len(errs)}): loss {result.losses[step]:.6g} vs {reference.losses[step]:.6g}, gradient "
            f"norm {result.grad_norms[step]:.6g} vs {reference.grad_norms[step]:.6g}, relative difference "
            f"{errs[step]:.3g} > the {reference.precision} band {band:g} (same data, global batch and weights)")


def held_to_trajectory(result: TrialResult, reference: Trajectory | None) -> TrialResult:
    """A confirmation held against the reference layout's trajectory: failed (kind ``equivalence``: the layout
    computes another training run than the proven one) when it left the precision's band, naming the step; a note
    saying how close it stayed otherwise. Unchanged when it did not pass or there is no reference trajectory."""
    if not result.passed or reference is None:
        return result
    band = TRAJECTORY_BAND.get(reference.precision)
    if band is None:
        return replace(result, notes=[*result.notes, TRAJECTORY_UNMEASURED.format(precision=reference.precision)])
    why = diverged(result, reference, band)
    if why is not None:
        return replace(result, status="failed", failure_kind="equivalence", error=why)
    errs = trajectory_rel_errs(result.losses, result.grad_norms, reference.losses, reference.grad_norms)
    return replace(result, notes=[*result.notes, f"trajectory within the {reference.precision} band {band:g} of the "
                                  f"reference layout {reference.layout}'s over {len(errs)} steps (largest relative "
                                  f"difference {max(errs, default=0.0):.3g})"])
