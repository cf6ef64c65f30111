"""Unit tests of LayoutStudy, the Optuna side of a sweep: what it proposes and what it tells Optuna.

No trial runs here: the loops below STAND IN for the sweep, "launching" a proposal by telling Optuna a synthetic
throughput (rises with PP*EP*MBS*W) at once. The sweep loop itself is tested in test_search_loop.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.plan.assess import assess_all
from sweeper.plan.space import enumerate_layouts
from sweeper.search.propose.study import CONSTRAINT, LayoutStudy
from sweeper.space.layout import Layout

# 2,304 combinations, 130 of them valid for tiny-moe (4 experts, 2 query groups, 4 layers; the smaller layouts run
# their share of the production batch, which their largest micro-batches cannot hold).
MANY_INVALID: dict[str, Any] = {
    "name": "study",
    "model": "tiny-moe",
    "cluster": {"nodes": 2, "gpus_per_node": 4, "gpu_memory_gib": 4, "compute_capability": "9.0"},
    "training": {"seq_length": 64, "global_batch_size": 8, "steps": 4},
    "space": {"gpus": [2, 4, 8], "tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8], "cp": [1, 2], "ep": [1, 2, 4, 8],
              "mbs": [1, 2, 4], "precision": ["bf16", "mxfp8"]},
}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> SweepConfig:
    path = tmp_path_factory.mktemp("space") / "space.yaml"
    path.write_text(yaml.safe_dump(MANY_INVALID))
    return load_config(path)


@pytest.fixture(scope="module")
def launchable(cfg: SweepConfig) -> list[Layout]:
    return [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.launchable]


def speed(layout: Layout) -> float:
    return 100.0 * layout.pp * layout.ep * layout.mbs * layout.world_size


def drive(study: LayoutStudy, proposals: int) -> list[Layout]:
    """Stand-in sweep: propose, 'launch' (tell the synthetic speed), never a layout twice."""
    seen: list[Layout] = []
    taken: set[Layout] = set()
    for _ in range(proposals):
        proposal = study.propose(taken.__contains__)
        if proposal is None:
            break
        seen.append(proposal.layout)
        taken.add(proposal.layout)
        study.tell(proposal.trial, speed(proposal.layout), infeasible=False)
    return seen


def test_space_is_mostly_invalid(cfg: SweepConfig, launchable: list[Layout]) -> None:
    assert len(enumerate_layouts(cfg)) == 2304 and len(launchable) == 130


@pytest.mark.parametrize("mode", ["ordered", "random", "tpe"])
def test_every_proposal_is_a_launchable_layout_not_yet_taken_and_asks_are_bounded(
        cfg: SweepConfig, launchable: list[Layout], tmp_path: Path, mode: str) -> None:
    # Every 4th launchable layout (37) keeps the journal's fsyncs short; TPE draws over all 2,304 combinations.
    candidates = launchable[::4]
    study = LayoutStudy(cfg, tmp_path / "journal.log", mode, 0, candidates)  # type: ignore[arg-type]
    proposals = len(candidates) if mode != "tpe" else 25
    seen = drive(study, proposals)
    assert len(seen) == proposals and len(set(seen)) == len(seen) and set(seen) <= set(candidates)
    assert study.counts.asks <= 2 * len(seen)
    if mode != "tpe":
        assert study.counts.asks == len(seen)  # each is one enqueued candidate, nothing declined
        assert study.propose(set(seen).__contains__) is None  # every candidate proposed: the study is done
    else:
        assert study.counts.infeasible + study.counts.duplicates > 0  # TPE's own draws did miss, and were replaced


def test_tpe_study_ends_when_every_candidate_was_proposed(cfg: SweepConfig, launchable: list[Layout],
                                                          tmp_path: Path) -> None:
    few = launchable[:8]
    study = LayoutStudy(cfg, tmp_path / "journal.log", "tpe", 0, few)
    seen = drive(study, 100)
    assert sorted(seen) == sorted(few)
    assert study.counts.asks <= 2 * len(few)


def test_ordered_study_visits_candidates_in_the_given_order(cfg: SweepConfig, launchable: list[Layout],
                                                             tmp_path: Path) -> None:
    order = list(reversed(launchable[::4]))
    study = LayoutStudy(cfg, tmp_path / "journal.log", "ordered", 0, order)
    assert drive(study, 1000) == order


def test_queued_layouts_come_first_and_a_taken_one_is_dropped_as_fail(cfg: SweepConfig, launchable: list[Layout],
                                                                       tmp_path: Path) -> None:
    study = LayoutStudy(cfg, tmp_path / "journal.log", "ordered", 0, launchable)
    first, invalid = launchable[5], Layout(world_size=8, tp=8, sp=True, gbs=8)
    study.enqueue(first)
    study.enqueue(invalid)  # a seed that is not launchable is still handed out: the sweep refuses and records it
    taken = {first}
    proposal = study.propose(taken.__contains__)
    assert proposal is not None and proposal.layout == invalid
    states = [t.state for t in study.study.get_trials(deepcopy=False)]
    assert states[0] == TrialState.FAIL and study.study.trials[0].user_attrs["declined"] == "duplicate"


def test_tpe_duplicates_are_fail_never_pruned_and_tpe_reads_each_layout_once(
        cfg: SweepConfig, launchable: list[Layout], tmp_path: Path) -> None:
    study = LayoutStudy(cfg, tmp_path / "journal.log", "tpe", 3, launchable)
    seen = drive(study, 30)
    best = max(seen, key=speed)
    study.enqueue(best, again=True)  # a re-proposal of the best layout so far
    seen += drive_once(study, seen)
    trials = study.study.get_trials(deepcopy=False)
    assert study.counts.duplicates >= 1
    assert not [t for t in trials if t.state == TrialState.PRUNED]
    declined = [t for t in trials if t.state == TrialState.FAIL]
    assert len(declined) == study.counts.duplicates and all("declined" in t.user_attrs for t in declined)
    # What TPE models (COMPLETE and PRUNED trials, samplers/_tpe/sampler.py): each launched layout once, with its
    # value, plus each non-launchable draw at most once, infeasible.
    modelled = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    layouts = [study.layout_of(t.params) for t in modelled]
    assert len(set(layouts)) == len(layouts)
    for trial, layout in zip(modelled, layouts):
        if layout in seen:
            assert trial.value == speed(layout) and trial.constraints[CONSTRAINT] == 0.0
        else:
            assert layout not in launchable and trial.value == 0.0 and trial.constraints[CONSTRAINT] > 0
    assert {lo for lo in layouts if lo in seen} == set(seen)


def drive_once(study: LayoutStudy, seen: list[Layout]) -> list[Layout]:
    proposal = study.propose(set(seen).__contains__)
    assert proposal is not None and proposal.layout not in seen
    study.tell(proposal.trial, speed(proposal.layout), infeasible=False)
    return [proposal.layout]


def test_tpe_puts_an_empty_pruned_trial_in_the_bad_group_and_ignores_a_failed_one(tmp_path: Path) -> None:
    """Why a duplicate is FAIL: pins the Optuna 5 TPE behaviour the study relies on (a private function, on
    purpose: if an Optuna upgrade changes it, this says so)."""
    from optuna.samplers._tpe.sampler import _split_trials

    def study_with_duplicate(state: TrialState) -> optuna.Study:
        study = optuna.create_study(direction="maximize")
        dist = optuna.distributions.CategoricalDistribution([1, 2, 4])
        for x, value in [(4, 10.0), (2, 5.0), (1, 1.0), (1, 2.0)]:
            study.add_trial(optuna.trial.create_trial(params={"x": x}, distributions={"x": dist}, value=value))
        study.add_trial(optuna.trial.create_trial(params={"x": 4}, distributions={"x": dist}, state=state))
        return study

    pruned = study_with_duplicate(TrialState.PRUNED)
    modelled = pruned.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    below, above = _split_trials(pruned, modelled, n_below=1)
    assert [t.params["x"] for t in below] == [4]
    assert [t.state for t in above if t.params["x"] == 4] == [TrialState.PRUNED]  # counts against the best layout
    failed = study_with_duplicate(TrialState.FAIL)
    assert len(failed.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))) == 4


def test_a_resumed_study_remembers_what_it_told_infeasible(cfg: SweepConfig, launchable: list[Layout],
                                                             tmp_path: Path) -> None:
    journal = tmp_path / "journal.log"
    first = LayoutStudy(cfg, journal, "tpe", 1, launchable)
    drive(first, 15)
    again = LayoutStudy(cfg, journal, "tpe", 1, launchable)
    assert first.told_infeasible and again.told_infeasible == first.told_infeasible


def test_a_journal_lock_a_killed_driver_left_behind_is_taken_over(cfg: SweepConfig, launchable: list[Layout],
                                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   ) -> None:
    """SIGKILL during a journal append leaves the lock file; the resumed driver (here opened by a relative path, as
    `search --out sweep` gives it) takes the lock over after JOURNAL_LOCK_GRACE_S instead of spinning on it."""
    import time

    from sweeper.search.propose.study import JOURNAL_LOCK_GRACE_S

    monkeypatch.chdir(tmp_path)
    LayoutStudy(cfg, Path("journal.log"), "tpe", 0, launchable)
    (tmp_path / "journal.log.lock").write_text("")  # what the dead driver left
    started = time.monotonic()
    study = LayoutStudy(cfg, Path("journal.log"), "tpe", 0, launchable)
    assert study.propose(lambda lo: False) is not None
    assert time.monotonic() - started < JOURNAL_LOCK_GRACE_S + 10
    assert not (tmp_path / "journal.log.lock").exists()
