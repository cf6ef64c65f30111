"""sweeper.trial: result aggregation (pure), then run_trial on a real simulated 2-node x 2-GPU Ray cluster.

The runner's mechanics (placement, rendezvous, gather, kill-all, timeout, root cause) are tested with
``standin_backend`` below: a STAND-IN for the Megatron backend, used only to exercise the runner. Its ranks do a
real gloo process group and all_reduce through the rendezvous the runner set up, and misbehave on request
(raise, hang, die, report a failure); its script comes from the model name ("standin-cascade", "standin-slow"). The last test runs the real megatron-core backend.

Every Ray test checks afterwards that no placement group and no trial actor is left.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from sweeper.backends.base import RankReport, SmokeRequest, share_checks
from sweeper.config.schema import ClusterConfig, SweepConfig, TrainingConfig
from sweeper.models.catalog import preset
from sweeper.record.schema import TrialChecks, TrialResult
from sweeper.space.layout import Layout
from sweeper.trial.aggregate import RankOutcome, aggregate, root_cause

STANDIN = f"{__name__}:standin_backend"


# -- the stand-in backend (runs inside the rank actors) -------------------------------------------------------------
def standin_backend(request: SmokeRequest) -> RankReport:
    """STAND-IN for sweeper.backends.megatron.run_rank, only to test the runner's mechanics.

    Modes via ``request.inject`` on ``request.inject_rank``: "crash" → the rank process exits at once;
    "hang" → the rank sleeps forever (its peers block in all_reduce); "nan" → this stand-in raises ValueError
    (a backend breaking its never-raise contract). A model named "standin-<script>" selects scripted reports.
    """
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    script = request.model.name.removeprefix("standin-")
    me = request.inject is not None and rank == request.inject_rank
    if me and request.inject == "crash":
        os._exit(17)
    if me and request.inject == "nan":
        raise ValueError("stand-in backend broke its contract")
    if script == "cascade":
        # rank 3 reports a real oom late; the others report collateral comm errors first.
        if rank == 3:
            time.sleep(1.5)
            return RankReport(rank=rank, node_id="", backend="standin", ok=False, failure_kind="oom",
                              error="simulated GPU memory exceeded at step 2")
        return RankReport(rank=rank, node_id="", backend="standin", ok=False, failure_kind="comm_error",
                          error="gloo: connection closed by peer")
    dist.init_process_group("gloo", timeout=timedelta(seconds=request.timeout_s))
    share_checks(TrialChecks(process_group=True, model_built=False))  # as the real backend shares them
    try:
        if me and request.inject == "hang":
            time.sleep(3600)
        times = []
        for _ in range(request.steps):
            start = time.perf_counter()
            value = torch.ones(1)
            dist.all_reduce(value)
            times.append(time.perf_counter() - start + 0.01 * (rank + 1))
            if script == "slow":
                time.sleep(0.5)
        assert value.item() == world
        return RankReport(
            rank=rank, node_id="", backend="standin", ok=True,
            checks=TrialChecks(process_group=True, model_built=True, forward_backward=True, finite=True,
                               checkpoint_saved=True, checkpoint_reloaded=None),
            step_times_s=times, losses=[5.0, 4.0, 3.0] if rank == world - 1 else [],
            tokens_per_step=1000, flops_per_step=2e12, peak_memory_bytes=(rank + 1) * 2**30,
            checkpoint_dir=os.path.join(request.trial_dir, "ckpt"),
            notes=[f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} LOCAL_RANK={os.environ['LOCAL_RANK']}"],
        )
    finally:
        dist.destroy_process_group()


# -- pure: aggregation ---------------------------------------------------------------------------------------------
def _ok(rank: int, times: list[float], **kw) -> RankReport:
    base = dict(checks=TrialChecks(process_group=True, model_built=True, forward_backward=True, finite=True,
                                   checkpoint_saved=True, checkpoint_reloaded=None),
                tokens_per_step=4096, flops_per_step=8e12, peak_memory_bytes=2**30, checkpoint_dir="/c")
    base.update(kw)
    return RankReport(rank=rank, node_id="n", backend="megatron-core-cpu", ok=True, step_times_s=times, **base)


def test_metrics_are_median_of_slowest_rank_per_step_after_warmup() -> None:
    outcomes = [
        RankOutcome(0, "sim-0", _ok(0, [9.0, 1.0, 2.0, 1.0])),
        RankOutcome(1, "sim-1", _ok(1, [9.0, 3.0, 1.0, 1.0], losses=[4.0, 3.5], peak_memory_bytes=3 * 2**30,
                                    pre_steps_peak_memory_bytes=5 * 2**30)),
    ]
    result = aggregate(outcomes, world_size=2, warmup_steps=1, trial_dir="/t")
    assert result.status == "passed" and result.failure_kind is None
    assert result.metrics.step_time_s == 2.0  # per-step max: [3, 2, 1] -> median 2
    assert result.metrics.tokens_per_s == 2048
    assert result.metrics.tflops_per_gpu == pytest.approx(8e12 / 2.0 / 1e12 / 2)
    assert result.metrics.peak_memory_gib == 3.0 and result.metrics.pre_steps_peak_memory_gib == 5.0
    assert (result.metrics.loss_first, result.metrics.loss_last) == (4.0, 3.5)
    assert result.checks.checkpoint_saved and result.checks.checkpoint_reloaded is None
    assert result.rank_nodes == ["sim-0", "sim-1"] and result.checkpoint == "/c"
    assert result.memory_kind == "host"
    assert result.checkpoint_bytes is None and result.checkpoint_deleted is False  # no rank measured it


def test_the_checkpoints_size_and_deletion_are_rank_0s() -> None:
    # Issue 43: rank 0 measures the trial's one checkpoint folder and deletes it; the path stays in the result.
    outcomes = [RankOutcome(0, "sim-0", _ok(0, [1.0], checkpoint_bytes=3 * 2**20, checkpoint_deleted=True)),
                RankOutcome(1, "sim-1", _ok(1, [1.0]))]
    result = aggregate(outcomes, world_size=2, warmup_steps=0, trial_dir="/t")
    assert (result.checkpoint_bytes, result.checkpoint_deleted, result.checkpoint) == (3 * 2**20, True, "/c")
    assert TrialResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_root_cause_prefers_a_real_failure_over_earlier_collateral() -> None:
    comm = RankReport(rank=0, node_id="n", backend="b", ok=False, failure_kind="comm_error", error="peer closed")
    oom = RankReport(rank=3, node_id="n", backend="b", ok=False, failure_kind="oom", error="out of memory")
    outcomes = [RankOutcome(0, "a", comm, arrived=1.0), RankOutcome(1, "a", died="rank process died", arrived=1.5),
                RankOutcome(3, "b", oom, arrived=2.0), RankOutcome(2, "b")]
    cause = root_cause(outcomes)
    assert cause is not None and cause.rank == 3
    result = aggregate(outcomes, world_size=4, warmup_steps=0, trial_dir=None)
    assert (result.status, result.failure_kind) == ("failed", "oom")
    assert result.error == "rank 3 (b): out of memory"
    assert result.checks.process_group is False and result.checkpoint is None


def test_checks_are_what_every_rank_proved_reported_or_stopped() -> None:
    proved = {"process_group": True, "model_built": True, "forward_backward": True, "finite": False}
    failed = RankReport(rank=1, node_id="n", backend="b", ok=False, failure_kind="checkpoint_error", error="x",
                        checks=TrialChecks(**{**proved, "finite": True, "checkpoint_saved": True}))
    # Rank 0 was stopped after rank 1 failed; it had shared what it proved so far.
    result = aggregate([RankOutcome(0, "a", proven=TrialChecks(**proved)), RankOutcome(1, "a", failed, arrived=1.0)],
                       world_size=2, warmup_steps=0, trial_dir=None)
    c = result.checks
    assert (c.process_group, c.model_built, c.forward_backward, c.finite, c.checkpoint_saved) == (
        True, True, True, False, False)
    # A rank that died (or never answered) proved nothing, so nothing holds on every rank.
    dead = aggregate([RankOutcome(0, "a", died="rank process died"), RankOutcome(1, "a", failed, arrived=1.0)],
                     world_size=2, warmup_steps=0, trial_dir=None)
    assert not dead.checks.process_group


def test_timeout_explains_collateral_comm_errors_but_not_a_dead_rank() -> None:
    comm = RankReport(rank=0, node_id="n", backend="b", ok=False, failure_kind="comm_error", error="timed out")
    hung = aggregate([RankOutcome(0, "a", comm, arrived=1.0), RankOutcome(1, "a")], world_size=2, warmup_steps=0,
                     trial_dir=None, timeout_error="timeout: ranks [1]")
    assert hung.failure_kind == "timeout"
    dead = aggregate([RankOutcome(0, "a", died="node a lost", arrived=1.0), RankOutcome(1, "a")], world_size=2,
                     warmup_steps=0, trial_dir=None, timeout_error="timeout: ranks [1]")
    assert dead.failure_kind == "infra"


def test_a_trial_whose_own_rank_failed_as_infra_says_so_and_an_aborted_one_does_not() -> None:
    """issue 51: whether a rank's death is the layout's is decided over attempts (verdicts.attribute), on this note."""
    from sweeper.trial.aggregate import RANK_FAULT

    dead = aggregate([RankOutcome(0, "a", died="rank process died: SIGSEGV", arrived=1.0), RankOutcome(1, "a")],
                     world_size=2, warmup_steps=0, trial_dir=None)
    assert dead.failure_kind == "infra" and RANK_FAULT in dead.notes
    aborted = aggregate([RankOutcome(0, "a"), RankOutcome(1, "a")], world_size=2, warmup_steps=0, trial_dir=None,
                        abort_error=("infra", "rank actor failed to start: ImportError"))
    assert aborted.failure_kind == "infra" and RANK_FAULT not in aborted.notes


# -- e2e: run_trial on a simulated 2 x 2 cluster --------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    from sweeper.cluster import connect

    cfg = ClusterConfig(nodes=2, gpus_per_node=2, gpu_memory_gib=4, simulate=True)
    with connect(cfg, record_dir=tmp_path_factory.mktemp("records")) as handle:
        yield handle


def _cfg(model: str = "tiny-gpt", timeout_s: float = 120, standin: str | None = None, **training) -> SweepConfig:
    spec = preset(model)
    if standin:
        spec = spec.model_copy(update={"name": f"standin-{standin}"})  # the stand-in reads its script from the name
    settings = dict(seq_length=32, global_batch_size=4, steps=3, warmup_steps=1, trial_timeout_s=timeout_s)
    settings.update(training)
    cluster = ClusterConfig(nodes=2, gpus_per_node=2, gpu_memory_gib=4, simulate=True)
    return SweepConfig(name="runner-test", model=spec, cluster=cluster, training=TrainingConfig(**settings))


def assert_nothing_left(timeout_s: float = 15.0) -> None:
    """No placement group still reserved and no rank actor alive (kills and removals are asynchronous)."""
    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        actors = [a for a in list_actors(filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)
                  if a.class_name == "RankActor" or (a.name or "").startswith("sweeper-")]
        if not groups and not actors:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: groups={groups} actors={actors}")
        time.sleep(0.3)


def _run(sim, tmp_path: Path, cfg: SweepConfig, layout: Layout, **kw):
    from sweeper.trial import run_trial

    started = time.monotonic()
    result = run_trial(cfg, layout, sim, tmp_path / "trial", backend=kw.pop("backend", STANDIN), **kw)
    return result, time.monotonic() - started


@pytest.mark.e2e
def test_passing_trial_places_tp_pairs_per_node_and_writes_result(sim, tmp_path: Path) -> None:
    result, _ = _run(sim, tmp_path, _cfg(), Layout(world_size=4, tp=2, gbs=4))
    assert result.status == "passed", result.error
    nodes = result.rank_nodes
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes  # TP pairs per node
    assert sorted(set(nodes)) == ["sim-0", "sim-1"]
    assert result.backend == "standin"
    assert result.metrics.tokens_per_s and result.metrics.peak_memory_gib == 4.0
    assert result.metrics.loss_first == 5.0 and result.metrics.loss_last == 3.0
    assert result.checkpoint and result.checks.checkpoint_saved and result.checks.checkpoint_reloaded is None
    # A simulated cluster's ranks are CPU ranks: every GPU hidden (Ray's ids are virtual, and a CUDA build of torch
    # must not look for them); each node's ranks still index themselves as under torchrun.
    envs = [n for n in result.notes if n.startswith("CUDA_VISIBLE_DEVICES")]
    assert sorted(envs) == ["CUDA_VISIBLE_DEVICES= LOCAL_RANK=0", "CUDA_VISIBLE_DEVICES= LOCAL_RANK=1"]
    written = json.loads((tmp_path / "trial" / "result.json").read_text())
    assert written["status"] == "passed" and written["rank_nodes"] == result.rank_nodes
    assert set(written) >= {"status", "failure_kind", "error", "metrics", "checks", "checkpoint", "rank_nodes",
                            "backend"}
    assert_nothing_left()


def warm_up(gpu: bool) -> None:
    """A backend whose warm ranks cannot start (test_a_warm_rank_that_cannot_start_says_why_in_one_line)."""
    raise RuntimeError(f"this install cannot start a rank (gpu={gpu})")


@pytest.mark.e2e
def test_a_warm_rank_that_cannot_start_says_why_in_one_line(sim, tmp_path: Path) -> None:
    """Ray's text for an actor whose creation raised holds the remote traceback, colour codes, pid, ip, actor id
    and carets; the trial's line keeps the cause and nothing of that (measured: the cause was cut away)."""
    from sweeper.trial.pool import RankPool

    pool = RankPool(f"{__name__}:standin_backend", 0.5, gpu=False)
    try:
        layout = Layout(world_size=2, gbs=4)
        nodes = [n.node_id for n in sim.nodes()][:1]
        result, _ = _run(sim, tmp_path, _cfg(), layout, backend=f"{__name__}:standin_backend", pool=pool,
                         nodes=nodes)
    finally:
        pool.close()
    assert (result.status, result.failure_kind) == ("failed", "infra")
    assert result.error.endswith("rank actor failed to start: RuntimeError: this install cannot start a rank "
                                 "(gpu=False)"), result.error
    assert "\x1b" not in result.error and "^" not in result.error and "pid=" not in result.error
    assert_nothing_left()


