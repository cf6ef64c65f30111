"""`sweeper search SPACE --rehearse` (issue 46): the real driver against modelled trials, no GPU and no Ray.

The trials are modelled (that is the feature: trial.rehearsal); the driver, its scheduler and GPU ledger, the study,
the records, MLflow and the report are the real ones."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.errors import UsageError
from sweeper.estimate.disk import checkpoint_bytes
from sweeper.plan.assess import assess_all
from sweeper.plan.space import enumerate_layouts
from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.search.decide.rehearsal import replay, summary
from sweeper.space.layout import Layout
from sweeper.trial.rehearsal import (
    FS_GB_S,
    FS_SHARED_GB_S,
    LAYOUT_SIGMA,
    RUN_SIGMA,
    START_S_PER_RANK,
    Faults,
    RehearsalHost,
    Run,
    term_shares,
)

ROOT = Path(__file__).resolve().parents[2]


def _search(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeper", "search", str(ROOT / "search_spaces" / "nemotron.yaml"),
                           "--rehearse", "--out", str(tmp_path / "out"), "-q", *extra], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SWEEPER_CACHE": str(tmp_path / "cache")})


def test_a_rehearsal_runs_the_whole_sweep_on_modelled_trials_and_says_what_it_cost(tmp_path: Path) -> None:
    proc = _search(tmp_path, "--max-trials", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    figures = json.loads((out / "rehearsal.json").read_text())
    assert figures["rehearsal"] is True and figures["trials"] == 12 and figures["runs"] >= 13  # + the reference
    assert figures["wall_time_h"] > 0 and figures["busy_gpu_hours"] >= figures["wall_time_h"] * 8  # >= 8 GPUs a trial
    assert figures["reserved_gpu_hours"] == pytest.approx(figures["wall_time_h"] * 16)  # the whole 2 x 8 cluster
    assert figures["busy_gpu_hours"] <= figures["reserved_gpu_hours"]
    # The band (issue 54): wall time and GPU-hours at the level's p10, p50 and p90, ordered.
    band = figures["band"]
    for key in ("wall_time_h", "busy_gpu_hours", "reserved_gpu_hours"):
        assert 0 < band["p10"][key] < band["p50"][key] < band["p90"][key], key
    assert figures["valid_layouts"] >= figures["launchable_layouts"]
    assert figures["trials_to_best_caveat"].startswith("optimistic")
    assert 1 <= figures["peak_concurrent_trials"] <= 2  # 16 GPUs, trials of 8 and 16
    assert figures["launchable_layouts"] > 100 and figures["modelled_best_objective"] > 0
    assert figures["trials_to_within_noise_of_best"] is None or 1 <= figures["trials_to_within_noise_of_best"] <= 12
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    launched = [r for r in records if r["attempt"] >= 1]
    assert launched and all(any(n.startswith("rehearsal: modelled") for n in r["result"]["notes"]) for r in launched)
    assert all(r["result"]["backend"].startswith("rehearsal") for r in launched)
    assert (out / "best_layout.yaml").is_file() and (out / "report.html").is_file()
    assert "rehearsal (modelled, not measured)" in proc.stderr and "reserved" in proc.stderr
    # Never mixed with measured runs: nothing in the calibration cache real sweeps read, its own MLflow experiment.
    assert not (tmp_path / "cache" / "calibration.json").exists()
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["mlflow"]["experiment"].endswith("-rehearsal")
    # Every output says it was modelled (issue 54): sweep.json, the decision, the report, best_layout.yaml, the
    # exports and the console's last lines.
    assert meta["rehearsal"] is True
    assert {e["tokens_per_s"]["basis"] for e in meta["decision"]["layouts"]} == {"modelled"}
    assert "class='rehearsal'" in (out / "report.html").read_text()
    assert yaml.safe_load((out / "best_layout.yaml").read_text())["rehearsal"].startswith("modelled: a rehearsal")
    for name in ("launch_megatron_lm.sh", "megatron_bridge_overrides.yaml"):
        assert "MODELLED, NOT MEASURED" in "".join((out / name).read_text().splitlines()[:2]), name
    last = proc.stderr.strip().splitlines()[-2:]
    assert "best stable layout (modelled: a rehearsal, not measured)" in last[0] and "(modelled, not measured)" in last[1]


def test_modelled_faults_are_recorded_as_the_infrastructures_and_retried(tmp_path: Path) -> None:
    # 3 losses per node-hour: at 10 the reference (8 GPUs, full recompute) lost its node on each of its 3 attempts
    # and the sweep stopped before its first trial, as it must without a reference (issue 51).
    proc = _search(tmp_path, "--max-trials", "6", "--rehearse-faults", "node_loss_per_hour=3,hang=0.5")
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "trials.jsonl").read_text().splitlines()]
    kinds = {r["result"]["failure_kind"] for r in records}
    assert "infra" in kinds and "timeout" in kinds
    lost = [r for r in records if r["result"]["failure_kind"] == "infra"]
    assert any(r["attempt"] > 1 for r in records if r["number"] in {x["number"] for x in lost})  # run again


def test_other_jobs_holding_a_varying_share_of_the_cluster_are_waited_for_and_a_winner_confirmed(
        tmp_path: Path) -> None:
    """issue 51: a rehearsal of a shared cluster; before, a sweep with nothing of its own in flight ended at once."""
    proc = _search(tmp_path, "--max-trials", "8", "--rehearse-faults", "others=0.6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert not any((r["result"]["error"] or "").startswith("deferred") for r in records)  # none given up
    assert any(r["phase"] == "confirm" and r["result"]["status"] == "passed" for r in records)
    assert (out / "best_layout.yaml").is_file()
    # other jobs held a node when the first trial of all 16 GPUs came up: it waited for the next period (seed 0)
    assert json.loads((out / "sweep.json").read_text())["spent"]["waited_s"] > 0


def test_other_jobs_hold_whole_nodes_the_sweep_does_not_use_and_change_every_period() -> None:
    from sweeper.trial.rehearsal import OTHERS_PERIOD_S

    cfg = load_config(ROOT / "search_spaces" / "deepseek_v3_1024.yaml")
    host = RehearsalHost(cfg, Faults(others=0.5), seed=1)
    slot = host.reserve(Layout(world_size=64, tp=2, pp=4, ep=8, gbs=cfg.training.global_batch_size))
    assert slot is not None
    shares = []
    for period in range(6):
        host._clock = period * OTHERS_PERIOD_S  # the virtual clock at the start of each period
        held = host.others_held()
        assert not set(held) & set(slot.node_ids)  # never a node the sweep holds
        assert all(gpus == cfg.cluster.gpus_per_node for gpus in held.values())
        assert len(held) <= 0.5 * cfg.cluster.nodes + 1
        shares.append(len(held))
        assert host.held_by_others() == sum(held.values())
    assert len(set(shares)) > 1  # the share varies


@pytest.mark.parametrize(("spec", "message"), [
    ("hang=2", "hang must be in [0, 1]"),
    ("node_loss=1", "is not node_loss_per_hour=RATE, hang=P or others=SHARE"),
    ("others=1", "for others"),
    ("hang=x", "hang must be a number"),
])
def test_bad_fault_rates_are_refused_naming_the_item(spec: str, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Faults.parse(spec)


def test_a_rehearsal_refuses_a_cluster_address_in_one_line(tmp_path: Path) -> None:
    proc = _search(tmp_path, "--address", "127.0.0.1:6379")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: --address:")
    assert not (tmp_path / "out").exists()


def test_the_modelled_truth_is_the_same_for_a_layout_every_time_and_oom_above_the_gpu() -> None:
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    host = RehearsalHost(cfg, Faults(), seed=3)
    layout = Layout(world_size=8, ep=8, gbs=cfg.training.global_batch_size * 8 // 16)
    first = host.truth(layout)
    assert first is not None and first == host.truth(layout) == RehearsalHost(cfg, Faults(), seed=3).truth(layout)
    assert RehearsalHost(cfg, Faults(), seed=4).truth(layout) != first  # another rehearsal draws other errors


def test_a_trials_checkpoint_io_is_spread_over_its_own_nodes_not_the_clusters() -> None:
    """Each node writes and reads back its share of the checkpoint (FS_GB_S per node): a trial on one node spends
    what the whole checkpoint costs at one node's bandwidth, however many nodes the cluster has."""
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    host = RehearsalHost(cfg, Faults(), seed=3)
    layout = Layout(world_size=8, ep=8, gbs=cfg.training.global_batch_size * 8 // 16)
    durations = {}
    for checkpoint in (True, False):
        run = cfg.model_copy(update={"training": cfg.training.model_copy(update={"checkpoint": checkpoint})})
        for nodes in (1, 2):
            durations[checkpoint, nodes] = host._model(run, layout, steps=4, n=0, nodes=nodes, make_reference=False)[1].duration()
    io = 2 * checkpoint_bytes(cfg, layout.precision) / (FS_GB_S * 1e9)
    assert cfg.cluster.nodes == 2
    assert durations[True, 1] - durations[False, 1] == pytest.approx(io)
    assert durations[True, 2] - durations[False, 2] == pytest.approx(io / 2)


def test_fits_is_answered_per_placement_shape_and_follows_every_reservation() -> None:
    """TrialHost.fits keeps its answers per placement shape while the ledger is unchanged (a fill asks it for every
    launchable layout: issue 46); every reservation and release is seen at once."""
    cfg = load_config(ROOT / "search_spaces" / "deepseek_v3_1024.yaml")
    host = RehearsalHost(cfg, Faults(), seed=0)
    everything = Layout(world_size=1024, tp=8, pp=16, ep=8, sp=True, gbs=cfg.training.global_batch_size)
    small = Layout(world_size=8, tp=8, sp=True, gbs=cfg.training.global_batch_size // 128)
    assert host.fits(everything) and host.fits(small)
    slot = host.reserve(small)
    assert slot is not None
    assert not host.fits(everything) and host.fits(small)
    host.release(slot)
    assert host.fits(everything)
    slots = [host.reserve(small) for _ in range(128)]
    assert all(slots) and not host.fits(small)


def _nemotron(**training: object) -> tuple[SweepConfig, Layout]:
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    if training:
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update=training)})
    return cfg, Layout(world_size=8, ep=8, gbs=cfg.training.global_batch_size * 8 // 16)


def test_a_modelled_trial_longer_than_its_timeout_fails_as_a_timeout_at_the_limit() -> None:
    cfg, layout = _nemotron()
    host = RehearsalHost(cfg, Faults(), seed=3)
    result, run = host._model(cfg, layout, steps=4, n=0, nodes=1, make_reference=False)
    assert result.passed and run.duration() < cfg.training.trial_timeout_s
    short = run.duration() / 2
    tight, _ = _nemotron(trial_timeout_s=short)
    result, run = host._model(tight, layout, steps=4, n=0, nodes=1, make_reference=False)
    assert result.status == "failed" and result.failure_kind == "timeout" and "trial_timeout_s" in (result.error or "")
    assert run.duration() == pytest.approx(short)


def test_start_up_grows_with_the_ranks_and_the_gate_reads_the_reference() -> None:
    cfg, layout = _nemotron()
    host = RehearsalHost(cfg, Faults(), seed=3)
    big = Layout(world_size=1024, ep=8, gbs=cfg.training.global_batch_size)
    assert host.start_up_s(big) - host.start_up_s(layout) == pytest.approx(START_S_PER_RANK * 1016)
    assert host.start_up_s(big) > 8 * 60  # a 1,024-rank start-up takes minutes
    reference = checkpoint_bytes(cfg, str(cfg.space.values("precision")[0]))
    trial = host.io_s(cfg, layout, nodes=1, io_sharers=1, make_reference=False)
    own = host.io_s(cfg, layout, nodes=1, io_sharers=1, make_reference=True)  # the reference's run reads none
    assert trial - own == pytest.approx(reference / (FS_GB_S * 1e9))
    # Concurrent trials share the filesystem: past FS_SHARED_GB_S / FS_GB_S of them, each gets its share only.
    crowd = 4 * int(FS_SHARED_GB_S / FS_GB_S)
    assert host.io_s(cfg, layout, nodes=1, io_sharers=crowd, make_reference=False) == pytest.approx(
        trial * crowd * FS_GB_S / FS_SHARED_GB_S)


def test_each_layouts_modelled_error_has_the_held_out_spread_not_only_the_terms_average() -> None:
    """The truth's per-layout error about the level is LAYOUT_SIGMA (benchmarks/first_guess.py's held-out spread),
    whatever the number of terms: before, a factor per term alone averaged out to a few percent."""
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    valid = [e for e in assess_all(cfg, enumerate_layouts(cfg), None) if e.valid and e.predicted is not None]
    logs = []
    for seed in range(3):
        host = RehearsalHost(cfg, Faults(), seed=seed)
        for entry in valid[:150]:
            truth, est = host.truth(entry.layout), host.estimator(entry.layout)
            if truth is not None and est.step_time_s:
                logs.append(math.log(truth.step_time_s / est.step_time_s / host.level))
    terms = host.estimator(valid[0].layout).step_terms
    assert terms is not None and math.fsum(term_shares(terms)) == pytest.approx(1.0)
    spread = math.sqrt(sum(x * x for x in logs) / len(logs))
    assert 0.8 * LAYOUT_SIGMA < spread < 1.2 * LAYOUT_SIGMA, spread


def test_trials_to_best_is_judged_against_every_valid_layout_not_only_those_the_sweep_kept() -> None:
    cfg, _ = _nemotron()
    host = RehearsalHost(cfg, Faults(), seed=0)
    valid = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg), None) if e.valid][:300]
    scored = sorted(((t.tokens_per_s, lo) for lo in valid if (t := host.truth(lo)) is not None
                     and t.peak_memory_gib < 0.8 * cfg.cluster.gpu_memory_gib), key=lambda p: -p[0])
    best = scored[0][0]
    kept = [lo for v, lo in scored if v < best * math.exp(-4 * RUN_SIGMA)]  # the sweep pruned the best ones
    records = [TrialRecord(number=i, layout=lo.to_dict(), result=TrialResult(status="passed"))
               for i, lo in enumerate(kept[:5])]
    figures = summary(host, records, cfg, kept, valid)
    assert figures["trials_to_within_noise_of_best"] is None  # what the sweep kept never reaches the space's best
    assert figures["modelled_best_launchable_objective"] < figures["modelled_best_objective"]
    assert summary(host, records, cfg, kept, kept)["trials_to_within_noise_of_best"] == 1  # judged as before


