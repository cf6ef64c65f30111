"""The term table (issue 54): a recalibration as one vectorised pass equals a fresh prediction, layout by layout,
over whole spaces; the frontier re-predicts through it."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import orjson
import pytest

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.estimate import Calibration, Estimator
from sweeper.estimate.calibrator import Calibrator
from sweeper.estimate.step_time import PP_BUBBLE, StepTerms
from sweeper.estimate.term_table import TermTable
from sweeper.plan.assess import Plan, PlanEntry, assess_all, assess_tabled
from sweeper.plan.space import enumerate_layouts
from sweeper.search.propose.frontier import Frontier
from tests.search.stand_ins import EverythingSupported

ROOT = Path(__file__).resolve().parents[2]
WIDE = ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml"  # 11,520 layouts, 2,040 valid, MoE + Mamba
DEEPSEEK = ROOT / "search_spaces" / "deepseek_v3_1024.yaml"


def _calibrations(table: TermTable) -> list[Calibration | None]:
    return [
        None,
        Calibration(activation_factor=1.37, state_factor=0.71, overhead_gib=2.3, step_time_factor=1.21, samples=4,
                    step_term_factors={PP_BUBBLE: 1.3, table.stage_terms[0]: 0.77, table.step_terms_names[-1]: 2.0}),
        Calibration(activation_factor=0.52, state_factor=1.4, overhead_gib=-0.4, step_time_factor=0.8, samples=2),
    ]


def _equal_to_fresh(cfg: SweepConfig) -> None:
    valid = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.valid]
    table = TermTable.build(Estimator.for_config(cfg), valid)
    worst_ranks = set()
    for calibration in _calibrations(table):
        fresh = Estimator.new_for_config(cfg, calibration)
        got = table.estimates(calibration)
        assert len(got) == len(valid)
        for layout, estimate in zip(valid, got):
            want = fresh(layout)
            assert estimate == want, layout.short()  # every figure bit for bit, the breakdown's too
            assert estimate.to_json() == want.to_json(), layout.short()
        # The JSON a plan writes, made from the arrays a column at a time: the same text as the Estimates'.
        columns = table.predict(calibration).json_of(range(len(valid)))
        assert orjson.dumps(columns) == orjson.dumps([e.to_json() for e in got])
        worst_ranks.add(tuple(e.breakdown["pipeline_rank"] for e in got))
    assert len(worst_ranks) > 1, "the calibrations should move some layout's worst pipeline stage"


def test_recalibrated_predictions_equal_fresh_ones_over_a_whole_space() -> None:
    _equal_to_fresh(load_config(WIDE))


@pytest.mark.slow
def test_recalibrated_predictions_equal_fresh_ones_over_the_deepseek_v3_space() -> None:
    _equal_to_fresh(load_config(DEEPSEEK))  # 198,720 layouts, 53,739 valid; about a minute


def test_a_new_hot_rank_factor_is_a_new_table() -> None:
    cfg = load_config(WIDE)
    estimator = Estimator.for_config(cfg)
    table = TermTable.build(estimator, [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)[:200]) if e.valid])
    assert table.serves(estimator, Calibration(state_factor=0.8))
    assert not table.serves(estimator, Calibration(moe_hot_rank_factor=3.0))


def test_plan_through_the_table_equals_the_layout_by_layout_plan() -> None:
    cfg = load_config(WIDE)
    layouts = enumerate_layouts(cfg)
    calibration = Calibration(activation_factor=1.2, state_factor=0.9, overhead_gib=1.0, step_time_factor=1.1)
    tabled, _ = assess_tabled(cfg, layouts, calibration)
    assert [e.to_json() for e in tabled] == [e.to_json() for e in assess_all(cfg, layouts, calibration)]


@pytest.mark.parametrize("calibration", [None, Calibration(step_time_factor=1.1, activation_factor=1.05),
                                         Calibration(step_term_factors={"tp": 1.3, "compute.mamba.bf16": 0.9})])
def test_layouts_whose_terms_run_in_another_order_than_the_columns_are_priced_as_the_estimator_prices_them(
        calibration: Calibration | None) -> None:
    # On PP8 the slowest stage of some hybrid layouts holds Mamba layers and no attention: its terms start with
    # compute.mamba.*, which the columns put after recompute. A sum over the columns rounded 1 ULP otherwise than the
    # layout's own sum in 491 of 129,024 layouts of benchmarks/driver_events.py's space (found by that benchmark).
    cfg = load_config(WIDE, overrides=["cluster.nodes=8", "space.gpus=[64]", "space.pp=[4,8]",
                                       "training.global_batch_size=4096"])
    layouts = enumerate_layouts(cfg)
    tabled, table = assess_tabled(cfg, layouts, calibration)
    assert len(table.unordered) > 100 and not table.terms_in_column_order
    assert [e.predicted for e in tabled] == [e.predicted for e in assess_all(cfg, layouts, calibration)]
    from sweeper.estimate.term_table import step_seconds

    terms = [e.predicted.step_terms for e in tabled if e.predicted is not None]
    assert step_seconds(terms, calibration).tolist() == [  # type: ignore[arg-type]
        t.seconds((calibration or Calibration()).step_factor) for t in terms]  # type: ignore[union-attr]


def _plan_order(entry: PlanEntry) -> tuple[int, float, float]:
    """The plan's order, one entry at a time: fitting layouts by predicted throughput, then inside the band and
    over it by predicted memory, then the invalid ones."""
    if not entry.valid:
        return (4, 0.0, 0.0)
    p = entry.predicted
    assert p is not None
    if p.fits:
        return (1, -(p.tokens_per_s or 0.0), p.memory_gib)
    return (2 if p.may_fit else 3, p.memory_gib, 0.0)


@pytest.mark.parametrize("calibration", [None, Calibration(activation_factor=1.2, state_factor=0.9, overhead_gib=1.0,
                                                           step_time_factor=1.1)])
def test_the_plans_order_and_json_from_arrays_equal_the_layout_by_layout_ones(
        calibration: Calibration | None, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    from sweeper.cli import _write_json_array

    cfg = load_config(WIDE)
    plan = Plan.build(cfg, calibration=calibration)
    want = sorted(assess_all(cfg, enumerate_layouts(cfg), calibration), key=_plan_order)  # a stable sort
    assert [e.layout for e in plan.entries()] == [e.layout for e in want]
    assert orjson.dumps(plan.to_json()) == orjson.dumps([e.to_json() for e in want])
    # What `plan --json` writes, a part at a time (parts of 997: the valid ones' end falls inside a part), is the
    # whole array's text.
    _write_json_array(plan.json_text(997))
    assert capsysbinary.readouterr().out == orjson.dumps([e.to_json() for e in want], option=orjson.OPT_APPEND_NEWLINE)
    assert len({_plan_order(e)[0] for e in want}) == 4  # every group of the order is there


def test_the_frontier_repredicts_a_recalibrated_space_as_a_fresh_assessment() -> None:
    cfg = load_config(WIDE)
    with tempfile.TemporaryDirectory() as tmp:
        host = EverythingSupported()
        frontier = Frontier(cfg, host, Calibrator(cfg, Path(tmp)), [], lambda layout: False)  # type: ignore[arg-type]
        for calibration in (Calibration(activation_factor=1.5, state_factor=0.6, step_time_factor=1.3),
                            Calibration(activation_factor=1.1, moe_hot_rank_factor=2.5)):  # a new table
            frontier.calibrator.current = calibration
            frontier.launchable = frontier._launchable()  # what learn() does on a change
            fresh = assess_all(cfg, enumerate_layouts(cfg), calibration)
            assert [e.to_json() for e in frontier.assessed] == [e.to_json() for e in fresh]


def test_the_columns_keep_every_layouts_order_of_terms() -> None:
    from sweeper.estimate.term_table import _column_order

    assert _column_order([["a", "b", "d"], ["a", "c", "d"], ["b", "c"]]) == ["a", "b", "c", "d"]
    assert _column_order([["x", "y"], ["y", "x"]]) == ["x", "y"]  # conflicting: the first seen first, none lost


def test_a_layout_whose_terms_leave_the_columns_order_gets_its_json_from_its_estimate() -> None:
    cfg = load_config(WIDE)
    valid = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.valid]
    table = TermTable.build(Estimator.for_config(cfg), valid)
    first = table.terms[0]
    swapped = StepTerms(dict(reversed(first.stage.items())), first.microbatches, first.bubble_slots, first.step)
    mixed = dataclasses.replace(table, terms=(swapped, *table.terms[1:]), unordered=np.array([0]))  # as built
    assert table.terms_in_column_order and not mixed.terms_in_column_order
    predicted = mixed.predict(None)
    assert predicted.per_step() is None
    assert predicted.json_of([0, 1]) == [predicted.estimate(0).to_json(), predicted.estimate(1).to_json()]
    assert list(predicted.json_of([0])[0]["step_time_terms_s"]) == list(swapped.per_step())
