"""Unit tests of the sweep loop's bookkeeping (scheduling, pruning, retries, resume, selection).

The trial host below is a STAND-IN, not a trial: it returns synthetic TrialResults instantly so these tests can
check the loop's decisions in milliseconds. Real trials (Ray + megatron-core) are tested in test_search_e2e.py.
MLflow is real (a file store in tmp_path).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig
from sweeper.record.schema import SweepMeta, TrialChecks, TrialMetrics, TrialRecord, TrialResult
from sweeper.record.sweepdir import SweepDir
from sweeper.record.tracking import Tracker
from sweeper.search.propose.study import PARAMS
from sweeper.search.run.sweep import SearchOptions, Sweep
from sweeper.space.layout import Layout
from sweeper.trial.aggregate import RANK_FAULT
from sweeper.trial.protocol import Host, Reservation
from sweeper.trial.reference import REFERENCE_FILE
from sweeper.trial.runner import HOST_OUT_OF_MEMORY

SPACE = {
    "name": "loop",
    "model": "tiny-moe",
    "cluster": {"nodes": 2, "gpus_per_node": 2, "gpu_memory_gib": 4, "compute_capability": "9.0"},
    "training": {"seq_length": 64, "global_batch_size": 8, "steps": 4},
    "space": {"gpus": [2, 4], "tp": [1], "pp": [1, 2], "ep": [1, 2], "mbs": [1, 2]},
    "search": {"max_trials": 20, "confirm_top": 1},
}


class StandInHost:
    """Synthetic trial host for loop tests (stand-in: no Ray, no Megatron). Throughput rises with PP*EP*MBS."""

    simulated = True
    backend_name = "stand-in"

    def __init__(self, nodes: int = 2, gpus: int = 2, fail: dict[str, str] | None = None, delay: float = 0.8,
                 unsupported: str | None = None, delays: dict[str, float] | None = None,
                 speeds: dict[str, float] | None = None, memory_kind: str = "host") -> None:
        self.free = {f"n{i}": gpus for i in range(nodes)}
        self.memory_kind = memory_kind  # "device": results read as a GPU's (the decision projects what they measured)
        self.gpus = gpus
        self.fail = fail or {}
        self.delay = delay
        self.delays = delays or {}  # per layout (short form): a trial that takes longer
        self.confirms_failed = 0
        self.reference_ok = True  # False: the reference run fails and the sweep has no equivalence gate
        self.speeds = speeds or {}  # per layout (short form): its tokens/s instead of the rule below
        self.spans: list[tuple[Layout, float, float]] = []  # (layout, start, end) of every run_trial
        self.unsupported_reason = unsupported  # every layout unsupported on this stand-in backend when set
        self.calls: list[tuple[Layout, str | None]] = []
        self.concurrent = 0
        self.max_concurrent = 0
        self.lock = threading.Lock()
        # Another job's GPUs (stand-in of a shared cluster): per node, held until ``others_until`` (monotonic).
        self.others: dict[str, int] = {}
        self.others_until = 0.0
        self.others_until_trials: int | None = None  # or: held until this many trials ended (whatever the clock)
        self.hold_after: tuple[int, float] | None = None  # after the N-th trial ends, others hold every GPU for S s
        self.confirm_kinds: dict[str, list[str]] = {}  # per layout: what its confirmation attempts do, in order
        self.reference_kinds: list[str] = []  # what the reference's attempts do first ("infra"), then it is made
        self.reference_layouts: list[Layout] = []  # the layout of every reference attempt

    def hold_others(self, gpus_per_node: int, seconds: float, nodes: list[str] | None = None) -> None:
        with self.lock:
            self.others = {n: gpus_per_node for n in (nodes or self.free)}
            self.others_until = time.monotonic() + seconds

    def _held(self, node: str) -> int:
        if self.others_until_trials is not None:  # held until that many trials of the sweep have ended
            return self.others.get(node, 0) if len(self.spans) < self.others_until_trials else 0
        return self.others.get(node, 0) if time.monotonic() < self.others_until else 0

    def capacity_total(self) -> int:
        return sum(self.gpus for _ in self.free)

    def held_by_others(self, node_ids: list[str] | None = None) -> int:
        return sum(self._held(n) for n in (node_ids if node_ids is not None else self.free))

    def prestart(self, layouts: list[Layout]) -> int:
        self.prestarted = len(layouts)
        return 0

    def _nodes(self, layout: Layout) -> tuple[list[str], int] | None:
        world = layout.world_size
        need = max(1, world // self.gpus)
        per = min(world, self.gpus)
        nodes = [n for n, f in self.free.items() if f - self._held(n) >= per][:need]
        return (nodes, per) if len(nodes) == need else None

    def reserve(self, layout: Layout, alone: bool = False) -> Reservation | None:
        with self.lock:
            chosen = self._nodes(layout)
            if chosen is None:
                return None
            nodes, per = chosen
            for n in nodes:
                self.free[n] -= per
            return Reservation(nodes, nodes, per)

    def fits(self, layout: Layout) -> bool:
        with self.lock:
            return self._nodes(layout) is not None

    def reserve_within(self, layout: Layout, timeout_s: float) -> Reservation | None:
        return self.reserve(layout)

    def release(self, slot: Reservation) -> None:
        with self.lock:
            for n in slot.node_ids:
                self.free[n] += slot.gpus_per_bundle

    def add_node(self) -> str:
        raise RuntimeError("the stand-in host has no simulated nodes to add")

    def unsupported(self, model: Any, layout: Layout) -> str | None:
        return self.unsupported_reason

    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, **kw: Any) -> TrialResult:
        if kw.get("make_reference"):  # the stand-in's reference: the file the gate would load, no weights behind it
            if self.reference_kinds:
                kind = self.reference_kinds.pop(0)
                self.reference_layouts.append(layout)
                return TrialResult(status="failed", failure_kind=kind,  # type: ignore[arg-type]
                                   error=f"rank 0 (n0): {kind} (stand-in)")
            self.reference_layouts.append(layout)
            if not self.reference_ok:
                return TrialResult(status="failed", failure_kind="unsupported", error="stand-in host")
            Path(kw["reference"]).mkdir(parents=True, exist_ok=True)
            (Path(kw["reference"]) / REFERENCE_FILE).write_text("{}")
            return TrialResult(status="passed", backend="stand-in", memory_kind="host")
        with self.lock:
            self.calls.append((layout, kw.get("inject")))
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        started = time.monotonic()
        try:
            time.sleep(self.delays.get(layout.short(), self.delay))  # default 0.8 s: the scheduler starts the next
            kind = self.fail.get(layout.short(), self.fail.get("*"))
            if kw.get("steps") is not None and self.confirm_kinds.get(layout.short()):
                kind = self.confirm_kinds[layout.short()].pop(0)
            if kind == "rank-died":  # a rank's process died on a node that stayed alive (stand-in of the runner's)
                return TrialResult(status="failed", failure_kind="infra", notes=[RANK_FAULT],
                                   error="rank 1 (n0): rank process died: SIGSEGV in a kernel (stand-in)")
            if kind == "stress-over":  # passed, but the routing-stress peak is over the headroom (stand-in)
                speed = 100.0 * layout.pp * layout.ep * layout.mbs * layout.world_size
                return TrialResult(
                    status="passed", metrics=TrialMetrics(tokens_per_s=speed, step_time_s=1.0, peak_memory_gib=1.0,
                                                          stress_peak_memory_gib=cfg.cluster.gpu_memory_gib),
                    checks=TrialChecks(True, True, True, True, True, True), backend="stand-in",
                    memory_kind=self.memory_kind)
            if kind == "broken-install":  # every rank fails to start on this install (stand-in of the runner's line)
                return TrialResult(status="failed", failure_kind="infra", error=(
                    f"rank 0 (n{len(self.calls) % 2}): rank actor failed to start: RuntimeError: torch was built "
                    f"without the library this node lacks (pid={4000 + len(self.calls)})"))
            if kind == "infra-confirm-once" and kw.get("steps") is not None and self.confirms_failed == 0:
                self.confirms_failed += 1  # its node lost during the first confirmation (stand-in)
                return TrialResult(status="failed", failure_kind="infra", notes=["node_lost"],
                                   error="rank 0 (n0): node n0 lost while the rank ran (stand-in)")
            if kind == "infra-once" and sum(1 for lo, _ in self.calls if lo == layout) == 1:
                return TrialResult(status="failed", failure_kind="infra", error="node lost (stand-in)")
            if kind == "host-oom":  # Ray's memory monitor killed ranks (stand-in of the runner's verdict)
                return TrialResult(status="failed", failure_kind="infra", notes=[HOST_OUT_OF_MEMORY],
                                   error=f"rank 1 (n1): {HOST_OUT_OF_MEMORY}: killed by the memory monitor (stand-in)")
            if kind == "internal":  # a sweeper bug on every attempt (stand-in of failures.classify's verdict)
                return TrialResult(status="failed", failure_kind="internal",
                                   error="sweeper bug at sweeper/backends/megatron/build.py:1: TypeError (stand-in)")
            if kind in ("oom", "nan"):
                return TrialResult(status="failed", failure_kind=kind, error=f"{kind} (stand-in)")
            speed = self.speeds.get(layout.short(), 100.0 * layout.pp * layout.ep * layout.mbs * layout.world_size)
            return TrialResult(
                status="passed", metrics=TrialMetrics(tokens_per_s=speed, step_time_s=1.0, peak_memory_gib=1.0,
                                                      loss_first=5.0, loss_last=4.0),
                checks=TrialChecks(True, True, True, True, True, True), backend="stand-in",
                memory_kind=self.memory_kind,
            )
        finally:
            with self.lock:
                self.concurrent -= 1
                self.spans.append((layout, started, time.monotonic()))
            if self.hold_after is not None and len(self.spans) == self.hold_after[0]:
                self.hold_others(self.gpus, self.hold_after[1])


@pytest.fixture()
def cfg(tmp_path: Path) -> SweepConfig:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(SPACE))
    return load_config(path)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    # One real MLflow store for the module: creating its tables takes seconds, experiments keep tests apart.
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture()
def make_sweep(tmp_path: Path, mlflow_uri: str, request: pytest.FixtureRequest) -> Callable[..., Sweep]:
    def make(cfg: SweepConfig, host: StandInHost, resume: bool = False, **kw: Any) -> Sweep:
        out = tmp_path / "sweep"
        SweepDir(out).create()
        tracker = Tracker(mlflow_uri, request.node.name)
        parent = (SweepDir(out).read_meta().mlflow or {}).get("parent_run_id") if resume else None
        parent = tracker.start_sweep(cfg.name, {}, {}, resume_run_id=parent)
        meta = SweepDir(out).read_meta() if resume else SweepMeta()  # a resumed sweep keeps its sweep.json
        meta.mlflow = {"parent_run_id": parent}
        SweepDir(out).write_meta(meta)
        return Sweep(cfg, SearchOptions(out=out, resume=resume, **kw), host, tracker)

    return make


def test_exhaustive_sweep_runs_each_launchable_layout_once_and_picks_fastest(cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    host = StandInHost()
    sweep = make_sweep(cfg, host)
    assert sweep.exhaustive
    assert sweep.run() == 0
    explore = [lo for lo, _ in host.calls]
    launched = [r for r in sweep.records if r.result.status != "pruned" and r.phase == "explore"]
    assert len(launched) == len({json.dumps(r.layout, sort_keys=True) for r in launched})  # no layout twice
    confirms = [r for r in sweep.records if r.phase == "confirm"]
    assert len(explore) == len(launched) + len(confirms) and len(confirms) in (1, 2)  # + its confirmation (at scale)
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    fastest = max(launched, key=lambda r: r.result.metrics.tokens_per_s)
    assert best["trial"] == fastest.number
    assert "--pipeline-model-parallel-size=2" in best["megatron_args"]
    # A 2-GPU layout whose production twin ran stable on 4 GPUs is not run (issue 53): that trial stands for both.
    dominated = json.loads((tmp_path / "sweep" / "sweep.json").read_text())["dominated"]
    on_four = {r.number for r in launched if Layout.from_dict(r.layout).world_size == 4 and r.result.passed}
    twins = [d for d in dominated if "stable on 4 GPUs" in d["reason"]]
    assert twins and all(int(d["reason"].split("trial #")[1].split()[0]) in on_four for d in twins)
    launch = tmp_path / "sweep" / "launch_megatron_lm.sh"  # the winner's exports beside it
    assert launch.stat().st_mode & 0o111 and "--pipeline-model-parallel-size=2" in launch.read_text()
    bridge = yaml.safe_load((tmp_path / "sweep" / "megatron_bridge_overrides.yaml").read_text())
    assert bridge["model"]["pipeline_model_parallel_size"] == best["layout"]["pp"]


def test_rule_rejected_layouts_are_pruned_never_launched(cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    host = StandInHost()
    sweep = make_sweep(cfg, host)
    sweep.run()
    launched = {lo for lo, _ in host.calls}
    from sweeper.plan.rules import check

    for lo in launched:
        assert check(cfg.model, lo, cfg.cluster, cfg.training.seq_length) == []


def test_infra_failure_is_retried_as_new_attempt(cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    target = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    host = StandInHost(fail={target: "infra-once"})
    sweep = make_sweep(cfg, host)
    sweep.run()
    rows = [r for r in sweep.records if Layout.from_dict(r.layout).short() == target and r.phase == "explore"]
    assert [r.attempt for r in rows] == [1, 2]
    assert rows[0].result.failure_kind == "infra" and rows[1].result.status == "passed"
    assert rows[0].number == rows[1].number


def test_ranks_that_exhaust_a_simulated_clusters_host_memory_are_not_rerun(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Every simulated node is this machine: a layout whose ranks it cannot hold would be killed again, so its one
    attempt is recorded (infra, never told to Optuna as the layout's) and the sweep goes on."""
    target = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    sweep = make_sweep(cfg, StandInHost(fail={target: "host-oom"}))
    sweep.run()
    rows = [r for r in sweep.records if Layout.from_dict(r.layout).short() == target and r.phase == "explore"]
    assert [r.attempt for r in rows] == [1] and rows[0].result.failure_kind == "infra"
    assert any(r.result.passed for r in sweep.records)


