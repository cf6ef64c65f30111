"""The default proposer (search.propose.ranked, issue 54): the calibrated estimator's order, a share of exploring turns
to the layout the fit is least sure of, and a ranked study that resumes where its journal left it.

No trial runs here: the loops STAND IN for the sweep, telling the step-time model a synthetic measured step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.estimate import Estimator
from sweeper.estimate.calibrator import Calibrator, Measured
from sweeper.estimate.step_fit import StepModel
from sweeper.plan.assess import assess_all
from sweeper.plan.space import enumerate_layouts
from sweeper.record.schema import TrialMetrics, TrialResult
from sweeper.search.propose.frontier import Frontier
from sweeper.search.propose.ranked import EXPLORE, OPTIMISM, ORDER, Ranked, explores
from sweeper.search.propose.refit import predicted_objective
from sweeper.search.propose.study import PROPOSED_BY, LayoutStudy
from sweeper.space.layout import Layout
from tests.search.stand_ins import EverythingSupported

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "search_spaces" / "quickstart.yaml"
NEMOTRON = ROOT / "search_spaces" / "nemotron.yaml"  # a GPU cluster: the frontier ranks by the step model's pricing


def launchable(cfg: SweepConfig) -> list[Layout]:
    return [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.launchable]


def test_explores_spreads_its_share_evenly() -> None:
    assert [k for k in range(12) if explores(k, 0.25)] == [3, 7, 11]
    assert not any(explores(k, 0.0) for k in range(100))
    assert all(explores(k, 1.0) for k in range(10))


def test_without_exploration_a_ranked_study_visits_the_frontiers_order_and_follows_its_refit(tmp_path: Path) -> None:
    """Exploration 0: each proposal is the frontier's best predicted untried layout before a trial is measured (the
    estimator's own order), and the refit model's best predicted one after measured trials refitted it (the
    frontier's candidates, re-ranked by ``refit.predicted_objective``: it prices the production run's extra step with
    the refit's factors, where the frontier's order keeps the estimator's price for it)."""
    cfg = load_config(NEMOTRON)
    calibrator = Calibrator(cfg, tmp_path, shared=False)
    frontier = Frontier(cfg, EverythingSupported(), calibrator, [], lambda layout: False)  # type: ignore[arg-type]
    study = LayoutStudy(cfg, tmp_path / "journal.log", "ranked", 0, [e.layout for e in frontier.launchable],
                        Ranked(cfg, calibrator.step, exploration=0.0))
    order = [e.layout for e in frontier.launchable]
    seen: list[Layout] = []
    for _ in range(4):  # nothing measured: the estimator's order
        proposal = study.propose(seen.__contains__)
        assert proposal is not None and proposal.trial.user_attrs[PROPOSED_BY] == ORDER
        seen.append(proposal.layout)
        study.tell(proposal.trial, 1.0, infeasible=False)
    assert seen == order[:4]
    # The first four measured at 1.3, 0.9, 1.6 and 1.1 times their predicted step: the level and a term refitted.
    for number, (layout, off) in enumerate(zip(seen, (1.3, 0.9, 1.6, 1.1), strict=True), 1):
        step = off * calibrator.step.step_time_s(layout)
        update = calibrator.add(layout, Measured(passed=True, step_time_s=step), number)
        frontier.decide(layout)
        frontier.learn(number, layout, TrialResult(status="passed", metrics=TrialMetrics(step_time_s=step)),
                       update.changed)
    assert calibrator.step.factors(), "a term was fitted on its own: the refit can change the order"
    rest = [e.layout for e in frontier.launchable if not frontier.taken(e.layout)]
    study.set_candidates(rest)
    for _ in range(4):
        proposal = study.propose(lambda lo: frontier.taken(lo) or lo in seen)
        assert proposal is not None
        seen.append(proposal.layout)
        study.tell(proposal.trial, 1.0, infeasible=False)
    refitted = sorted(rest, key=lambda lo: -predicted_objective(calibrator.step, lo, cfg))  # stable: ties in order
    assert seen[4:] == refitted[:4]
    unfitted = StepModel(Estimator.for_config(cfg))
    assert refitted != sorted(rest, key=lambda lo: -predicted_objective(unfitted, lo, cfg)), \
        "the refit re-ranked what was left"


@pytest.fixture(scope="module")
def fitted() -> tuple[SweepConfig, StepModel, list[Layout]]:
    """The quickstart's step model on a simulated cluster after three measured trials, and the untried layouts."""
    cfg = load_config(QUICKSTART)
    model = StepModel(Estimator.for_config(cfg, host_cores=2))
    layouts = launchable(cfg)
    for layout, off in zip(layouts[:3], (1.5, 0.8, 2.5), strict=True):
        model.add(layout, off * model.step_time_s(layout))
    return cfg, model, layouts[3:]


def test_an_exploring_turn_picks_the_layout_the_fit_is_least_sure_of(fitted: tuple) -> None:
    cfg, model, untried = fitted
    predicted = {lo: predicted_objective(model, lo, cfg) for lo in untried}
    best = max(untried, key=predicted.__getitem__)
    bar = math.log(max([*predicted.values(), *(predicted_objective(model, lo, cfg) for lo in model.layouts)]))
    hopeful = {lo: model.log_sd(lo) for lo in untried
               if math.log(predicted[lo]) + OPTIMISM * model.log_sd(lo) >= bar}
    widest = max(hopeful, key=hopeful.__getitem__)
    assert widest != best and hopeful[widest] > model.log_sd(best)  # the quickstart's fit does leave a doubt
    ranked = Ranked(cfg, model, exploration=0.25)
    assert ranked(untried, 2) == (best, ORDER)  # not an exploring turn
    assert ranked(untried, 3) == (widest, EXPLORE)
    assert Ranked(cfg, model, exploration=0.0)(untried, 3) == (best, ORDER)
    # A layout that could not reach the best predicted even at OPTIMISM sds is never explored, however unsure.
    hopeless = [lo for lo in untried if lo not in hopeful]
    assert hopeless and ranked([best, *hopeless], 3) == (best, ORDER)


def test_nothing_measured_leaves_nothing_to_explore() -> None:
    cfg = load_config(QUICKSTART)
    model = StepModel(Estimator.for_config(cfg, host_cores=2))
    layouts = launchable(cfg)
    best = max(layouts, key=lambda lo: predicted_objective(model, lo, cfg))
    assert Ranked(cfg, model, exploration=1.0)(layouts, 0) == (best, ORDER)


def test_a_resumed_ranked_study_keeps_its_turns_and_proposes_nothing_taken(fitted: tuple, tmp_path: Path) -> None:
    """A driver killed after three ranked proposals: the resumed study counts them from the journal (its fourth turn
    explores, as it would have), and proposes no layout the sweep already decided."""
    cfg, model, untried = fitted
    journal = tmp_path / "journal.log"
    first = LayoutStudy(cfg, journal, "ranked", 0, untried, Ranked(cfg, model, exploration=0.25))
    decided: list[Layout] = []
    for _ in range(3):
        proposal = first.propose(decided.__contains__)
        assert proposal is not None and proposal.trial.user_attrs[PROPOSED_BY] == ORDER
        decided.append(proposal.layout)
        first.tell(proposal.trial, 1.0, infeasible=False)
    again = LayoutStudy(cfg, journal, "ranked", 0, untried, Ranked(cfg, model, exploration=0.25))
    proposal = again.propose(decided.__contains__)
    assert proposal is not None and proposal.layout not in decided
    assert proposal.trial.user_attrs[PROPOSED_BY] == EXPLORE
    assert Ranked(cfg, model, 0.25)([lo for lo in untried if lo not in decided], 3) == (proposal.layout, EXPLORE)
    assert len(again.study.trials) == 4


def test_a_ranked_study_needs_its_chooser_and_only_it_does(tmp_path: Path) -> None:
    cfg = load_config(QUICKSTART)
    with pytest.raises(ValueError, match="chooser"):
        LayoutStudy(cfg, tmp_path / "a.log", "ranked", 0, [])
    with pytest.raises(ValueError, match="chooser"):
        LayoutStudy(cfg, tmp_path / "b.log", "tpe", 0, [], Ranked(cfg, StepModel(Estimator.for_config(cfg))))


@pytest.mark.parametrize("space, host_cores, off", [
    (ROOT / "benchmarks" / "spaces" / "landscape_dense.yaml", 2, 300.0),  # the CPU trials' level (docs/benchmarks.md)
    (QUICKSTART, 2, 250.0),
    (NEMOTRON, None, 1.3),
])
def test_one_measured_trial_keeps_the_estimators_order(space: Path, host_cores: int | None, off: float) -> None:
    """Issue 54: a fit of the level alone scales every layout's step alike, so after one measured trial the ranked
    proposer's order is its prior's (the estimator's, never refitted). The production run's extra data-parallel step
    is priced with the refit's factors too: left at the estimator's price, the dense GPT's order changed after one
    CPU trial (a level of 300 made the extra step a 300th of what the prior weighed it at)."""
    cfg = load_config(space)
    layouts = launchable(cfg)
    model = StepModel(Estimator.for_config(cfg, host_cores=host_cores))
    prior = {lo: predicted_objective(model, lo, cfg) for lo in layouts}
    first = max(layouts, key=prior.__getitem__)
    model.add(first, off * model.step_time_s(first))
    assert not model.factors() and math.isclose(model.level, off)
    # Every layout's predicted objective 1/off of its prior's (the order kept, twins tied as before, to rounding).
    scaled = {lo.short(): predicted_objective(model, lo, cfg) * off / prior[lo] for lo in layouts}
    assert all(math.isclose(r, 1.0, rel_tol=1e-9) for r in scaled.values()), \
        sorted(scaled.items(), key=lambda kv: abs(kv[1] - 1))[-3:]


def test_a_refit_ranks_by_its_freed_terms_only_once_they_out_predict_the_level_alone() -> None:
    """Issue 54, the dense GPT's CPU landscape: three trials (two BF16 layouts, then an FP32 one twice as fast as its
    BF16 twin, which the estimator prices alike) let the fit free a term, the bubble, to explain a cost it has no
    term for; ranked by that fit, the pipelined FP32 layout the estimator ranked fourth (the landscape's best) fell
    below a BF16 layout. Freed terms that have predicted no trial rank nothing: the order stays the prior's, scaled by
    the level alone, until they predict a trial they had not seen better than the level alone does."""
    cfg = load_config(ROOT / "benchmarks" / "spaces" / "landscape_dense.yaml")
    layouts = launchable(cfg)
    model = StepModel(Estimator.for_config(cfg, host_cores=2))
    prior = {lo: predicted_objective(model, lo, cfg) for lo in layouts}
    by_name = {lo.short(): lo for lo in layouts}
    # The landscape's measured steps (tests/data/landscape_dense.json, medians at the trial's share of the batch).
    for name, step in (("TP2-PP1-DP1-SP-MBS4-bf16", 0.336), ("TP1-PP2-DP1-MBS4-bf16", 0.338),
                       ("TP2-PP1-DP1-SP-MBS4-fp32", 0.169)):
        model.add(by_name[name], step)
    assert model.fit.factors, "the fit freed a term"
    assert not model.refit_leads and model.held_out == {"refit": 0.0, "level": 0.0}
    ratios = [predicted_objective(model, lo, cfg) / prior[lo] for lo in layouts]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)  # the prior's order: every layout scaled alike
    best, bf16 = by_name["TP1-PP2-DP1-MBS4-fp32"], by_name["TP1-PP1-DP2-MBS2-bf16"]
    assert prior[best] > prior[bf16] and model.step_time_s(best) > model.step_time_s(bf16)  # the fit would swap them
    # A fourth trial the freed terms predicted exactly, the level alone 20 % off: from then on they rank.
    fourth = by_name["TP1-PP2-DP1-MBS4-RC-full-bf16"]
    assert model.ranking_step_s(fourth) < 0.85 * model.step_time_s(fourth)
    model.add(fourth, model.step_time_s(fourth))
    assert model.refit_leads and model.held_out["refit"] == pytest.approx(0.0, abs=1e-20)
    assert all(model.ranking_step_s(lo) == model.step_time_s(lo) for lo in layouts)