@pytest.mark.e2e
def test_backend_raising_on_one_rank_kills_all_ranks(sim, tmp_path: Path) -> None:
    # Rank 1 raises before joining the process group, so ranks 0, 2, 3 block in rendezvous until killed.
    result, elapsed = _run(sim, tmp_path, _cfg(), Layout(world_size=4, tp=2, gbs=4), inject="nan", inject_rank=1)
    assert (result.status, result.failure_kind) == ("failed", "infra")
    assert result.error.startswith(f"rank 1 ({result.rank_nodes[1]}): backend raised ValueError: stand-in backend broke its contract")
    assert (tmp_path / "trial" / "rank1.runner-error.txt").exists()
    assert elapsed < 60
    assert_nothing_left()


@pytest.mark.e2e
def test_root_cause_is_the_late_oom_not_the_early_comm_errors(sim, tmp_path: Path) -> None:
    result, _ = _run(sim, tmp_path, _cfg(standin="cascade"), Layout(world_size=4, tp=2, gbs=4))
    assert (result.status, result.failure_kind) == ("failed", "oom")
    assert result.error == f"rank 3 ({result.rank_nodes[3]}): simulated GPU memory exceeded at step 2"
    assert_nothing_left()


@pytest.mark.e2e
def test_hung_rank_times_out_whole_trial(sim, tmp_path: Path) -> None:
    # 30 s: the stack dump comes 5 s before the limit, and on a loaded 2-core machine the four ranks need ~10 s to
    # import torch and join the process group before they reach the step where rank 2 hangs.
    result, elapsed = _run(sim, tmp_path, _cfg(timeout_s=30), Layout(world_size=4, tp=2, gbs=4),
                           inject="hang", inject_rank=2)
    assert (result.status, result.failure_kind) == ("failed", "timeout")
    assert "after 30s (training.trial_timeout_s)" in result.error
    # Hang forensics: every rank dumped its stack before the limit; the error names where each one was.
    assert "ranks 0,1,3 blocked in torch.distributed all_reduce, called from standin_backend (tests/trial/" \
        in result.error, result.error
    assert "rank 2 in standin_backend (tests/trial/test_trial_runner.py:" in result.error, result.error
    assert sorted(p.name for p in (Path(result.trial_dir) / "stacks").iterdir()) == [
        "rank_000.txt", "rank_001.txt", "rank_002.txt", "rank_003.txt"]
    # No rank reported, yet every rank had joined the process group: the checks say what was proven.
    assert result.checks.process_group is True and result.checks.model_built is False
    assert 30 <= elapsed < 30 + 10
    assert_nothing_left()