def test_a_sweeper_bug_is_rerun_once_and_never_told_to_optuna_as_the_layouts(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    target = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    sweep = make_sweep(cfg, StandInHost(fail={target: "internal"}))
    sweep.run()
    rows = [r for r in sweep.records if Layout.from_dict(r.layout).short() == target]
    assert [(r.attempt, r.result.failure_kind) for r in rows] == [(1, "internal"), (2, "internal")]
    # Optuna saw the layout only as FAIL (which TPE ignores): neither a value nor an infeasible verdict.
    told = [t for t in sweep.study.study.get_trials(deepcopy=False)
            if set(t.params) == PARAMS and sweep.study.layout_of(t.params).short() == target]
    assert told and all(t.state.name == "FAIL" for t in told)


def test_a_cause_that_fails_every_attempt_of_several_layouts_stops_the_sweep_with_it(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Measured with a CUDA torch and no GPU: 24 attempts of the quickstart failed as infra, one cause, and the sweep
    spent its budget on them. The same cause on three layouts, one of them retried, is not transient: the sweep
    stops, exit 1, with the cause in its last line, and the layouts stay open for --resume."""
    sweep = make_sweep(cfg, StandInHost(fail={"*": "broken-install"}, delay=0.2))
    assert sweep.run() == 1
    attempts = [r for r in sweep.records if r.result.status != "pruned"]
    # Three layouts, retried first (a 4-GPU trial fills the cluster, so the first two spent their 3 attempts), of
    # a budget of 20 layouts x 3 attempts.
    assert len({r.number for r in attempts}) == 3 and len(attempts) <= 7
    assert {r.result.failure_kind for r in attempts} == {"infra"}  # no verdict on a layout: --resume runs them again
    meta = SweepDir(tmp_path / "sweep").read_meta()
    assert meta.status == "failed"
    assert meta.stopped_early is not None and meta.stopped_early.startswith("stopped: every attempt of 3 layouts")
    assert "torch was built without the library this node lacks" in meta.stopped_early
    assert not (tmp_path / "sweep" / "best_layout.yaml").exists()


def test_layouts_of_different_sizes_are_compared_as_the_production_run_not_by_total_throughput(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """The production run has the cluster's 4 GPUs. A 4-GPU layout at 1.8x the tokens/s of a 2-GPU one loses to
    it: two copies of the 2-GPU layout train ~11% faster. Raw tokens/s chose the 4-GPU layout. The 2-GPU layout's
    production layout (its two copies as one, TP1-PP2-DP2) also ran on 4 GPUs: that measurement, not the 2-GPU
    trial's projection, stands for it (issue 53), so the decision's figure is measured, none of it projected."""
    small = Layout(world_size=2, pp=2, mbs=2, gbs=4)
    twin = cfg.production_layout(small)  # the 2-GPU layout as the production run runs it, measured on 4 GPUs
    large = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    assert twin is not None and twin.world_size == 4
    speeds = {small.short(): 1000.0, large: 1800.0, twin.short(): 1950.0}  # every other layout: 10 tokens/s
    sweep = make_sweep(cfg, _FixedSpeeds(speeds))
    assert sweep.run() == 0
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    assert Layout.from_dict(best["layout"]).short() == twin.short()
    assert best["objective"]["production_gpus"] == 4 and best["objective"]["copies"] == 1
    assert best["objective"]["median"] == 1950.0  # measured on the production run's own 4 GPUs
    decision = SweepDir(tmp_path / "sweep").read_meta().decision
    assert decision is not None
    assert small.short() not in [entry["layout"] for entry in decision["layouts"]]  # one candidate with its twin
    production = [entry["production"]["tokens_per_s"] for entry in decision["layouts"]]
    assert production[0] == max(production)  # no runner-up projects faster than the winner


class _FixedSpeeds(StandInHost):
    """The stand-in host with a given tokens/s for some layouts and 10 tokens/s for every other (stand-in)."""

    def __init__(self, speeds: dict[str, float]) -> None:
        super().__init__(delay=0.1, speeds=speeds, memory_kind="device")  # the decision projects measured rates

    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, **kw: Any) -> TrialResult:
        self.speeds.setdefault(layout.short(), 10.0)
        return super().run_trial(cfg, layout, trial_dir, **kw)


def test_a_confirmation_lost_to_a_node_is_made_again_and_the_candidate_kept(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Before: the lost node's confirmation record counted as a failed confirmation and the runner-up won."""
    fastest = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    sweep = make_sweep(cfg, StandInHost(fail={fastest: "infra-confirm-once"}, delay=0.1))
    assert sweep.run() == 0
    confirms = [(r.attempt, r.result.status) for r in sweep.records if r.phase == "confirm"]
    assert confirms == [(1, "failed"), (2, "passed")]
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    assert Layout.from_dict(best["layout"]).short() == fastest and best["confirmation"]["runs"] == 1


@pytest.mark.parametrize("required", [True, False])
def test_a_sweep_without_its_reference_has_no_stable_layout_unless_told_otherwise(
        required: bool, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Before: trials run without the gate could still be "stable", though the README says every trial passes it."""
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 3, "confirm_top": 0, "require_equivalence": required}})
    host = StandInHost(delay=0.1)
    host.reference_ok = False
    assert make_sweep(cfg, host).run() == (1 if required else 0)
    assert (tmp_path / "sweep" / "best_layout.yaml").exists() is not required
    report = (tmp_path / "sweep" / "report.html").read_text()
    assert "No equivalence gate" in report
    records = SweepDir(tmp_path / "sweep").read_trials()
    if required:  # issue 51: no trial could be stable, so none is run (the budget was spent for nothing)
        meta = SweepDir(tmp_path / "sweep").read_meta()
        assert records == [] and host.calls == [] and meta.status == "failed"
        assert meta.stopped_early is not None and meta.stopped_early.startswith("stopped before the first trial")
        return
    passed = [r for r in records if r.result.passed]
    assert passed and all("equivalence gate off: the sweep has no reference" in r.result.notes for r in passed)


def test_oom_trial_is_not_selected(cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    fastest = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    host = StandInHost(fail={fastest: "oom"})
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    assert Layout.from_dict(best["layout"]).short() != fastest


def test_resume_does_not_rerun_finished_trials(cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    host = StandInHost()
    first = make_sweep(cfg, host, max_trials=3)
    first.run()
    done = {json.dumps(r.layout, sort_keys=True) for r in first.records if r.phase == "explore"}
    host2 = StandInHost()
    second = make_sweep(cfg, host2, resume=True)
    second.run()
    rerun = [lo for lo, _ in host2.calls if json.dumps(lo.to_dict(), sort_keys=True) in done]
    # only the confirmation of an already-finished candidate may touch a finished layout again
    assert len(rerun) <= 1


def test_a_resumed_sweep_never_gives_a_new_trial_the_number_of_one_that_was_running_at_the_crash(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """A driver killed while trial #5 ran (#3 and #4 not yet recorded): on --resume #5 runs again under its number,
    and the new trials are numbered past it (scripts/kill_resume.py found two layouts sharing #4 and #5)."""
    from sweeper.search.propose.study import LayoutStudy

    first = make_sweep(cfg, StandInHost(delay=0.05), max_trials=2, parallel=1)
    first.run()
    out = tmp_path / "sweep"
    done = {Layout.from_dict(r.layout) for r in SweepDir(out).read_trials()}
    study = LayoutStudy(cfg, SweepDir(out).journal, "tpe", cfg.search.seed, [])
    running = next(e.layout for e in first.frontier.launchable if e.layout not in done)
    study.enqueue(running)
    proposal = study.propose(lambda lo: False)
    assert proposal is not None and proposal.layout == running
    proposal.trial.set_user_attr("sweeper_number", 5)  # as SweepState.launch sets it; the crash leaves it RUNNING
    proposal.trial.set_user_attr("attempt", 1)

    second = make_sweep(cfg, StandInHost(delay=0.05), resume=True, max_trials=6, parallel=1)
    second.run()
    explore = [r for r in SweepDir(out).read_trials() if r.phase == "explore" and r.attempt >= 1]
    layouts_by_number: dict[int, set[str]] = {}
    for r in explore:
        layouts_by_number.setdefault(r.number, set()).add(Layout.from_dict(r.layout).short())
    assert all(len(v) == 1 for v in layouts_by_number.values()), layouts_by_number
    assert layouts_by_number[5] == {running.short()}


def test_a_trial_recorded_just_before_the_crash_is_told_to_optuna_on_resume_not_rerun(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """The driver died after writing trial #3's line to trials.jsonl and before telling Optuna (scripts/
    kill_resume.py hit that moment): on --resume Optuna is told #3's recorded outcome and #3 does not run again."""
    import optuna

    from sweeper.search.propose.study import LayoutStudy

    first = make_sweep(cfg, StandInHost(delay=0.05), max_trials=2, parallel=1)
    first.run()
    out = tmp_path / "sweep"
    sweep_dir = SweepDir(out)
    done = {Layout.from_dict(r.layout) for r in sweep_dir.read_trials()}
    layout = next(e.layout for e in first.frontier.launchable if e.layout not in done)
    study = LayoutStudy(cfg, sweep_dir.journal, "tpe", cfg.search.seed, [])
    study.enqueue(layout)
    proposal = study.propose(lambda lo: False)
    assert proposal is not None
    proposal.trial.set_user_attr("sweeper_number", 3)
    proposal.trial.set_user_attr("attempt", 1)
    result = StandInHost(delay=0).run_trial(cfg, layout, tmp_path)
    sweep_dir.append_trial(TrialRecord(number=3, layout=layout.to_dict(), result=result, attempt=1))

    host = StandInHost(delay=0.05)
    make_sweep(cfg, host, resume=True, max_trials=4, parallel=1).run()
    records = [r for r in sweep_dir.read_trials() if Layout.from_dict(r.layout) == layout]
    assert [r.number for r in records if r.phase == "explore"] == [3]  # not explored again
    # It may run again only as the best's confirmation (the default proposer's order reaches it first; issue 54).
    assert [lo for lo, _ in host.calls].count(layout) == sum(r.phase == "confirm" for r in records) <= 1
    told = [t for t in optuna.load_study(study_name=study.study.study_name, storage=study.study._storage).get_trials()
            if t.user_attrs.get("sweeper_number") == 3 and t.state == optuna.trial.TrialState.COMPLETE]
    # Told as every outcome is: its objective on the production run (issue 43).
    from sweeper.search.decide.objective import objective_value

    assert len(told) == 1 and told[0].value == pytest.approx(objective_value(result, cfg, layout))


# -- what the study proposes (issue 11, item 6) ---------------------------------------------------------------------
# 2,304 combinations of which 130 are valid for tiny-moe (4 experts, 2 query groups, 4 layers; each trial runs its
# share of the 8-GPU production batch, which the larger micro-batches of the smaller layouts cannot hold): most are
# invalid.
MANY_INVALID = {
    **SPACE,
    "name": "many-invalid",
    "cluster": {"nodes": 2, "gpus_per_node": 4, "gpu_memory_gib": 4, "compute_capability": "9.0"},
    "space": {"gpus": [2, 4, 8], "tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8], "cp": [1, 2], "ep": [1, 2, 4, 8],
              "mbs": [1, 2, 4], "precision": ["bf16", "mxfp8"]},
    # tp=8 does not divide the query groups; mxfp8 needs compute capability 10.x. The first is given twice.
    "search": {"max_trials": 5, "confirm_top": 0, "sampler": "tpe",
               "seeds": ["gpus=8,tp=8", "gpus=8,tp=8", "gpus=2,precision=mxfp8", "gpus=2,pp=2,mbs=2"]},
}


def _load(tmp_path: Path, space: dict[str, Any]) -> SweepConfig:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    return load_config(path)


def _explore_records(sweep: Sweep) -> list[dict[str, Any]]:
    return [r for r in SweepDir(sweep.options.out).read_trials() if r.phase == "explore"]


def test_space_of_mostly_invalid_layouts_launches_only_valid_ones_and_records_each_refusal_once(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    from sweeper.config.schema import layout_from_string
    from sweeper.plan.rules import check

    cfg = _load(tmp_path, MANY_INVALID)
    host = StandInHost(nodes=2, gpus=4, delay=0.05)
    sweep = make_sweep(cfg, host)
    assert sweep.study.mode == "tpe" and len(sweep.frontier.launchable) == 130
    sweep.run()
    records = _explore_records(sweep)
    launched = [r for r in records if r.result.status != "pruned"]
    refused = [r for r in records if r.result.status == "pruned"]
    assert len(launched) == 5 and all(check(cfg.model, Layout.from_dict(r.layout), cfg.cluster,
                                            cfg.training.seq_length) == [] for r in launched)
    assert {lo for lo, _ in host.calls} == {Layout.from_dict(r.layout) for r in launched}
    # Only the two invalid seeds were ever refused, each once, with the rules' reason; TPE's own draws are
    # launchable layouts (a draw that is not is told to Optuna and replaced, never written as a refusal).
    invalid_seeds = {layout_from_string(cfg, text) for text in ("gpus=8,tp=8", "gpus=2,precision=mxfp8")}
    assert len(refused) == 2 and {Layout.from_dict(r.layout) for r in refused} == invalid_seeds
    # The valid seed is launched first; records are written as trials end, and two run at once here, so the
    # first launch is the lowest trial number, not the first line.
    first = min(launched, key=lambda r: r.number)
    assert layout_from_string(cfg, "gpus=2,pp=2,mbs=2") == Layout.from_dict(first.layout)
    assert host.calls[0][0] == Layout.from_dict(first.layout)
    assert all(r.result.failure_kind == "invalid_layout" and r.result.error for r in refused)
    assert len({json.dumps(r.layout, sort_keys=True) for r in records}) == len(records)
    # Bounded asks: at most two per launch beyond the queued seeds and the estimator's two favourites.
    assert sweep.study.counts.asks <= 3 + 2 + 2 * len(launched)


def test_a_space_the_backend_cannot_run_at_all_ends_without_asking(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """The nemotron-on-CPU symptom: every layout unsupported used to mean 1,113 asks and pruned lines."""
    cfg = _load(tmp_path, {**MANY_INVALID, "search": {"max_trials": 5, "confirm_top": 0}})
    host = StandInHost(nodes=2, gpus=4, delay=0.05, unsupported="hybrid Mamba model unsupported (stand-in)")
    sweep = make_sweep(cfg, host)
    started = time.monotonic()
    assert sweep.run() == 1
    assert time.monotonic() - started < 30
    assert sweep.frontier.launchable == [] and sweep.study.counts.asks == 0
    assert host.calls == [] and _explore_records(sweep) == []
    # Not silent: every valid layout is listed with the backend's reason, and the report shows them.
    meta = sweep.dir.read_meta()
    assert meta.unsupported and {u["reason"] for u in meta.unsupported} == {"hybrid Mamba model unsupported (stand-in)"}
    assert "valid layouts this backend cannot run" in (sweep.dir.root / "report.html").read_text()


def test_grid_sampler_launches_every_launchable_layout_in_grid_order_once(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    from sweeper.plan.assess import assess_all
    from sweeper.plan.space import enumerate_layouts

    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 40, "confirm_top": 0, "sampler": "grid"}})
    grid = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.launchable]
    assert len(grid) >= 6
    host = StandInHost(delay=0.05)
    sweep = make_sweep(cfg, host, parallel=1)  # one at a time: the launch order is the proposal order
    assert sweep.study.mode == "ordered"
    sweep.run()
    assert [lo for lo, _ in host.calls] == grid
    assert [Layout.from_dict(r.layout) for r in _explore_records(sweep)] == grid


def test_an_oom_prunes_band_layouts_predicted_to_need_more_and_the_report_says_why(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Issue 13: mbs 4 is predicted over the limit but inside the error band (launchable); the seeded mbs 2,
    predicted to need less, runs out of memory (stand-in), so mbs 4 is pruned as inferred, with #1 named, before
    it is launched; mbs 1 still runs."""
    space = {
        **SPACE, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_gib": 1.4, "compute_capability": "9.0"},
        "space": {"gpus": [2], "ep": [2], "mbs": [1, 2, 4]},
        "search": {"max_trials": 20, "confirm_top": 0, "seeds": ["gpus=2,ep=2,mbs=2"]},
        # Scales the tiny model's per-step memory so that the three micro-batch sizes straddle 90% of 1.4 GiB.
        "estimate": {"allocator_fragmentation": 600.0, "cuda_context_gib": 0.0, "nccl_buffer_gib_per_group": 0.0,
                     "workspace_gib": 0.0, "memory_over_prediction": 0.6},
    }
    path = tmp_path / "band.yaml"
    path.write_text(yaml.safe_dump(space))
    cfg = load_config(path)
    mbs2, mbs4 = (Layout(world_size=2, ep=2, mbs=m, gbs=8).short() for m in (2, 4))
    host = StandInHost(nodes=1, fail={mbs2: "oom"}, delay=0.1)
    sweep = make_sweep(cfg, host)
    assert any(e.layout.short() == mbs4 and e.uncertain for e in sweep.frontier.launchable)  # a candidate at first
    assert sweep.run() == 0
    launched = [lo.short() for lo, _ in host.calls]
    assert launched[0] == mbs2 and mbs4 not in launched
    meta = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    reasons = {p["layout"]: p["reason"] for p in meta["memory_pruned"]}
    assert "trial #1" in reasons[mbs4] and "ran out of memory (inferred)" in reasons[mbs4]


def test_a_measured_oom_keeps_larger_micro_batches_of_that_layout_from_running(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    small, large = (Layout(world_size=4, pp=2, ep=2, mbs=m, gbs=8).short() for m in (1, 2))
    seeded = cfg.model_copy(update={"search": cfg.search.model_copy(update={"seeds": ["gpus=4,pp=2,ep=2,mbs=1"]})})
    host = StandInHost(fail={small: "oom"})
    sweep = make_sweep(seeded, host, parallel=1)
    assert any(e.layout.short() == large for e in sweep.frontier.launchable)  # predicted to fit: a candidate at first
    sweep.run()
    launched = [lo.short() for lo, _ in host.calls]
    assert launched[0] == small and large not in launched
    dominated = {d["layout"]: d["reason"] for d in SweepMeta.from_json(
        json.loads((tmp_path / "sweep" / "sweep.json").read_text())).dominated or []}
    assert "micro-batch 1 of this layout ran out of memory (trial #1" in dominated[large]


def test_a_stable_layout_without_recompute_keeps_its_recompute_variants_from_running(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    space = {**SPACE, "space": {"gpus": [2], "ep": [1, 2], "recompute": ["none", "full"]},
             "search": {"max_trials": 20, "confirm_top": 0, "seeds": ["gpus=2,ep=2", "gpus=2,ep=1"]}}
    path = tmp_path / "recompute.yaml"
    path.write_text(yaml.safe_dump(space))
    host = StandInHost(nodes=1, delay=0.1)
    sweep = make_sweep(load_config(path), host, parallel=1)
    sweep.run()
    launched = [lo.short() for lo, _ in host.calls]
    assert launched == [Layout(world_size=2, ep=e, gbs=8).short() for e in (2, 1)]  # never a recompute variant
    meta = SweepMeta.from_json(json.loads((tmp_path / "sweep" / "sweep.json").read_text()))
    assert len(meta.dominated or []) == 2
    assert all("without recompute is stable" in d["reason"] for d in meta.dominated or [])
    assert "2 layouts dominated by a measured trial" in (tmp_path / "sweep" / "report.html").read_text()


def test_patience_stops_exploring_after_trials_without_a_better_stable_layout(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    fastest = "gpus=4,pp=2,ep=2,mbs=2"  # the stand-in's best: every later trial is slower
    space = {**SPACE, "search": {"max_trials": 20, "confirm_top": 0, "patience": 2, "seeds": [fastest]}}
    path = tmp_path / "patience.yaml"
    path.write_text(yaml.safe_dump(space))
    host = StandInHost(delay=0.1)
    sweep = make_sweep(load_config(path), host, parallel=1)
    sweep.run()
    assert len(host.calls) == 3  # the best, then two that did not beat it
    meta = SweepMeta.from_json(json.loads((tmp_path / "sweep" / "sweep.json").read_text()))
    assert meta.stopped_early and "2 trials without a better stable layout (search.patience 2)" in meta.stopped_early
    assert meta.stopped_early in (tmp_path / "sweep" / "report.html").read_text()


def test_the_stand_in_host_has_the_hosts_surface() -> None:
    assert isinstance(StandInHost(), Host)  # trial.protocol.Host: what the sweep and the scheduler call


def test_free_gpus_take_a_smaller_trial_while_a_large_one_waits_and_the_large_one_is_not_starved(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    from sweeper.config.schema import layout_from_string
    from sweeper.search.run import explore as loop

    monkeypatch.setattr(loop, "PRIOR_PROPOSALS", 0)  # the queue holds the two seeds only
    long_small, large = "gpus=2,pp=2,ep=1,mbs=1", "gpus=4,pp=2,ep=2,mbs=1"
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 6, "confirm_top": 0, "seeds": [long_small, large]}})
    a, b = layout_from_string(cfg, long_small), layout_from_string(cfg, large)
    host = StandInHost(delay=0.3, delays={a.short(): 4.0})
    sweep = make_sweep(cfg, host)
    assert sweep.study.mode == "ranked"  # the default (issue 54): the seeds first, as queued, then its order
    sweep.run()
    span = {lo: (t0, t1) for lo, t0, t1 in host.spans}
    # The 4-GPU seed waited for the long 2-GPU one; meanwhile the 2 free GPUs ran another (small) trial.
    backfilled = [lo for lo, t0, _ in host.spans if span[a][0] < t0 < span[b][0] and lo != b]
    assert backfilled and all(lo.world_size == 2 for lo in backfilled)
    assert sweep.backfilled and len(sweep.backfilled) <= 2  # only while it had waited less than a typical trial
    # Not starved: it started as soon as the long trial's GPUs were free again (MLflow writes in between).
    assert span[a][1] <= span[b][0] < span[a][1] + 3.0
    assert len([r for r in _explore_records(sweep) if r.result.status != "pruned"]) == 6


class TimedStandIn(StandInHost):
    """The stand-in with a step time per layout (still no Ray, no Megatron): ``step_s(layout)`` seconds."""

    simulated = False  # GPUs: the estimator's two favourites open the study

    def __init__(self, step_s: Callable[[Layout], float]) -> None:
        super().__init__(delay=0.05)
        self.step_s = step_s

    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, **kw: Any) -> TrialResult:
        result = super().run_trial(cfg, layout, trial_dir, **kw)
        if result.passed:
            seconds = self.step_s(layout)
            result.metrics.step_time_s = seconds
            result.metrics.tokens_per_s = layout.gbs * cfg.training.seq_length / seconds
        return result


def test_a_trial_that_contradicts_the_estimators_ranking_changes_what_the_sweep_proposes_next(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33: once enough trials are measured, the refit step-time model proposes. Three seeds open the sweep
    (the estimator's best PP2 layout and its two best PP1 ones); measured as the estimator predicts, the model then
    proposes the estimator's next favourite (a PP2 layout); measured with PP2 20x slower than predicted, the best
    untried layout without pipeline parallelism instead."""
    import shutil

    from sweeper.estimate import Estimator
    from sweeper.plan.assess import assess_all
    from sweeper.plan.space import enumerate_layouts
    from sweeper.search.decide.objective import production_layout

    monkeypatch.setattr("os.cpu_count", lambda: 64)  # a simulated cluster whose ranks each have a core of their own

    def space(seeds: list[str]) -> SweepConfig:
        doc = {**SPACE, "space": {**SPACE["space"], "mbs": [1, 2, 4]},
               "search": {"max_trials": 4, "confirm_top": 0, "seeds": seeds}}
        path = tmp_path / "refit.yaml"
        path.write_text(yaml.safe_dump(doc))
        return load_config(path)

    cfg = space([])
    raw = Estimator.for_config(cfg)
    launchable = [e.layout for e in assess_all(cfg, enumerate_layouts(cfg)) if e.launchable]
    # Ranked as the sweep ranks them: as the production run (the cluster's 4 GPUs) would run each (issue 43).
    favourites = sorted(launchable, key=lambda lo: -(raw(production_layout(cfg, lo)).tokens_per_s or 0.0))
    pp1 = [lo for lo in favourites if lo.pp == 1]
    opening = [next(lo for lo in favourites if lo.pp == 2), *pp1[:2]]
    untried = [lo for lo in favourites if lo not in opening]
    assert untried[0].pp == 2  # what the estimator alone would propose next
    cfg = space([f"gpus={lo.world_size},pp={lo.pp},ep={lo.ep},mbs={lo.mbs}" for lo in opening])

    fits: list[dict[str, Any]] = []
    reports: list[str] = []

    def fourth(step_s: Callable[[Layout], float]) -> Layout:
        host = TimedStandIn(step_s)
        host.simulated = True  # no estimator favourites: the seeds alone open the study
        make_sweep(cfg, host, parallel=1).run()
        fits.append(json.loads((tmp_path / "sweep" / "sweep.json").read_text())["step_time_fit"])
        reports.append((tmp_path / "sweep" / "report.html").read_text())
        shutil.rmtree(tmp_path / "sweep")
        assert [lo for lo, _ in host.calls[:3]] == opening and len(host.calls) == 4
        return host.calls[3][0]

    agrees = fourth(lambda lo: 1000 * (raw(lo).step_time_s or 0.0))
    assert fits and fits[0]["samples"] == 4 and [t["layout"] for t in fits[0]["trials"][:3]] == [
        lo.short() for lo in opening]
    assert fits[0]["error_calibrated"] < 1e-3  # measured as predicted (times a level): the fit is exact
    assert "Predicted vs measured step time" in reports[0] and "the level" in reports[0]
    contradicts = fourth(lambda lo: 1000 * (raw(lo).step_time_s or 0.0) * (20 if lo.pp == 2 else 1))
    assert agrees == untried[0]
    assert contradicts == pp1[2]


class ServerGoesAway(StandInHost):
    """The stand-in host (no Ray, no Megatron) that stops the real MLflow server as its 3rd trial starts and starts
    it again as its 5th does: trial 2 was logged, 3 started while the server answered and ends while it does not,
    4 starts and ends without it, 5 starts without it and ends with it back."""

    def __init__(self, server: Any) -> None:
        super().__init__(delay=0.1)
        self.server = server

    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, **kw: Any) -> TrialResult:
        calls = len(self.calls) + (0 if kw.get("make_reference") else 1)
        if calls == 3 and self.server.proc is not None:
            self.server.stop()
        if calls == 5 and self.server.proc is None:
            self.server.start()
        return super().run_trial(cfg, layout, trial_dir, **kw)


@pytest.mark.e2e
def test_a_tracking_server_that_goes_away_mid_sweep_loses_and_duplicates_no_trial(
        cfg: SweepConfig, tmp_path: Path, mlflow_server_process: Any) -> None:
    """Issue 34: the sweep runs on through the outage, says so once, keeps every trial in trials.jsonl, and logs the
    ones MLflow missed when the server answers again: every launched attempt exactly one finished child run."""
    from mlflow.tracking import MlflowClient

    said: list[str] = []
    cfg = cfg.model_copy(update={"search": cfg.search.model_copy(update={"max_trials": 7, "confirm_top": 1})})
    out = tmp_path / "sweep"
    SweepDir(out).create()
    tracker = Tracker(mlflow_server_process.url, "goes-away", say=said.append)
    parent = tracker.start_sweep(cfg.name, {}, {}, resume_run_id=None)
    SweepDir(out).write_meta(SweepMeta(mlflow={"parent_run_id": parent}))
    host = ServerGoesAway(mlflow_server_process)
    assert Sweep(cfg, SearchOptions(out=out, parallel=1), host, tracker).run() == 0

    assert sum("stopped answering" in line for line in said) == 1, said
    assert any("answers again" in line for line in said) and tracker.behind is None
    records = SweepDir(out).read_trials()
    launched = [r for r in records if r.attempt >= 1]
    assert len(launched) >= 6 and mlflow_server_process.proc is not None
    client = MlflowClient(tracking_uri=mlflow_server_process.url)
    runs = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    keys = sorted((r.data.tags["sweeper.trial_number"], r.data.tags["sweeper.attempt"], r.data.tags["sweeper.phase"])
                  for r in runs)
    assert keys == sorted((str(r.number), str(r.attempt), r.phase) for r in launched)  # each exactly once
    assert all(r.info.status in ("FINISHED", "FAILED") for r in runs)
    for run in runs:
        record = next(r for r in launched if str(r.number) == run.data.tags["sweeper.trial_number"]
                      and r.phase == run.data.tags["sweeper.phase"])
        assert run.data.tags["sweeper.status"] == record.result.status
        if record.result.passed:
            assert run.data.metrics["tokens_per_s"] == pytest.approx(record.result.metrics.tokens_per_s or 0.0)
    assert client.get_run(parent).info.status == "FINISHED"


# -- issue 51: a winner on a busy cluster --------------------------------------------------------------------------
def _fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    from sweeper.search.run import capacity

    monkeypatch.setattr(capacity, "POLL_S", 0.2)  # a phase with nothing of its own running looks again this often


def test_a_reference_whose_gpus_other_jobs_hold_is_made_once_they_free_up(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: one try of PLACE_TIMEOUT_S to find GPUs, then a whole sweep without the gate."""
    _fast_polls(monkeypatch)
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 2, "confirm_top": 1}})
    host = StandInHost(delay=0.1)
    sweep = make_sweep(cfg, host)
    host.hold_others(2, 1.5)  # every GPU held by another job for the sweep's first 1.5 s (its set-up done)
    assert sweep.run() == 0
    assert sweep.reference is not None
    meta = SweepDir(tmp_path / "sweep").read_meta()
    assert meta.spent is not None and meta.spent["waited_s"] >= 1.0


def test_a_reference_lost_to_a_node_is_made_again(tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 2, "confirm_top": 1}})
    host = StandInHost(delay=0.1)
    host.reference_kinds = ["infra", "infra"]  # two attempts lost to a node, the third makes it (MAX_ATTEMPTS 3)
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0 and sweep.reference is not None


def test_a_reference_layout_out_of_memory_gives_way_to_itself_with_full_recompute(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Found rehearsing Nemotron: the one-GPU-simplest reference drawn out of memory stopped 6 sweeps of 12 before
    their first trial, though the next simplest layout holds it."""
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 2, "confirm_top": 1}})
    host = StandInHost(delay=0.1)
    host.reference_kinds = ["oom"]
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0 and sweep.reference is not None
    first, second = host.reference_layouts
    assert first.world_size == 1 and first.recompute == "none"
    assert second == replace(first, recompute="full")  # the same layout, less activation memory


def test_exploration_waits_for_gpus_other_jobs_hold_when_nothing_of_its_own_runs(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured on a real `ray start` cluster with another job holding 2 of 4 GPUs for 90 s: 1 of 8 trials, then
    "deferred: needs 2 GPUs, 4 alive when the sweep ended" and exit 1."""
    _fast_polls(monkeypatch)
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 4, "confirm_top": 1}})
    host = StandInHost(delay=0.1)
    host.hold_after = (1, 1.5)  # after the first trial, another job holds every GPU for 1.5 s
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0
    explored = [r for r in _explore_records(sweep) if r.result.status != "pruned"]
    assert len({r.number for r in explored}) == 4 and all(r.result.passed for r in explored)


def test_a_confirmation_whose_gpus_another_job_holds_waits_and_is_made(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: reserve() did not wait; with nothing in flight confirmation gave up: "no stable layout passed"."""
    _fast_polls(monkeypatch)
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 2, "confirm_top": 1, "parallel": 1}})
    host = StandInHost(delay=0.1)
    host.hold_after = (2, 1.5)  # the last explored trial ends, and another job takes every GPU for 1.5 s
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0
    confirms = [r for r in sweep.records if r.phase == "confirm"]
    # its confirmation, then (a trial smaller than the cluster) its run at scale: both waited for and made
    assert 1 <= len(confirms) <= 2 and all(r.result.passed for r in confirms)
    assert len({r.layout["gpus"] for r in confirms}) == len(confirms)
    assert (tmp_path / "sweep" / "best_layout.yaml").exists()