def test_reserved_gpu_hours_are_the_cluster_for_the_wall_time_busy_ones_the_trials_own() -> None:
    cfg, layout = _nemotron()
    host = RehearsalHost(cfg, Faults(), seed=0)
    host.ledger.log = [Run(0.0, 100.0, 200.0, 8, 1e9), Run(300.0, 100.0, 100.0, 16, 1e9)]
    host.ledger.gpu_s = 300.0 * 8 + 200.0 * 16
    host._clock = 500.0
    figures = summary(host, [], cfg, [], [])
    assert figures["busy_gpu_hours"] == pytest.approx((300 * 8 + 200 * 16) / 3600)
    assert figures["reserved_gpu_hours"] == pytest.approx(500 * 16 / 3600)
    # The band replays the runs: the second starts when the first ends, at every level.
    assert replay(host.ledger.log, 1.0) == (500.0, 300 * 8 + 200 * 16)
    assert replay(host.ledger.log, 2.0) == (100.0 + 400.0 + 100.0 + 200.0, 500 * 8 + 300 * 16)
    level = host.level
    p90 = figures["band"]["p90"]
    assert p90["wall_time_h"] > figures["band"]["p10"]["wall_time_h"]
    assert p90["wall_time_h"] * 3600 == pytest.approx(replay(host.ledger.log, p90["level"] / level)[0])


@pytest.mark.parametrize(("keep", "checkpoints"), [("none", 1), ("winner", 2)])
def test_peak_disk_keeps_the_ended_trials_checkpoints_unless_keep_checkpoints_is_none(keep: str,
                                                                                       checkpoints: int) -> None:
    cfg, layout = _nemotron(keep_checkpoints=keep)
    host = RehearsalHost(cfg, Faults(), seed=3)
    for _ in range(2):  # one after the other, on the driver's thread
        slot = host.reserve(layout)
        assert slot is not None
        assert host.run_trial(cfg, layout, Path("unused"), reservation=slot).passed
        host.release(slot)
    assert host.ledger.peak_disk_bytes == checkpoints * checkpoint_bytes(cfg, layout.precision)