@pytest.mark.e2e
def test_rank_process_killed_is_infra(sim, tmp_path: Path) -> None:
    result, elapsed = _run(sim, tmp_path, _cfg(), Layout(world_size=4, tp=2, gbs=4), inject="crash", inject_rank=3)
    assert (result.status, result.failure_kind) == ("failed", "infra")
    assert result.error.startswith(f"rank 3 ({result.rank_nodes[3]}): rank process died"), result.error
    assert elapsed < 60
    assert_nothing_left()


@pytest.mark.e2e
def test_placement_that_cannot_fit_is_reported_not_waited_on(sim, tmp_path: Path) -> None:
    result, elapsed = _run(sim, tmp_path, _cfg(timeout_s=3), Layout(world_size=6, tp=2, gbs=6))
    assert (result.status, result.failure_kind) == ("failed", "infra")
    assert "not reserved within 3s" in result.error and "placement_timeout" in result.notes
    assert elapsed < 15
    assert_nothing_left()


@pytest.mark.e2e
def test_doctor_on_the_simulated_cluster(sim, tmp_path: Path) -> None:
    from sweeper.trial import doctor

    present = tmp_path / "tokens.bin"
    present.write_bytes(b"x")
    report = doctor(_cfg(data_paths=[str(present)]), sim, trial_root=tmp_path / "sweeps")
    assert report.ok, report.problems
    # Its GPUs are logical by design (issue 51): torch is not asked, nothing is warned.
    assert report.warnings == [] and [n.cuda_devices for n in report.nodes] == [None, None]
    assert [n.label for n in report.nodes] == ["sim-0", "sim-1"]
    node = report.nodes[0]
    assert node.megatron_core.startswith("0.16") and node.python.startswith("3.11")
    assert node.gpu_count == 2 and node.gpu_source == "simulated" and node.free_disk_gib > 0
    rows = report.rows()
    assert rows[0]["node"] == "sim-0" and rows[0]["gpus"] == "2 x 4 GiB (simulated)" and rows[0]["paths"] == "ok"
    assert rows[0]["cuda"] == "simulated"
    # Every node read the driver's token file where trials will write, and left its own; none is left behind.
    assert all(n.shared for n in report.nodes) and rows[1]["shared_trial_folder"] == "yes"
    assert not list(tmp_path.glob(".sweeper-doctor-*")) and not (tmp_path / "sweeps").exists()
    # Each GPU node says which kernels it has (none here), as a GPU sweep's host asks them.
    from sweeper.cluster.node_kernels import gpu_node_kernels
    from sweeper.config.kernels import Kernels

    assert [n.kernels for n in report.nodes] == [Kernels(), Kernels()] and rows[0]["kernels"] == "none"
    assert gpu_node_kernels(sim) == {"sim-0": Kernels(), "sim-1": Kernels()}

    missing = doctor(_cfg(data_paths=[str(present), "/nonexistent/data.bin"]), sim)
    assert not missing.ok
    assert "sim-0: /nonexistent/data.bin does not exist" in missing.problems
    assert missing.rows()[1]["paths"] == "missing: /nonexistent/data.bin"
    assert_nothing_left()