def test_a_confirmation_that_passes_over_the_headroom_under_routing_stress_moves_on_to_the_next_candidate(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Before: it counted as confirmed, filled the one confirm_top slot, and choose() refused it: no winner."""
    fastest = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    host = StandInHost(delay=0.1)
    host.confirm_kinds = {fastest: ["stress-over"]}
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0
    confirms = [(Layout.from_dict(r.layout).short(), r.result.passed) for r in sweep.records if r.phase == "confirm"]
    assert confirms[0] == (fastest, True) and len(confirms) == 2
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    assert Layout.from_dict(best["layout"]).short() == confirms[1][0] != fastest


def test_a_rank_that_dies_twice_in_confirmation_on_a_live_node_fails_the_candidate(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Before: each death was infra, re-run up to 3 times, and one pass in three won with `runs: 1`."""
    fastest = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    host = StandInHost(delay=0.1)
    host.confirm_kinds = {fastest: ["rank-died", "rank-died", "passed"]}
    sweep = make_sweep(cfg, host)
    assert sweep.run() == 0
    mine = [(r.attempt, r.result.failure_kind) for r in sweep.records
            if r.phase == "confirm" and Layout.from_dict(r.layout).short() == fastest]
    assert mine == [(1, "infra"), (2, "crash")]  # the retry's death is the layout's: no third attempt
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    assert Layout.from_dict(best["layout"]).short() != fastest


def test_every_confirmation_attempt_of_the_winner_is_listed_in_best_layout_yaml(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    fastest = Layout(world_size=4, pp=2, ep=2, mbs=2, gbs=8).short()
    host = StandInHost(delay=0.1)
    host.confirm_kinds = {fastest: ["rank-died", "passed"]}
    assert make_sweep(cfg, host).run() == 0
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    assert Layout.from_dict(best["layout"]).short() == fastest
    attempts = best["confirmation"]["attempts"]
    assert [(a["attempt"], a["status"], a["failure_kind"]) for a in attempts] == [(1, "failed", "infra"),
                                                                               (2, "passed", None)]
    assert "rank process died" in attempts[0]["error"]


def test_the_budget_spent_survives_resume(tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Before: gpu_hours and wall_time_s restarted on every --resume, so a requeued sweep spent its budget again."""
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 2, "confirm_top": 0}})
    make_sweep(cfg, StandInHost(delay=0.3)).run()
    spent = SweepDir(tmp_path / "sweep").read_meta().spent
    assert spent is not None and spent["gpu_s"] > 0 and spent["wall_s"] > 0
    budget = _load(tmp_path, {**SPACE, "search": {"max_trials": 6, "confirm_top": 0,
                                                  "gpu_hours": 0.99 * spent["gpu_s"] / 3600}})
    second = make_sweep(budget, StandInHost(delay=0.3), resume=True)
    second.run()
    assert len({r.number for r in _explore_records(second) if r.result.status != "pruned"}) == 2  # none more
    assert SweepDir(tmp_path / "sweep").read_meta().spent["gpu_s"] >= spent["gpu_s"]


def test_sweep_json_is_written_with_the_progress_not_with_every_trial(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before (issue 54): every ended trial read sweep.json, had pydantic validate and dump it whole and wrote it: on
    DeepSeek-V3's 1,024-GPU space 38 MB and seconds per event. Now the driver holds it and writes it with the
    progress at most every SAVE_EVERY_S, and whole, lists included, when the sweep ends."""
    import sweeper.search.run.state as state

    monkeypatch.setattr(state, "SAVE_EVERY_S", 3600.0)
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 4, "confirm_top": 0}})
    sweep = make_sweep(cfg, StandInHost(delay=0.05))
    writes: list[str | None] = []
    write = sweep.dir.write_meta
    monkeypatch.setattr(sweep.dir, "write_meta", lambda meta: (writes.append(meta.status), write(meta)))
    assert sweep.run() == 0
    assert len([r for r in _explore_records(sweep) if r.result.status != "pruned"]) == 4
    # The equivalence reference's note (make_sweep's sweep.json has no status) and the end: none per trial.
    assert writes == [None, "finished"]
    on_disk = SweepMeta.from_json(json.loads(sweep.dir.meta.read_text()))
    lists = sweep.frontier.verdict_lists()
    assert on_disk.memory_pruned == lists["memory_pruned"] and on_disk.dominated == lists["dominated"]
    assert on_disk.spent is not None and on_disk.spent["wall_s"] > 0 and on_disk.status == "finished"


