"""`sweeper replan` (issue 54): a finished sweep re-ranked for a production run of another size.

The sweep folder here is made by the test, without Ray: the quickstart space with an 8-GPU production run, trial
records that are test data for the arithmetic (a GPU sweep's winner run twice, a runner-up; device memory), the
decision the sweep's end writes from them, and a calibration in the folder as a GPU sweep stores it. At the sweep's
own N the replan must give back the decision's figures and its winner; at a larger N the measured step moves by
exactly what the calibrated estimator prices the new production layout over the old one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sweeper import cli
from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.errors import UsageError
from sweeper.estimate import Estimator
from sweeper.estimate.calibration import Calibration, save
from sweeper.estimate.calibrator import key
from sweeper.record.schema import SweepMeta, TrialChecks, TrialMetrics, TrialRecord, TrialResult
from sweeper.record.sweepdir import SET_HEADER, SweepDir
from sweeper.search.decide.candidates import candidates, choose
from sweeper.search.decide.decision import decision
from sweeper.search.decide.replan import at_gpus, microbatches, open_sweep, replan

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = Calibration(step_time_factor=1.3, samples=3, step_term_factors={"dp": 2.0, "optimizer": 1.5})


def _passed(tokens: float, step: float) -> TrialResult:
    return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens, step_time_s=step,
                                                             peak_memory_gib=1.0),
                       checks=TrialChecks(True, True, True, True, True, True), memory_kind="device",
                       backend="megatron-core-gpu", step_times_s=[step] * 6)


def make_sweep(root: Path, *, status: str = "finished", rehearsal: bool = False) -> Path:
    """A finished GPU sweep's folder, as `search` leaves it (the files replan reads)."""
    root.mkdir(parents=True, exist_ok=True)
    text = (ROOT / "search_spaces" / "quickstart.yaml").read_text()
    (root / "space.yaml").write_text(f"{SET_HEADER}budget.gpus=4\n" + text + "budget: {tokens: 1e9, gpus: 8}\n")
    cfg = load_config(root / "space.yaml", overrides=["budget.gpus=4"])
    win, runner = (layout_from_string(cfg, t) for t in ("gpus=4,ep=4,mbs=1", "gpus=4,tp=2,ep=2,mbs=1"))
    # tokens per step of a 4-GPU trial on the 4-GPU production run: the whole batch, 8 sequences of 64 tokens
    records = [TrialRecord(1, win.to_dict(), _passed(5120.0, 0.1)),
               TrialRecord(1, win.to_dict(), _passed(4800.0, 512 / 4800.0), phase="confirm"),
               TrialRecord(2, runner.to_dict(), _passed(2560.0, 0.2))]
    folder = SweepDir(root)
    for record in records:
        folder.append_trial(record)
    save(root / "calibration.json", key(cfg), CALIBRATION, shared=False)
    cands = candidates(records, cfg, CALIBRATION)
    winner = choose(cands, cfg)
    assert winner is not None and winner.number == 1
    meta = SweepMeta(name=cfg.name, status=status, rehearsal=rehearsal, memory_kind="device",
                     best={"number": 1, "layout": winner.layout.short(), "tokens_per_s": winner.median(cfg)},
                     decision=decision(cfg, cands, winner, records, CALIBRATION, rehearsal=rehearsal))
    folder.write_meta(meta)
    return root


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    return make_sweep(tmp_path / "sweep")


def _cfg(sweep: Path) -> SweepConfig:
    return open_sweep(sweep).cfg


def test_the_sweeps_own_size_gives_back_its_decision_and_winner(sweep: Path) -> None:
    folder = open_sweep(sweep)
    assert folder.cfg.production_gpus == 4  # the sweep's --set item, from space.yaml's header
    assert folder.calibration == CALIBRATION  # the folder's calibration.json, under the sweep's key
    plan = replan(folder, 4)
    meta = json.loads((sweep / "sweep.json").read_text())
    assert plan.winner is not None and plan.winner.number == 1 and not plan.winner_changed
    assert plan.winner.objective == meta["best"]["tokens_per_s"]  # the choice's median objective, exactly
    decided = {e["number"]: e["production"] for e in meta["decision"]["layouts"]}
    for row in plan.rows:
        if row.number is not None:
            assert row.tokens_per_s == decided[row.number]["tokens_per_s"]
            assert row.step_time_s == decided[row.number]["step_time_s"]
            assert row.moved_s == {} and row.before is not None
    assert "stays the choice" in plan.why