@pytest.mark.e2e
def test_node_loss_during_a_trial_is_infra(sim, tmp_path: Path) -> None:
    from sweeper.cluster.simulated import wait_for_node_count

    try:
        result, elapsed = _run(sim, tmp_path, _cfg(standin="slow", steps=40), Layout(world_size=4, tp=2, gbs=4),
                               inject="node-loss", inject_rank=0)
        assert (result.status, result.failure_kind) == ("failed", "infra")
        assert f"node {result.rank_nodes[0]} lost" in result.error, result.error
        assert elapsed < 60
        assert_nothing_left()
    finally:
        sim.simulated.add_node()  # give the module's cluster its second node back
        wait_for_node_count(2)


@pytest.mark.e2e
def test_checkpoint_host_memory_is_per_node_sum_and_a_save_over_the_node_fails_as_its_own_kind() -> None:
    # Aggregation test data (not a trial): two nodes of two ranks, each rank's peak resident memory while saving.
    gib = 2**30

    def outcome(rank: int, node: str, rss_gib: float, host_gib: float) -> RankOutcome:
        return RankOutcome(rank, node, _ok(rank, [1.0, 1.0], checkpoint_save_s=0.5 + rank, checkpoint_load_s=0.25,
                                           checkpoint_save_rss_bytes=int(rss_gib * gib),
                                           host_memory_bytes=int(host_gib * gib)))

    fits = [outcome(0, "a", 1.0, 4.0), outcome(1, "a", 1.5, 4.0), outcome(2, "b", 1.0, 4.0), outcome(3, "b", 1.0, 4.0)]
    result = aggregate(fits, world_size=4, warmup_steps=0, trial_dir="/t")
    assert result.passed
    m = result.metrics
    assert m.checkpoint_save_host_gib == pytest.approx(2.5) and m.checkpoint_save_s == 3.5 and m.checkpoint_load_s == 0.25
    over = [outcome(0, "a", 1.0, 2.0), outcome(1, "a", 1.5, 2.0), outcome(2, "b", 0.5, 2.0), outcome(3, "b", 0.5, 2.0)]
    result = aggregate(over, world_size=4, warmup_steps=0, trial_dir="/t")
    assert (result.status, result.failure_kind) == ("failed", "checkpoint_host_oom")
    assert result.error == ("checkpoint save held 2.50 GiB of host memory on node a (ranks 0,1, peak resident "
                            "memory during the save, summed), more than the node's 2.00 GiB")
    assert result.checks.checkpoint_saved  # it did save: the verdict is about the node's memory


