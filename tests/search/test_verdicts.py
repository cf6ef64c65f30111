"""Whose fault an ended attempt is (``search.decide.verdicts.attribute``) and what proves a trial
(``verdicts.proven``): pure functions over TrialResults (no Ray, no Megatron)."""

from __future__ import annotations

import math

from sweeper.record.schema import GATE_SKIPPED, TrialChecks, TrialMetrics, TrialResult
from sweeper.search.decide.verdicts import (
    GATE_OFF,
    TRAJECTORY_BAND,
    attribute,
    held_to_trajectory,
    proven,
    trajectory_rel_errs,
)
from sweeper.trial.aggregate import RANK_FAULT
from sweeper.trial.reference import Trajectory
from sweeper.trial.runner import NODE_LOST, PLACEMENT_TIMEOUT


def _failed(kind: str, *notes: str) -> TrialResult:
    return TrialResult(status="failed", failure_kind=kind, error="rank 1 (n0): rank process died", notes=list(notes))


def test_a_rank_that_dies_on_a_live_node_is_retried_once_then_is_the_layouts() -> None:
    first = _failed("infra", RANK_FAULT)
    assert attribute(first, []) is first  # once: it may have been the node's
    second = attribute(_failed("infra", RANK_FAULT), [first])
    assert second.failure_kind == "crash" and "on 2 attempts" in second.notes[-1]


def test_a_rank_lost_with_its_node_stays_infra_however_often() -> None:
    lost = _failed("infra", RANK_FAULT, NODE_LOST)
    assert attribute(lost, [lost, lost]).failure_kind == "infra"
    # an earlier node loss is no evidence against the layout either
    assert attribute(_failed("infra", RANK_FAULT), [lost]).failure_kind == "infra"


def test_a_trial_stopped_before_its_ranks_ran_is_never_the_layouts() -> None:
    placement = _failed("infra", PLACEMENT_TIMEOUT)
    assert attribute(placement, [placement, placement]).failure_kind == "infra"


def test_a_hang_while_its_node_was_lost_is_the_nodes_not_the_layouts() -> None:
    hang = TrialResult(status="failed", failure_kind="timeout", error="timeout: ...", notes=[NODE_LOST])
    assert attribute(hang, []).failure_kind == "infra"
    alone = TrialResult(status="failed", failure_kind="timeout", error="timeout: ...")
    assert attribute(alone, []).failure_kind == "timeout"  # a hang on live nodes stays the layout's


def test_a_gate_skipped_for_the_layout_proves_nothing() -> None:
    passed = TrialResult(status="passed", metrics=TrialMetrics(peak_memory_gib=1.0),
                         checks=TrialChecks(True, True, True, True, True, True))
    assert proven(passed)
    passed.notes.append(f"{GATE_SKIPPED}: the reference's padded vocabulary 50304 is not divisible by tp=3")
    assert not proven(passed)
    assert not proven(TrialResult(status="passed", notes=[GATE_OFF]))


def test_steps_that_stall_one_in_four_measure_slower_than_steady_ones_of_the_same_median_and_do_not_confirm(
        tmp_path) -> None:
    """issue 53: the step time was the median of the timed steps, blind to a layout that stalls one step in four."""
    import yaml

    from sweeper.backends.base import RankReport
    from sweeper.config.load import load_config
    from sweeper.search.decide.verdicts import good_confirmation, stall_ratio
    from sweeper.trial.aggregate import RankOutcome, aggregate

    def measured(times: list[float]) -> TrialResult:
        report = RankReport(rank=0, node_id="n", backend="b", ok=True, step_times_s=times, tokens_per_step=1000,
                            peak_memory_bytes=2**30, memory_kind="device")
        return aggregate([RankOutcome(0, "a", report)], world_size=1, warmup_steps=1, trial_dir=None)

    steady_run = measured([9.0] + [1.0] * 12)
    stalling = measured([9.0] + [1.0, 1.0, 1.0, 2.0] * 3)  # one step in four stalls at 2x
    assert steady_run.metrics.step_time_median_s == stalling.metrics.step_time_median_s == 1.0
    assert stalling.metrics.tokens_per_s < steady_run.metrics.tokens_per_s  # 800 vs 1,000 tokens/s
    assert stalling.metrics.step_time_max_s == 2.0 and stall_ratio(stalling) > 1.25 >= stall_ratio(steady_run)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"name": "v", "model": "tiny-gpt", "cluster": {
        "nodes": 1, "gpus_per_node": 1, "gpu_memory_gib": 80, "compute_capability": "9.0"},
        "training": {"seq_length": 64, "global_batch_size": 8, "steps": 4}}))
    cfg = load_config(path)
    stalling.checks = steady_run.checks = TrialChecks(True, True, True, True, True, True)
    stalling.status = steady_run.status = "passed"
    assert good_confirmation(steady_run, cfg) and not good_confirmation(stalling, cfg)


# -- the confirmation's trajectory held against the reference layout's (issue 53) --------------------------------

def _trajectory(losses: list[float], norms: list[float], precision: str = "fp32") -> Trajectory:
    return Trajectory(layout="TP1-PP1-DP1-MBS1-fp32", precision=precision, gbs=8, losses=losses, grad_norms=norms)


def _confirmation(losses: list[float], norms: list[float]) -> TrialResult:
    return TrialResult(status="passed", losses=losses, grad_norms=norms)


REF_LOSSES = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5]
REF_NORMS = [1.0, 0.9, 0.8, 0.8, 0.7, 0.7]


def test_a_trajectory_within_the_band_passes_with_a_note_saying_how_close() -> None:
    close = [v * (1 + 0.3 * TRAJECTORY_BAND["fp32"]) for v in REF_LOSSES]
    held = held_to_trajectory(_confirmation(close, REF_NORMS), _trajectory(REF_LOSSES, REF_NORMS))
    assert held.passed and "within the fp32 band" in held.notes[-1]


def test_a_gradient_that_leaves_the_band_fails_the_confirmation_naming_the_step() -> None:
    norms = REF_NORMS[:3] + [v * 1.02 for v in REF_NORMS[3:]]  # a drift from step 4 on
    held = held_to_trajectory(_confirmation(REF_LOSSES, norms), _trajectory(REF_LOSSES, REF_NORMS))
    assert not held.passed and held.failure_kind == "equivalence"
    assert held.error is not None and "at step 4 (of 6)" in held.error


def test_a_band_is_per_precision_and_an_unmeasured_one_is_not_held() -> None:
    off = [v * 1.01 for v in REF_LOSSES]  # 1%: beyond FP32's band, within BF16's
    assert not held_to_trajectory(_confirmation(off, REF_NORMS), _trajectory(REF_LOSSES, REF_NORMS)).passed
    assert held_to_trajectory(_confirmation(off, REF_NORMS), _trajectory(REF_LOSSES, REF_NORMS, "bf16")).passed
    fp8 = held_to_trajectory(_confirmation(off, REF_NORMS), _trajectory(REF_LOSSES, REF_NORMS, "fp8"))
    assert fp8.passed and "no measured band for precision fp8" in fp8.notes[-1]


def test_a_non_finite_step_is_beyond_any_band_and_a_failed_run_is_left_alone() -> None:
    assert trajectory_rel_errs([1.0, math.nan], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]) == [0.0, math.inf]
    failed = TrialResult(status="failed", failure_kind="oom", error="out of memory")
    assert held_to_trajectory(failed, _trajectory(REF_LOSSES, REF_NORMS)) is failed
    passed = _confirmation(REF_LOSSES, REF_NORMS)
    assert held_to_trajectory(passed, None) is passed  # no reference trajectory: nothing to hold it against