def test_a_larger_run_moves_the_step_by_the_estimators_difference(sweep: Path) -> None:
    folder = open_sweep(sweep)
    cfg = folder.cfg
    plan = replan(folder, 8)
    row = next(r for r in plan.rows if r.number == 1)
    trial = layout_from_string(cfg, "gpus=4,ep=4,mbs=1")
    before, after = cfg.production_layout(trial), at_gpus(cfg, 8).production_layout(
        layout_from_string(at_gpus(cfg, 8), "gpus=4,ep=4,mbs=1"))
    assert before is not None and after is not None
    assert (before.dp, after.dp) == (4, 8) and after.gbs == before.gbs == cfg.training.global_batch_size
    assert (microbatches(before), microbatches(after)) == (2, 1)  # global batch / (DP x MBS): fewer per rank
    estimator = Estimator.for_config(cfg, CALIBRATION)
    old, new = estimator(before), estimator(after)
    assert row.layout == after
    for term in ("dp", "edp", "optimizer"):  # the gradient reduce over more ranks, the smaller optimizer shard
        moved = new.step_time_terms_s.get(term, 0.0) - old.step_time_terms_s.get(term, 0.0)
        if abs(moved) >= 0.005 * (old.step_time_s or 0.0):
            assert row.moved_s[term] == pytest.approx(moved)
    assert new.step_time_terms_s["dp"] > old.step_time_terms_s["dp"]
    assert new.breakdown["optimizer"] < old.breakdown["optimizer"]  # the distributed optimizer's shard
    decided = next(e for e in json.loads((sweep / "sweep.json").read_text())["decision"]["layouts"]
                   if e["number"] == 1)["production"]
    step = decided["step_time_s"] + (new.step_time_s or 0.0) - (old.step_time_s or 0.0)
    assert row.step_time_s == pytest.approx(step)
    assert row.tokens_per_s == pytest.approx(decided["tokens_per_s"] * decided["step_time_s"] / step)
    assert row.days == pytest.approx(1e9 / row.tokens_per_s / 86400)
    assert "micro-batches per DP rank 2 -> 1" in plan.why or plan.winner_changed


def test_layouts_that_cannot_run_at_the_new_size_are_refused_with_the_reason(sweep: Path) -> None:
    plan = replan(open_sweep(sweep), 2)
    assert {r["number"] for r in plan.refused} == {1, 2}
    assert all("more than the production run's 2" in r["reason"] for r in plan.refused)
    assert plan.winner is None and plan.original is None and plan.winner_changed
    assert "cannot run on 2 GPUs" in plan.why
    assert all(r.needs_trial and r.needs_trial.startswith("never measured") for r in plan.rows)


def test_unmeasured_layouts_are_predicted_and_flagged_when_they_beat_the_choice(sweep: Path) -> None:
    plan = replan(open_sweep(sweep), 4)
    predicted = [r for r in plan.rows if r.number is None]
    assert predicted and {r.kind for r in predicted} == {"predicted (calibrated)"}
    lead = plan.winner.tokens_per_s if plan.winner else 0.0
    for row in predicted:
        assert (row.needs_trial is not None) == (row.tokens_per_s > lead)
        assert row.predicted.fits
    assert plan.unmeasured["predicted"] >= len(predicted)


def test_bad_input_is_a_usage_error(tmp_path: Path, sweep: Path) -> None:
    with pytest.raises(UsageError, match="no such folder"):
        open_sweep(tmp_path / "missing")
    with pytest.raises(UsageError, match="not a finished sweep"):
        open_sweep(make_sweep(tmp_path / "running", status="running"))
    with pytest.raises(UsageError, match="only budget"):
        open_sweep(sweep, ["training.global_batch_size=16"])
    with pytest.raises(UsageError, match="not a multiple of any"):
        replan(open_sweep(sweep), 3)


def test_a_rehearsal_folder_replans_and_says_modelled(tmp_path: Path) -> None:
    plan = replan(open_sweep(make_sweep(tmp_path / "rehearsed", rehearsal=True)), 8)
    assert plan.folder.rehearsal and "modelled" in plan.why
    assert {r.kind for r in plan.rows if r.number is not None} == {"modelled"}


def _listing(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in root.rglob("*")}


def test_the_command_line(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _listing(sweep)
    assert cli.main(["replan", str(sweep), "--gpus", "8", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gpus"] == 8 and document["original_gpus"] == 4 and document["layouts"]
    assert cli.main(["replan", str(sweep), "--set", "budget.gpus=8", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in document.items() if k != "seconds"}
    out = tmp_path / "replan.yaml"
    assert cli.main(["replan", str(sweep), "--gpus", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "8-GPU production run" in printed and "nothing was written" in printed
    assert yaml.safe_load(out.read_text())["gpus"] == 8
    assert _listing(sweep) == before  # nothing written into the sweep folder
    for argv, said in ((["replan", str(tmp_path / "missing"), "--gpus", "8"], "no such folder"),
                       (["replan", str(sweep), "--gpus", "3"], "not a multiple"),
                       (["replan", str(sweep)], "--gpus N"),
                       (["replan", str(sweep), "--gpus", "8", "--set", "budget.gpus=16"], "contradicts"),
                       (["replan", str(sweep), "--gpus", "8", "--set", "model.num_layers=2"], "only budget"),
                       (["replan", str(sweep), "--gpus", "0"], "positive")):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)