def test_an_interrupted_sweep_writes_no_best_layout(
        cfg: SweepConfig, tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """Before: an interrupted sweep exported whatever happened to be confirmed when it stopped."""
    host = StandInHost(delay=0.1)
    sweep = make_sweep(cfg, host)
    stopper = threading.Timer(1.0, sweep.stop.set)
    stopper.start()
    assert sweep.run() == 1
    stopper.join()
    assert not (tmp_path / "sweep" / "best_layout.yaml").exists()
    assert SweepDir(tmp_path / "sweep").read_meta().status == "interrupted"


def test_a_confirmation_after_a_driver_death_does_not_reuse_the_dead_runs_folder(
        tmp_path: Path, make_sweep: Callable[..., Sweep]) -> None:
    """issue 51: the attempt number came from the records alone, and the dead run left a folder but no record."""
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 3, "confirm_top": 0, "sampler": "grid"}})
    first = make_sweep(cfg, StandInHost(delay=0.1))
    first.run()
    from sweeper.search.decide.candidates import candidates

    best = candidates(first.records, cfg)[0]  # the first to be confirmed
    dead = SweepDir(tmp_path / "sweep").trial_dir(best.number, 1, "confirm")
    dead.mkdir(parents=True)  # what a confirmation running when the driver died leaves
    (dead / "rank0.log").write_text("the dead run's log\n")
    confirming = _load(tmp_path, {**SPACE, "search": {"max_trials": 3, "confirm_top": 1, "sampler": "grid"}})
    second = make_sweep(confirming, StandInHost(delay=0.1), resume=True)
    assert second.run() == 0
    confirms = [r for r in second.records if r.phase == "confirm"]
    # its confirmation, then its run at scale (issue 53: its production layout on the cluster's GPUs), each in a
    # folder of its own
    assert [(r.number, r.attempt, r.layout["gpus"]) for r in confirms] == [
        (best.number, 2, best.layout.world_size), (best.number, 3, cfg.production_gpus)]
    assert (dead / "rank0.log").read_text() == "the dead run's log\n"


