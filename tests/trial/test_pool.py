"""Warm rank processes (sweeper/trial/pool.py, sweeper/trial/forked.py).

Unit: a forked child's report, exit, kill and checks travel back as they should (plain processes, no Ray, no
Megatron; the "backends" here are tiny functions of this file). e2e: one simulated 2 x 2 cluster keeps its warm
ranks while different layouts of real megatron-core models run back to back on them (TP, PP, CP, EP, a failing
one, then a passing one): each passes the equivalence gate and the checkpoint reload, and its losses are the very
numbers a trial of the same layout gets in new rank processes.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from sweeper.backends.base import SmokeRequest
from sweeper.config.schema import ClusterConfig, SweepConfig, TrainingConfig
from sweeper.models.catalog import preset
from sweeper.record.schema import TrialChecks
from sweeper.space.layout import Layout
from sweeper.trial.forked import ForkedRank, RankDied


# -- unit: the forked child ---------------------------------------------------------------------------------------
def _checks_with_process_group() -> TrialChecks:
    return TrialChecks(process_group=True)


def test_child_report_and_environment_come_back() -> None:
    child = ForkedRank(lambda: {"pid": os.getpid(), "env": os.environ.get("SWEEPER_TEST_VALUE")},
                       TrialChecks, {"SWEEPER_TEST_VALUE": "forty-two"})
    report = child.wait()
    assert report == {"pid": child.pid, "env": "forty-two"}
    assert child.pid != os.getpid() and "SWEEPER_TEST_VALUE" not in os.environ


def test_child_that_exits_without_a_report_is_a_dead_rank_with_its_exit_code() -> None:
    child = ForkedRank(lambda: os._exit(17), TrialChecks, {})
    died = child.wait()
    assert isinstance(died, RankDied)
    assert died.reason == f"process {child.pid} exited with code 17 without a report"


def test_killed_child_is_a_dead_rank_and_checks_are_answered_while_it_runs() -> None:
    child = ForkedRank(lambda: time.sleep(60), _checks_with_process_group, {})
    assert child.checks(timeout_s=5.0) == TrialChecks(process_group=True)
    child.kill()
    died = child.wait()
    assert isinstance(died, RankDied) and died.reason == f"process {child.pid} was killed by SIGKILL"
    child.kill()  # twice is harmless


def test_child_says_what_it_proved_unasked_and_a_busy_child_still_counts() -> None:
    """The rank says what it proved as soon as it proves it: when the runner asks a rank too busy to answer in
    time (2 loaded cores; CI once read a NaN trial's every check as false), the answer is what it last said."""
    calls = []

    def proves_then_hangs() -> TrialChecks:
        calls.append(1)
        if len(calls) > 1:
            time.sleep(60)  # the rank can no longer answer
        return TrialChecks(process_group=True, model_built=True)

    child = ForkedRank(lambda: time.sleep(60), proves_then_hangs, {})
    deadline = time.monotonic() + 10
    while child.said == TrialChecks() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.said == TrialChecks(process_group=True, model_built=True)  # never asked
    assert child.checks(timeout_s=0.5) == TrialChecks(process_group=True, model_built=True)  # asked, no answer
    child.kill()
    assert isinstance(child.wait(), RankDied)


def test_child_that_raises_reports_a_dead_rank() -> None:
    def broken() -> None:
        raise ValueError("boom")

    died = ForkedRank(broken, TrialChecks, {}).wait()
    assert isinstance(died, RankDied) and "exited with code 70" in died.reason


def test_child_keeps_only_its_pipes_and_stdio() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)  # stands for the parent's Ray sockets
    try:
        child = ForkedRank(lambda: sorted(int(n) for n in os.listdir("/proc/self/fd")), TrialChecks, {})
        open_fds = child.wait()
    finally:
        os.close(fd)
    assert fd not in open_fds
    assert len([f for f in open_fds if f > 2]) <= 3  # two pipe ends, plus the listing's own descriptor