def test_a_trial_the_level_alone_misses_beyond_the_prior_hands_the_freed_terms_the_ranking_at_once() -> None:
    """The dense GPT's landscape again, but its pipelined BF16 layout measured 20 times slower than the estimator
    prices it (the two PP1 layouts as priced): the level alone misses it by more than the prior lets a term lie from
    the level (a factor of three), so the freed terms rank before they have predicted a trial, and the untried
    pipelined layouts fall behind. The dense GPT's own three trials (a factor of two) stay within the prior."""
    cfg = load_config(ROOT / "benchmarks" / "spaces" / "landscape_dense.yaml")
    layouts = launchable(cfg)
    by_name = {lo.short(): lo for lo in layouts}
    model = StepModel(Estimator.for_config(cfg, host_cores=2))
    trials = ("TP2-PP1-DP1-SP-MBS4-bf16", "TP1-PP2-DP1-MBS4-bf16", "TP2-PP1-DP1-SP-MBS4-fp32")
    for name in trials:
        layout = by_name[name]
        model.add(layout, model.terms(layout).seconds() * (20.0 if layout.pp == 2 else 1.0))
    assert model.fit.factors and model.held_out == {"refit": 0.0, "level": 0.0}
    assert model.beyond_prior and model.refit_leads
    assert all(model.ranking_step_s(lo) == model.step_time_s(lo) for lo in layouts)
    untried = [lo for lo in layouts if lo.short() not in trials]
    best = min(untried, key=model.ranking_step_s)
    assert best.pp == 1 and min(model.terms(lo).seconds() for lo in untried if lo.pp == 2) < model.terms(best).seconds()
    dense = StepModel(Estimator.for_config(cfg, host_cores=2))
    for name, step in zip(trials, (0.336, 0.338, 0.169), strict=True):
        dense.add(by_name[name], step)
    assert dense.fit.factors and not dense.beyond_prior and not dense.refit_leads