def test_peak_resident_sees_memory_held_only_inside_the_block() -> None:
    import torch

    from sweeper.backends.megatron.memory import PeakResident

    with PeakResident() as before:
        pass
    with PeakResident() as during:
        held = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        time.sleep(0.05)
        del held
    assert during.peak_bytes >= before.peak_bytes + 48 * 2**20


@pytest.mark.e2e
def test_real_megatron_tiny_gpt_tp2_pp2(sim, tmp_path: Path) -> None:
    pytest.importorskip("sweeper.backends.megatron")
    cfg = _cfg(timeout_s=300)
    result, elapsed = _run(sim, tmp_path, cfg, Layout(world_size=4, tp=2, pp=2, gbs=4),
                           backend="sweeper.backends.megatron:run_rank")
    assert result.status == "passed", result.error
    assert result.backend == "megatron-core-cpu"
    assert len(set(result.rank_nodes[:2])) == 1 and result.rank_nodes[0] != result.rank_nodes[2]
    assert result.checks.checkpoint_saved and result.checkpoint
    assert result.metrics.loss_last is not None and result.metrics.step_time_s
    # Checkpoint cost (issue 17): both phases timed, and a node held its two ranks' resident sets while saving.
    m = result.metrics
    assert m.checkpoint_save_s and m.checkpoint_load_s and m.checkpoint_save_host_gib
    assert m.checkpoint_save_host_gib >= 2 * 0.1  # two ranks with torch and megatron-core loaded, each > 100 MiB
    # Proof of placement, from the groups megatron-core built: TP pairs are adjacent ranks on one node, PP pairs
    # span the two nodes, every rank has its node and (simulated) GPU id, and nothing spans nodes that must not.
    placement = result.placement
    assert [[m["rank"] for m in g] for g in placement["tp"]] == [[0, 1], [2, 3]]
    assert [[m["rank"] for m in g] for g in placement["pp"]] == [[0, 2], [1, 3]]
    assert {k for k in placement} >= {"tp", "pp", "cp", "dp", "ep", "etp", "edp"}
    for groups in placement.values():
        for group in groups:
            assert all(m["node"] == result.rank_nodes[m["rank"]] and m["gpu"] is not None for m in group)
    assert {m["node"] for m in placement["tp"][0]} == {result.rank_nodes[0]}
    assert result.placement_warnings == []
    assert_nothing_left()


