"""Every output of a rehearsal says its figures were modelled, and a folder holds one kind of sweep (issue 54).

The trial records here are test data (not trial results): the decision's, best_layout.yaml's and the exports' marks
are functions of the records and of ``rehearsal``; the report is rendered from a hand-made sweep folder (the report
tests' fixture). The refusals run the real command line, in-process: a resume of the other kind exits 2 before
anything is written, and a resumed sweep on a simulated cluster larger than this machine exits 1 before a cluster
starts (``SimulatedCluster.start`` is replaced by a failure here only to prove it is never called)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sweeper import cli
from sweeper.cluster.simulated import SimulatedCluster
from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.export import EXECUTABLE, export_files
from sweeper.record.schema import (
    MODELLED,
    SweepMeta,
    TrialChecks,
    TrialMetrics,
    TrialRecord,
    TrialResult,
    is_rehearsal,
)
from sweeper.record.sweepdir import SweepDir
from sweeper.report.render import render_report
from sweeper.search.command import refuse_other_kind
from sweeper.search.decide.best_layout import best_layout_document
from sweeper.search.decide.candidates import candidates, choose
from sweeper.search.decide.decision import decision, summary_line
from sweeper.search.progress import Progress
from sweeper.search.run.sweep import SearchOptions
from sweeper.trial.host import simulated_capacity_refusal
from sweeper.trial.rehearsal import BACKEND
from tests.report.test_report import write_fixture_sweep

ROOT = Path(__file__).resolve().parents[2]
MARK = "MODELLED, NOT MEASURED"


def _cfg(tmp_path: Path) -> SweepConfig:
    path = tmp_path / "space.yaml"
    path.write_text((ROOT / "search_spaces" / "quickstart.yaml").read_text() + "budget: {tokens: 1e9, gpus: 8}\n")
    return load_config(path)


def _records(cfg: SweepConfig) -> list[TrialRecord]:
    """A winner run twice and a runner-up, as a rehearsal records them (its backend, device memory)."""
    def passed(tokens: float) -> TrialResult:
        return TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tokens, step_time_s=1.0,
                                                                 peak_memory_gib=1.0),
                           checks=TrialChecks(True, True, True, True, True, True), memory_kind="device",
                           backend=BACKEND, step_times_s=[1.0] * 6)

    win, runner = (layout_from_string(cfg, t).to_dict() for t in ("gpus=4,ep=4,mbs=2", "gpus=4,tp=2,ep=2,mbs=1"))
    return [TrialRecord(1, win, passed(1000.0)), TrialRecord(1, win, passed(900.0), phase="confirm"),
            TrialRecord(2, runner, passed(500.0))]


@pytest.mark.parametrize("rehearsal", [True, False])
def test_the_decision_best_layout_and_exports_say_modelled_only_for_a_rehearsal(tmp_path: Path,
                                                                               rehearsal: bool) -> None:
    cfg = _cfg(tmp_path)
    records = _records(cfg)
    cands = candidates(records, cfg)
    winner = choose(cands, cfg)
    assert winner is not None
    block = decision(cfg, cands, winner, records, rehearsal=rehearsal)
    assert block is not None
    kind = MODELLED if rehearsal else "measured"
    assert {e["tokens_per_s"]["basis"] for e in block["layouts"]} == {kind}
    assert block["layouts"][0]["tokens_per_s"]["median"] == 950.0  # the runs' figures, whatever their kind
    assert f", {kind} 1.0 GiB." in block["layouts"][0]["why"]
    assert (summary_line(block) or "").endswith(f"(throughput {kind} on 4 GPUs, 0% of the step projected to 8 GPUs)")

    document = best_layout_document(cfg, winner, None, cands, rehearsal)
    assert list(document)[0] == "rehearsal"
    assert (str(document["rehearsal"]).startswith(f"{MODELLED}: a rehearsal") if rehearsal
            else document["rehearsal"] is False)
    assert yaml.safe_load(yaml.safe_dump(document, sort_keys=False))["rehearsal"] == document["rehearsal"]

    files = export_files(cfg, winner.layout, winner.number, rehearsal=rehearsal)
    for name, text in files.items():
        header = text.splitlines()[:3]
        assert any(MARK in line for line in header) is rehearsal, name
        assert all(line.startswith(("#", "#!")) for line in header), name
        if name in EXECUTABLE:
            assert header[0] == "#!/usr/bin/env bash"  # the script still runs
    if rehearsal:  # the mark is added above the same export, nothing else changes
        plain = export_files(cfg, winner.layout, winner.number)
        assert all(set(plain[n].splitlines()) <= set(files[n].splitlines()) for n in files)


def test_a_rehearsals_report_opens_with_a_banner_and_draws_no_self_comparison(tmp_path: Path) -> None:
    (tmp_path / "rehearsed").mkdir()
    (tmp_path / "real").mkdir()
    rehearsed = write_fixture_sweep(tmp_path / "rehearsed")
    meta = json.loads((rehearsed / "sweep.json").read_text())
    dominated = [{"layout": "TP8-PP1", "reason": "slower than trial 0 on every term"}]
    (rehearsed / "sweep.json").write_text(json.dumps({**meta, "rehearsal": True, "dominated": dominated}))
    page = render_report(rehearsed).read_text()
    banner = page.index("class='rehearsal'")
    assert banner < page.index("<dl>") and MARK in page[banner:banner + 200]
    assert "Predicted vs modelled peak memory" in page and "Predicted vs measured" not in page
    assert "would compare the estimator with itself" in page
    assert "Median absolute error of the memory prediction" not in page
    assert "(modelled, a rehearsal)" in page  # the best layout's figures
    assert "1 layouts dominated by a modelled trial" in page

    real = write_fixture_sweep(tmp_path / "real")
    page = render_report(real).read_text()
    assert "class='rehearsal'" not in page and MARK not in page and "Predicted vs measured peak memory" in page


@pytest.mark.parametrize("modelled", [True, False])
def test_the_progress_lines_best_says_modelled_in_a_rehearsal(modelled: bool) -> None:
    progress = Progress(max_trials=4, objective="tokens_per_s", started=0.0, clock=lambda: 60.0, modelled=modelled)
    line = progress.line([], running=0, launched=1, best=("TP1-PP2", 1234.5))
    assert ("best TP1-PP2 1,234.5 tokens_per_s (modelled) |" in line) is modelled
    assert "best TP1-PP2 1,234.5 tokens_per_s |" in line or modelled
    projected = Progress(max_trials=4, objective="tokens_per_s", started=0.0, clock=lambda: 60.0, modelled=modelled,
                         production_gpus=16)
    text = "(modelled, projected to 16 GPUs)" if modelled else "(projected to 16 GPUs)"
    assert f"best TP1-PP2 1,234.5 tokens_per_s {text} |" in projected.line([], running=0, launched=1,
                                                                           best=("TP1-PP2", 1234.5))


def test_a_rehearsals_folder_from_before_sweep_json_said_so_is_known_by_its_trials(tmp_path: Path) -> None:
    folder = write_fixture_sweep(tmp_path)
    trials = folder / "trials.jsonl"
    trials.write_text(trials.read_text().replace('"megatron-core-gpu"', json.dumps(BACKEND)))
    assert "rehearsal" not in json.loads((folder / "sweep.json").read_text())
    assert "class='rehearsal'" in render_report(folder).read_text()


def _folder(tmp_path: Path, rehearsal: bool | None, backend: str | None = None) -> Path:
    out = tmp_path / "sweep"
    out.mkdir()
    meta = SweepMeta(name="quickstart", status="interrupted")
    if rehearsal is not None:
        meta.rehearsal = rehearsal
    (out / "sweep.json").write_text(json.dumps(meta.to_json()))
    if backend is not None:  # a folder from before sweep.json said which kind: its trials' backend does
        result = TrialResult(status="passed", backend=backend, memory_kind="device")
        (out / "trials.jsonl").write_text(json.dumps(TrialRecord(0, {"tp": 1}, result).to_json()) + "\n")
    return out


def _search(out: Path, *extra: str, space: str = "quickstart") -> int:
    return cli.main(["search", space, "--out", str(out), "--resume", "-q", "--set", "cluster.simulate=true",
                     *extra])


@pytest.mark.parametrize(("rehearsal", "backend", "flags", "says"), [
    (False, None, ["--rehearse"], "holds a sweep that ran trials; a rehearsal (--rehearse) resumes only"),
    (True, None, [], "holds a rehearsal (modelled trials); resume it with --rehearse"),
    (None, BACKEND, [], "holds a rehearsal (modelled trials); resume it with --rehearse"),
    (None, "megatron-core-cpu", ["--rehearse"], "holds a sweep that ran trials"),
])
def test_a_resume_of_the_other_kind_is_refused_in_one_line_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, rehearsal: bool | None,
        backend: str | None, flags: list[str], says: str) -> None:
    monkeypatch.setattr(SimulatedCluster, "start", _no_cluster)
    out = _folder(tmp_path, rehearsal, backend)
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir())
    assert _search(out, *flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: --resume: ") and says in lines[-1]
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir()) == before  # nothing written, no lock taken


def _no_cluster(self: SimulatedCluster) -> SimulatedCluster:
    raise AssertionError("a simulated cluster was started")


def test_a_resumed_sweep_on_a_simulated_cluster_larger_than_the_machine_is_refused_before_it_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SimulatedCluster, "start", _no_cluster)
    out = _folder(tmp_path, False)
    # 4,096 simulated nodes: over 1 TB of Ray processes, more than any machine running this test holds.
    assert _search(out, "--set", "cluster.nodes=4096") == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: quickstart: cluster.nodes: a simulated cluster of 4096 nodes x 2 GPUs needs about")


def test_a_resumed_sweep_makes_the_fresh_runs_cpu_backend_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: DeepSeek-V3 on 128 x 8 resumed in a rehearsal's folder without --rehearse. Before issue 54
    it skipped the checks a fresh run makes and started 128 simulated nodes on a 2-core machine."""
    monkeypatch.setattr(SimulatedCluster, "start", _no_cluster)
    out = _folder(tmp_path, True)
    assert _search(out, space=str(ROOT / "search_spaces" / "deepseek_v3_1024.yaml")) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("a simulated cluster of 128 nodes x 8 GPUs needs about" in line
            or "no layout of this space can run on the CPU backend of a simulated cluster" in line), line