def test_child_keeps_the_gpu_drivers_device_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver library the parent initialised (NVML) holds descriptors on /dev/nvidia*: the child keeps them.
    STAND-IN: this machine has no /dev/nvidia*, so /dev/null plays the device file here."""
    from sweeper.trial import forked

    monkeypatch.setattr(forked, "_DEVICE_FILES", ("/dev/null",))
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        open_fds = ForkedRank(lambda: sorted(int(n) for n in os.listdir("/proc/self/fd")), TrialChecks, {}).wait()
    finally:
        os.close(fd)
    assert fd in open_fds


def gate_failure_backend(request: object) -> object:
    """STAND-IN for the megatron backend, only to test the warm rank's bookkeeping: a rank that proved the
    process group, the model and a forward/backward, then failed (as at the equivalence gate)."""
    from sweeper.backends.base import RankReport

    return RankReport(rank=0, node_id="n", backend="standin", ok=False, failure_kind="equivalence", error="gate",
                      checks=TrialChecks(process_group=True, model_built=True, forward_backward=True))


def test_warm_rank_answers_its_ended_childs_checks_not_nothing(tmp_path: Path) -> None:
    """The runner asks a rank it has no report from yet (a peer failed first) what it proved; a child that had
    already sent its report must not answer "nothing" (every check of a gate failure then read false)."""
    from sweeper.trial.pool import WarmRank

    rank = WarmRank.__ray_actor_class__("tests.trial.test_pool", [], True)  # the class behind the Ray actor
    assert rank.checks() == TrialChecks()  # before any trial: nothing proven
    request = SmokeRequest(model=preset("tiny-gpt"), layout=Layout(world_size=1), seq_length=32, steps=1,
                           warmup_steps=0, checkpoint=False, checkpoint_every=None, trial_dir=str(tmp_path))
    report = rank.run("tests.trial.test_pool:gate_failure_backend", request, {"RANK": "0"}, [])
    assert report.failure_kind == "equivalence"
    assert rank.checks() == TrialChecks(process_group=True, model_built=True, forward_backward=True)


# -- which clusters keep warm ranks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("warm_ranks", "simulated", "pooled"), [
    (None, True, True),    # the default on a simulated cluster: CPU ranks forked from warm ones
    (None, False, False),  # the default on GPUs: fresh ranks (forked ones failed NCCL's NVML start on an H200)
    (True, False, True), (False, True, False),  # what the YAML says, where it says it
])
def test_warm_ranks_default_to_the_simulated_cluster_only(warm_ranks, simulated, pooled):
    from types import SimpleNamespace

    from sweeper.trial.host import TrialHost

    cfg = _cfg("tiny-gpt", True)
    cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"warm_ranks": warm_ranks})})
    host = TrialHost(cfg, SimpleNamespace(is_simulated=simulated))  # a handle of no cluster: nothing starts here
    assert (host.pool is not None) is pooled


# -- e2e: layouts back to back on one pool --------------------------------------------------------------------------
def _cfg(model: str, warm: bool) -> SweepConfig:
    cluster = ClusterConfig(nodes=2, gpus_per_node=2, gpu_memory_gib=4, simulate=True, warm_ranks=warm)
    training = TrainingConfig(seq_length=32, global_batch_size=4, steps=3, warmup_steps=1, trial_timeout_s=240)
    return SweepConfig(name=f"pool-{model}", model=preset(model), cluster=cluster, training=training,
                       space={"gpus": [1, 2], "precision": ["fp32"]})


def _layout(**axes: object) -> Layout:
    return Layout(gbs=4, precision="fp32", **axes)  # type: ignore[arg-type]


def _run(host, cfg: SweepConfig, layout: Layout, folder: Path, reference: str | None, **kw: object):
    from sweeper.trial.protocol import reserved

    with reserved(host, layout, 60) as slot:
        assert slot is not None
        return host.run_trial(cfg, layout, folder, reservation=slot, reference=reference, **kw)


@pytest.mark.e2e
def test_layouts_back_to_back_on_warm_ranks_match_new_processes(tmp_path: Path) -> None:
    from sweeper.trial.host import open_host
    from sweeper.trial.reference import ensure_reference

    gpt, moe = _cfg("tiny-gpt", warm=True), _cfg("tiny-moe", warm=True)
    sequence = [
        (gpt, _layout(world_size=2, tp=2, sp=True), {}),
        (gpt, _layout(world_size=2, pp=2), {}),
        (gpt, _layout(world_size=2, cp=2), {}),
        (moe, _layout(world_size=2, ep=2), {}),
        (gpt, _layout(world_size=4, tp=2, sp=True), {"inject": "nan"}),  # fails: the rank poisons its loss
        (gpt, _layout(world_size=4, tp=2, pp=2, sp=True), {}),
    ]
    warm: list = []
    with open_host(gpt) as host:
        assert host.pool is not None
        references = {c.model.name: ensure_reference(c, host, tmp_path / f"ref-{c.model.name}") for c in (gpt, moe)}
        for i, (cfg, layout, kw) in enumerate(sequence):
            result = _run(host, cfg, layout, tmp_path / f"warm-{i}", references[cfg.model.name].path, **kw)
            warm.append(result)
        notes = [n for r in warm for n in r.notes if "on warm ranks" in n]
    assert all(ref.path for ref in references.values()), references
    failing = warm[4]
    assert (failing.status, failing.failure_kind) == ("failed", "nan"), failing.error
    # What every rank proved before the NaN, whichever rank's report the runner read first.
    assert failing.checks.process_group and failing.checks.model_built and failing.checks.forward_backward
    for i, result in enumerate(warm):
        if i == 4:
            continue
        assert result.status == "passed", f"{sequence[i][1].short()}: {result.failure_kind}: {result.error}"
        assert result.checks.equivalence_rel_err is not None and result.checks.equivalence_rel_err <= 1e-3
        assert result.checks.checkpoint_reloaded is True and result.checks.replicas_consistent is not False
    # One warm rank per GPU for the whole sequence (the references' included): started at most 4, never again.
    started = [int(re.search(r"(\d+) started", n).group(1)) for n in notes]  # type: ignore[union-attr]
    assert len(started) == len(sequence) and sum(started) <= 4 - 1 and started[-1] == 0, notes

    # The same layouts in new rank processes give the very same numbers.
    fresh_cfg = _cfg("tiny-gpt", warm=False)
    with open_host(fresh_cfg) as host:
        assert host.pool is None
        ref = ensure_reference(fresh_cfg, host, tmp_path / "ref-fresh")
        for i in (0, 5):
            fresh = _run(host, fresh_cfg, sequence[i][1], tmp_path / f"fresh-{i}", ref.path)
            assert fresh.status == "passed", fresh.error
            assert fresh.losses == warm[i].losses, sequence[i][1].short()
            assert fresh.checks.equivalence_rel_err == warm[i].checks.equivalence_rel_err


@pytest.mark.e2e
def test_prestarted_warm_ranks_serve_the_reference_and_the_first_trial(tmp_path: Path) -> None:
    from sweeper.trial.host import open_host
    from sweeper.trial.reference import ensure_reference

    cfg = _cfg("tiny-gpt", warm=True)
    layout = _layout(world_size=4, tp=2, pp=2, sp=True)
    with open_host(cfg) as host:
        assert host.prestart([_layout(world_size=2, tp=2), layout]) == 4  # the largest layout's ranks, at once
        assert host.prestart([layout]) == 0  # idle ones count: nothing more
        ref = ensure_reference(cfg, host, tmp_path / "ref")
        result = _run(host, cfg, layout, tmp_path / "trial", ref.path)
    assert ref.path and result.status == "passed", result.error
    assert any("(4 reused, 0 started)" in n for n in result.notes), result.notes