def test_a_node_that_does_not_share_the_trial_folder_is_a_problem() -> None:
    from sweeper.cluster.doctor import NodeCheck, _problems

    nodes = [NodeCheck("n0", "a", python="3.11", torch="2.13", megatron_core="0.16.1", gpu_count=2, shared=True),
             NodeCheck("n1", "b", python="3.11", torch="2.13", megatron_core="0.16.1", gpu_count=2, shared=False)]
    problems = _problems(nodes, _cfg(), "/scratch/sweeps/x")
    assert problems == ["n1: does not share /scratch/sweeps/x with the driver (trial folders must be on a filesystem "
                        "every node mounts at the same path: each rank writes its log and checkpoint shards there)"]


def test_a_node_whose_gpus_are_not_the_declared_compute_capability_is_a_problem() -> None:
    """Issue 44: the trial picks its FP8 recipe from the device, the environment, estimate and exports from the
    YAML's cluster.compute_capability; doctor says so before any trial."""
    from sweeper.cluster.doctor import DoctorReport, NodeCheck, _problems

    cfg = _cfg()
    same = dict(python="3.11", torch="2.13", megatron_core="0.16.1", gpu_count=2, shared=True, gpu_kind="NVIDIA H200")
    nodes = [NodeCheck("n0", "a", compute_capability=cfg.cluster.compute_capability, **same),
             NodeCheck("n1", "b", compute_capability="10.0", **same)]
    problems = _problems(nodes, cfg, "/scratch")
    assert problems == [f"n1: cluster.compute_capability is {cfg.cluster.compute_capability} but n1's GPUs (NVIDIA "
                        f"H200) is 10.0: the trial would pick its FP8 recipe for 10.0 while the environment, "
                        f"estimate and exports are made for {cfg.cluster.compute_capability} (set "
                        f'cluster.compute_capability: "10.0")']
    rows = DoctorReport(nodes=nodes, problems=problems, expected_nodes=2).rows()
    assert [r["compute_capability"] for r in rows] == [cfg.cluster.compute_capability, "10.0"]