def test_smaller_trials_run_on_the_gpus_other_jobs_leave_while_a_larger_one_waits_for_theirs(
        tmp_path: Path, make_sweep: Callable[..., Sweep], monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 51: on a shared cluster a whole-cluster trial whose GPUs another job holds for hours blocked every
    smaller one after one typical trial's time (the rule that keeps the sweep's own small trials from starving it)."""
    from sweeper.config.schema import layout_from_string
    from sweeper.search.run import explore

    _fast_polls(monkeypatch)
    monkeypatch.setattr(explore, "PRIOR_PROPOSALS", 0)
    large = "gpus=4,pp=2,ep=2,mbs=1"
    cfg = _load(tmp_path, {**SPACE, "search": {"max_trials": 6, "confirm_top": 0, "seeds": [large]}})
    host = StandInHost(delay=0.2)
    # Another job holds node n1 until the sweep has ended 3 trials (events, not seconds: a loaded machine's speed
    # decides nothing). Before, one backfill ran, then nothing: the larger trial blocked the free node.
    host.hold_others(2, 3600.0, nodes=["n1"])
    host.others_until_trials = 3
    sweep = make_sweep(cfg, host)
    stopper = threading.Timer(120.0, sweep.stop.set)  # the old loop never ends 3 trials: stop it, do not hang
    stopper.start()
    try:
        assert sweep.run() == 0
    finally:
        stopper.cancel()
    big = layout_from_string(cfg, large)
    started = {lo: t0 for lo, t0, _ in host.spans}
    meanwhile = [lo for lo, t0, _ in host.spans if lo != big and (big not in started or t0 < started[big])]
    assert len(meanwhile) >= 3 and all(lo.world_size == 2 for lo in meanwhile)  # more than one trial's time
    assert big in started  # it ran once the other job was gone
