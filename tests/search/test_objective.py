"""The production run's throughput as the sweep's one objective (sweeper/search/decide/objective.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.estimate.calibration import Calibration
from sweeper.plan.assess import build_plan
from sweeper.record.schema import TrialChecks, TrialMetrics, TrialRecord, TrialResult
from sweeper.search.decide import objective
from sweeper.search.decide.best_layout import best_layout_document
from sweeper.search.decide.candidates import candidates
from sweeper.search.decide.objective import (
    PROJECTED_STEP_ERROR,
    copies,
    extra_step_s,
    extra_steps_s,
    objective_value,
    predicted_objective,
    predicted_objectives,
    production_gpus,
    production_layout,
    projection,
)
from sweeper.space.layout import Layout

ROOT = Path(__file__).resolve().parents[2]

SPACE = {
    "name": "objective", "model": "tiny-moe",
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_memory_gib": 80, "compute_capability": "9.0"},
    "training": {"seq_length": 64, "global_batch_size": 16, "steps": 4},
    "space": {"gpus": [8, 16], "tp": [1, 2], "pp": [1, 2], "ep": [1, 2]},
}


def _cfg(tmp_path: Path, objective: str | None = None, **budget):
    data = dict(SPACE)
    if objective:
        data["search"] = {"objective": objective}
    if budget:
        data["budget"] = {"tokens": 1e9, **budget}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def _passed(tokens_per_s: float, step_time_s: float) -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens_per_s, step_time_s=step_time_s))


def test_the_production_run_has_the_clusters_gpus_unless_the_budget_names_them(tmp_path: Path):
    assert production_gpus(_cfg(tmp_path)) == 16
    assert production_gpus(_cfg(tmp_path, gpus=64)) == 64


def test_a_layout_stands_for_its_copies_on_the_production_run(tmp_path: Path):
    cfg = _cfg(tmp_path)
    layout = Layout(world_size=8, tp=2, pp=2, gbs=16, mbs=1)
    production = production_layout(cfg, layout)
    assert copies(cfg, layout) == 2 and production is not None
    assert (production.world_size, production.dp, production.gbs) == (16, 4, 32)
    assert production.num_microbatches == layout.num_microbatches  # each data-parallel rank's micro-batches kept
    assert production_layout(cfg, Layout(world_size=16, gbs=16)) == Layout(world_size=16, gbs=16)


def test_the_objective_is_the_copies_rate_less_the_larger_data_parallelisms_extra_step(tmp_path: Path):
    cfg = _cfg(tmp_path)
    small, large = Layout(world_size=8, tp=2, gbs=16), Layout(world_size=16, tp=2, gbs=16)
    extra = extra_step_s(cfg, small)
    assert extra > 0  # the gradient reduce over 8 DP ranks costs more than over 4
    value = objective_value(_passed(1000.0, 0.5), cfg, small)
    assert value == 2 * 1000.0 * 0.5 / (0.5 + extra) < 2000.0
    # Raw tokens/s would rank the 16-GPU layout at 1.8x first; as the production run it is second.
    assert objective_value(_passed(1800.0, 0.5), cfg, large) == 1800.0 < value
    assert objective_value(_passed(0.0, 0.5), cfg, small) == 0.0


def test_the_projected_part_is_priced_with_the_sweeps_calibration(tmp_path: Path):
    cfg = _cfg(tmp_path)
    small = Layout(world_size=8, tp=2, gbs=16)
    uncalibrated = extra_step_s(cfg, small)
    # The sweep measured the data-parallel reduce three times slower than the estimator's first guess.
    slow_reduce = Calibration(step_term_factors={"dp": 3.0}, samples=3)
    priced = extra_step_s(cfg, small, slow_reduce)
    assert priced > 1.5 * uncalibrated
    assert objective_value(_passed(1000.0, 0.5), cfg, small, slow_reduce) == 2 * 1000.0 * 0.5 / (0.5 + priced)
    made_of = projection(cfg, small, 0.5, slow_reduce)
    assert made_of.calibrated and not projection(cfg, small, 0.5).calibrated
    assert made_of.projected_share == priced / (0.5 + priced)
    rate = objective_value(_passed(1000.0, 0.5), cfg, small, slow_reduce)
    low, high = made_of.band(rate)
    assert low == rate * (0.5 + priced) / (0.5 + priced * (1 + PROJECTED_STEP_ERROR)) < rate < high


def test_tflops_per_gpu_counts_the_gpus_the_copies_leave_idle(tmp_path: Path):
    cfg = _cfg(tmp_path, objective="tflops_per_gpu", gpus=24)
    large = Layout(world_size=16, tp=2, gbs=16)  # one copy on 24 GPUs: 8 stay idle
    result = TrialResult(status="passed", metrics=TrialMetrics(tflops_per_gpu=300.0, step_time_s=0.5))
    assert objective_value(result, cfg, large) == 300.0 * 16 / 24


def _stable(tokens_per_s: float, step_time_s: float) -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens_per_s, step_time_s=step_time_s,
                                                             peak_memory_gib=1.0),
                       checks=TrialChecks(True, True, True, True, True, True), memory_kind="device")


def test_two_trials_of_one_production_layout_are_one_candidate_the_largest_standing_for_it(tmp_path: Path):
    cfg = _cfg(tmp_path)
    small, large = Layout(world_size=8, tp=2, gbs=8), Layout(world_size=16, tp=2, gbs=16)
    assert production_layout(cfg, small) == large
    # Selection test data: the 8-GPU trial's projection (2 copies) is the higher, most of its step measured less.
    records = [TrialRecord(1, small.to_dict(), _stable(1000.0, 0.5)),
               TrialRecord(2, large.to_dict(), _stable(1500.0, 0.6))]
    cands = candidates(records, cfg)
    assert [(c.number, c.layout.world_size) for c in cands] == [(2, 16)]
    doc = best_layout_document(cfg, cands[0], None)
    assert doc["objective"]["measured_on_gpus"] == 16 and doc["objective"]["projected_share"] == 0.0
    small_doc = best_layout_document(cfg, candidates(records[:1], cfg)[0], None)
    extra = extra_step_s(cfg, small)
    assert small_doc["objective"]["projected_share"] == extra / (0.5 + extra) > 0


@pytest.mark.parametrize("space", ["benchmarks/spaces/nemotron_wide.yaml", "search_spaces/moe_knobs.yaml"])
def test_objectives_priced_together_equal_them_layout_by_layout(space: str):
    """A plan's table and the frontier price every valid layout's production step together (issue 54): the same
    figures, exactly, as one layout at a time, uncalibrated and under a calibration of the terms."""
    cfg = load_config(ROOT / space)
    plan = build_plan(cfg)
    valid = [e for e in plan if e.valid]
    layouts = [e.layout for e in valid]
    assert sum(copies(cfg, lo) > 1 for lo in layouts) >= 20  # the production run holds copies of many of them
    predictions = [e.predicted for e in valid]
    calibration = Calibration(step_term_factors={"dp": 3.0, "edp": 0.7}, step_time_factor=1.3, samples=3)
    together = predicted_objectives(cfg, layouts, predictions)
    together_calibrated = extra_steps_s(cfg, layouts, calibration)
    objective._EXTRA_S.clear()  # the one-by-one figures priced afresh, not read back from the memo filled above
    assert together == [predicted_objective(cfg, lo, p) for lo, p in zip(layouts, predictions)]
    assert together_calibrated == [extra_step_s(cfg, lo, calibration) for lo in layouts]
    # Asked again (a frontier after each event), they come from the memo: the same.
    assert predicted_objectives(cfg, layouts, predictions) == together