def test_kernels_on_some_nodes_only_or_not_importing_are_problems() -> None:
    """Issue 44: the GPU nodes' kernels decide what a sweep runs (what every node has); one that is installed but
    does not import (TE's extension built against another torch) is named with the error's line."""
    from sweeper.cluster.doctor import DoctorReport, NodeCheck, _problems
    from sweeper.config.kernels import Kernels

    cfg = _cfg()
    same = dict(python="3.11", torch="2.13", megatron_core="0.16.1", gpu_count=2, shared=True,
                compute_capability=cfg.cluster.compute_capability)
    te = Kernels(transformer_engine=True)
    nodes = [NodeCheck("n0", "a", kernels=Kernels(transformer_engine=True, mamba_ssm=True), **same),
             NodeCheck("n1", "b", kernels=te, import_failures={"transformer_engine": "ImportError: undefined symbol: "
                                                                "_ZN3c10"}, **same)]
    problems = _problems(nodes, cfg, "/scratch")
    assert problems == [
        "mamba_ssm is on some GPU nodes only (n0=yes, n1=no): the sweep runs only what every node has",
        "n1: transformer_engine is installed but does not import: ImportError: undefined symbol: _ZN3c10 (built "
        "against another torch? docs/gpu-cluster.md: pip install --no-build-isolation)"]
    rows = DoctorReport(nodes=nodes, problems=problems, expected_nodes=2).rows()
    assert [r["kernels"] for r in rows] == ["transformer_engine, mamba_ssm", "transformer_engine"]


def test_a_tp_group_across_nodes_is_a_warning_and_not_stable_unless_allowed() -> None:
    # Aggregation test data (not a trial): two ranks of one TP group reporting different nodes.
    from sweeper.search.decide.verdicts import is_stable

    groups = {"tp": [0, 1], "pp": [0], "dp": [0, 1]}
    reports = [_ok(r, [1.0, 1.0], groups={**groups, "pp": [r]}, gpu=str(r)) for r in (0, 1)]
    result = aggregate([RankOutcome(0, "node-a", reports[0]), RankOutcome(1, "node-b", reports[1])],
                       world_size=2, warmup_steps=0, trial_dir="/t")
    assert result.placement["tp"] == [[{"rank": 0, "node": "node-a", "gpu": "0"},
                                       {"rank": 1, "node": "node-b", "gpu": "1"}]]
    assert result.placement["pp"] == [[{"rank": 0, "node": "node-a", "gpu": "0"}],
                                      [{"rank": 1, "node": "node-b", "gpu": "1"}]]
    assert result.placement_warnings == ["TP group [0, 1] spans nodes node-a, node-b"]
    cfg = _cfg()
    assert result.passed and not is_stable(result, cfg)
    allowed = cfg.model_copy(update={"search": cfg.search.model_copy(update={"allow_cross_node_tp": True})})
    assert is_stable(result, allowed)