def test_the_capacity_check_sums_rays_head_its_nodes_and_one_rank() -> None:
    cfg = load_config(ROOT / "search_spaces" / "deepseek_v3_1024.yaml")
    refusal = simulated_capacity_refusal(cfg, memory_gib=23.0)  # 1.7 + 127 x 0.25 + 1.0 = 34.45 GiB
    assert refusal is not None and "needs about 34.5 GiB" in refusal and "has 23.0 GiB" in refusal
    assert "--rehearse" in refusal and "--address ADDR" in refusal
    assert simulated_capacity_refusal(cfg, memory_gib=34.5) is None
    quickstart = load_config(ROOT / "search_spaces" / "quickstart.yaml")  # 2 x 2: 1.95 GiB of Ray, 1 rank
    assert simulated_capacity_refusal(quickstart, memory_gib=2.95) is None
    assert simulated_capacity_refusal(quickstart, memory_gib=2.9) is not None


@pytest.mark.parametrize(("rehearsal", "backend", "kind"), [
    (True, None, True), (False, None, False), (None, BACKEND, True), (None, "megatron-core-gpu", False),
    (None, None, None),
])
def test_a_folder_of_the_same_kind_resumes(tmp_path: Path, rehearsal: bool | None, backend: str | None,
                                           kind: bool | None) -> None:
    out = _folder(tmp_path, rehearsal, backend)
    folder = SweepDir(out)
    assert is_rehearsal(folder.read_meta(), folder.read_trials()) is kind
    for rehearse in (True, False) if kind is None else (kind,):  # a folder with nothing recorded takes either
        refuse_other_kind(SweepDir(out), SearchOptions(out=out, resume=True, rehearse=rehearse))