@pytest.mark.e2e
def test_real_megatron_moe_under_routing_stress_and_a_save_over_the_nodes_host_memory(sim, tmp_path: Path) -> None:
    """Issue 17 items 1 and 4 in one real trial (tiny MoE, EP2): the routing stress a confirmation runs, and a node
    whose host memory (set to 0.2 GiB) is less than what its ranks held while saving."""
    pytest.importorskip("sweeper.backends.megatron")
    cfg = _cfg("tiny-moe", timeout_s=300, steps=2)
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"host_memory_gib": 0.2})})
    result, _ = _run(sim, tmp_path, cfg, Layout(world_size=2, ep=2, gbs=4),
                     backend="sweeper.backends.megatron:run_rank", routing_stress=True)
    assert (result.status, result.failure_kind) == ("failed", "checkpoint_host_oom"), result.error
    assert "more than the node's 0.20 GiB" in (result.error or "") and result.checks.checkpoint_saved
    assert result.metrics.checkpoint_save_host_gib > 0.2
    stress = result.routing_stress
    assert stress is not None and stress["hot_rank"]["hot_rank_factor"] == pytest.approx(2.0)  # tiny-moe: 4 x top-2
    assert result.metrics.stress_peak_memory_gib == max(s["peak_memory_gib"] for s in stress.values())
    assert len(result.losses) == 2  # the stress steps are not the trial's
    assert_nothing_left()


def test_routing_stress_is_folded_over_ranks_and_its_peak_is_a_metric() -> None:
    # Aggregation test data (not a trial): two EP ranks' stress reports.
    gib = 2**30

    def stressed(rank: int, hot: float, finite: bool) -> RankOutcome:
        modes = {"hot_expert": {"peak_memory_bytes": int((1 + rank) * gib), "hot_rank_factor": 1.3, "finite": True},
                 "hot_rank": {"peak_memory_bytes": int(hot * gib), "hot_rank_factor": 2.0, "finite": finite}}
        return RankOutcome(rank, "a", _ok(rank, [1.0, 1.0], routing_stress=modes))

    result = aggregate([stressed(0, 3.0, True), stressed(1, 1.5, False)], world_size=2, warmup_steps=0,
                       trial_dir="/t")
    assert result.routing_stress == {
        "hot_expert": {"peak_memory_gib": 2.0, "hot_rank_factor": 1.3, "finite": True},
        "hot_rank": {"peak_memory_gib": 3.0, "hot_rank_factor": 2.0, "finite": False},
    }
    assert result.metrics.stress_peak_memory_gib == 3.0 and result.metrics.peak_memory_gib == 1.0
    plain = aggregate([RankOutcome(0, "a", _ok(0, [1.0]))], world_size=1, warmup_steps=0, trial_dir="/t")
    assert plain.routing_stress is None and plain.metrics.stress_peak_memory_gib is None


def test_ranks_of_a_loopback_master_keep_gloo_on_loopback() -> None:
    """A simulated cluster's rank 0 is at 127.0.0.1: gloo is told the loopback interface, so its pairs do not bind
    the address the host name resolves to. A real cluster's ranks choose their own interface."""
    from sweeper.trial.actor import RankSlot
    from sweeper.trial.runner import _rank_envs, loopback_interface

    def slots(ip: str) -> list[RankSlot]:
        return [RankSlot(rank, f"n{rank // 2}", ip, (str(rank % 2),), 100 + rank, 29500 if rank == 0 else None)
                for rank in range(4)]

    labels = {"n0": "sim-0", "n1": "sim-1"}
    local = _rank_envs(slots("127.0.0.1"), labels, "t1", gpu=False)
    assert loopback_interface() in ("lo", "lo0")
    assert {env["GLOO_SOCKET_IFNAME"] for env in local} == {loopback_interface()}
    assert {env["MASTER_ADDR"] for env in local} == {"127.0.0.1"}
    remote = _rank_envs(slots("10.1.2.3"), labels, "t1", gpu=True)
    assert all("GLOO_SOCKET_IFNAME" not in env for env in remote)
