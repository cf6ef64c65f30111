"""`sweeper search`: the sweep loop. Optuna proposes, the scheduler launches trials on free GPUs, MLflow records.

The driver thread owns every decision and every write (trials.jsonl, Optuna, MLflow); trials run in worker
threads that only block on Ray. One loop: fill free capacity with proposals (the study proposes only layouts
the rules accept, the estimator predicts fit and the backend can run; a queued seed that is not launchable is
refused and recorded once, without launching), wait for a trial to end, record it, repeat until the budget or
the launchable layouts are spent; then confirm the top candidates and export the winner. Infrastructure
failures (a node lost, an actor killed) are not the layout's fault: the same layout is re-queued as a new
attempt of the same trial.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.errors import EXIT_FAILED, EXIT_OK, LayoutError, UsageError
from sweeper.estimate import Estimate
from sweeper.estimate.calibrator import Calibrator
from sweeper.models.proxy import is_proxy
from sweeper.plan.assess import PlanEntry, assess
from sweeper.plan.space import enumerate_layouts
from sweeper.record.schema import Phase, TrialRecord, TrialResult
from sweeper.record.sweepdir import SweepDir
from sweeper.search.memory_evidence import MemoryEvidence
from sweeper.search.progress import Progress
from sweeper.search.selection import best_layout_document, candidates, choose, is_stable, objective_value
from sweeper.search.study import LayoutStudy, Mode
from sweeper.space.axes import SEARCHED
from sweeper.space.layout import Layout

console = Console(stderr=True)
INJECT_KINDS = ("node-loss", "node-join", "hang", "nan", "kill-rank")
# Failures that say nothing about the layout: the infrastructure (a node or rank lost) or a bug in sweeper itself
# (internal). Optuna is told nothing (FAIL); the layout runs again as a new attempt, up to these many attempts.
NOT_THE_LAYOUTS = ("infra", "internal")
MAX_ATTEMPTS = {"infra": 3, "internal": 2}
PRIOR_PROPOSALS = 2  # in TPE mode, the estimator's fastest predicted layouts are proposed first


@dataclass(frozen=True)
class Injection:
    kind: str
    trial: int  # the N-th launched trial (1-based)


@dataclass
class SearchOptions:
    out: Path
    resume: bool = False
    max_trials: int | None = None
    parallel: int | None = None
    address: str | None = None
    injections: list[Injection] = field(default_factory=list)


def parse_injections(specs: list[str], simulated: bool) -> list[Injection]:
    out = []
    for spec in specs:
        match = re.fullmatch(r"([a-z-]+)@trial=([0-9]+)", spec.strip())
        if not match or match.group(1) not in INJECT_KINDS or int(match.group(2)) < 1:
            raise UsageError(f"--inject: '{spec}' is not one of {', '.join(k + '@trial=N' for k in INJECT_KINDS)}")
        out.append(Injection(match.group(1), int(match.group(2))))
    if out and not simulated:
        raise UsageError("--inject: fault injection only runs on simulated clusters (cluster.simulate)")
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class Running:
    number: int
    attempt: int
    phase: Phase
    layout: Layout
    proposal: Any  # optuna Trial (None for confirmation runs)
    predicted: dict[str, Any] | None
    run_id: str | None
    started_at: str
    slot: Any  # the host's Reservation (None while waiting for GPUs)
    started: float = field(default_factory=time.monotonic)


class Sweep:
    """One sweep: state lives here, the loop is ``run``."""

    def __init__(self, cfg: SweepConfig, options: SearchOptions, handle: Any, tracker: Any) -> None:
        self.cfg, self.options, self.handle, self.tracker = cfg, options, handle, tracker
        self.dir = SweepDir(options.out)
        self.max_trials = options.max_trials or cfg.search.max_trials
        self.records = self.dir.read_trials()
        self.stop = threading.Event()
        self.pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix="trial")
        self.futures: dict[cf.Future[TrialResult], Running] = {}
        self.cancels: dict[int, threading.Event] = {}
        self.retry: list[Running] = []  # infra retries and held proposals, launched first when GPUs free up
        self.deferred: list[Running] = []  # need more GPUs than are alive; wait for capacity to come back
        self.counted = {r.number for r in self.records if r.phase == "explore" and r.attempt >= 1}
        self.resumed: dict[tuple[Any, ...], tuple[int, int]] = {}  # layout -> (number, attempt) running at a crash
        # A resumed sweep (perhaps with sweeper fixed) runs again what failed for reasons not the layout's.
        self.decided = {_key(r.layout) for r in self.records if r.result.failure_kind not in NOT_THE_LAYOUTS}
        self.next_number = 1 + max((r.number for r in self.records), default=0)
        self.busy_gpu_s = 0.0
        self.t0 = time.monotonic()
        self.progress = Progress(self.max_trials, cfg.search.objective, self.t0)
        self.calibrator = Calibrator(cfg, options.out)
        self.evidence = MemoryEvidence((1 - cfg.search.memory_headroom) * cfg.cluster.gpu_memory_gib)
        self.raw: dict[Layout, Estimate] = {}  # uncalibrated predictions, the evidence's common scale
        self.probe: Layout | None = None  # the calibration probe in flight (TPE mode)
        self.launchable = self._launchable()
        self.exhaustive = len(self.launchable) <= self.max_trials or cfg.search.sampler == "grid"
        mode: Mode = "ordered" if self.exhaustive else "random" if cfg.search.sampler == "random" else "tpe"
        self.study = LayoutStudy(cfg, self.dir.journal, mode, cfg.search.seed, self._candidates())
        self.reference: str | None = None  # the equivalence gate's reference checkpoint (set by run())

    def _launchable(self) -> list[PlanEntry]:
        """The layouts a proposal may name: the rules accept them, memory does not rule them out (the estimator's
        band and the measured trials, ``sweeper.search.memory_evidence``), and this backend can run them; fastest
        predicted first. Everything else is never proposed (``sweeper plan`` lists it with its reasons; the
        layouts pruned on memory go to sweep.json's ``memory_pruned`` and the report)."""
        plan = [assess(self.cfg, lo, self.calibrator.current) for lo in enumerate_layouts(self.cfg)]
        entries, pruned = [], []
        for e in plan:
            if not e.valid or e.predicted is None:
                continue
            why = self._memory_verdict(e)
            if why is not None:
                pruned.append({"layout": e.layout.short(), **e.predicted.to_json(), "reason": why})
            elif not self.handle.unsupported(self.cfg.model, e.layout):
                entries.append(e)
        meta = self.dir.read_meta()
        meta.memory_pruned = sorted(pruned, key=lambda p: p["memory_gib"])
        self.dir.write_meta(meta)
        return sorted(entries, key=lambda e: -(e.predicted.tokens_per_s or 0.0) if e.predicted else 0.0)

    def _raw(self, layout: Layout) -> Estimate:
        if layout not in self.raw:
            predicted = assess(self.cfg, layout).predicted
            assert predicted is not None, "only valid layouts are compared"
            self.raw[layout] = predicted
        return self.raw[layout]

    def _memory_verdict(self, entry: PlanEntry) -> str | None:
        """None when memory does not rule the layout out, else the one-line reason it is pruned."""
        assert entry.predicted is not None
        if entry.predicted.fits:
            return None
        return self.evidence.verdict(entry.predicted, self._raw(entry.layout))

    def _enqueue_probe(self) -> None:
        """TPE mode: queue the launchable layout inside the error band with the lowest predicted memory, one at a
        time, so that what the estimator cannot decide is measured (and calibrates it) early."""
        if self.study.mode != "tpe" or self.probe is not None:
            return
        band = [e for e in self.launchable if e.uncertain and not self._taken(e.layout)]
        if band:
            self.probe = min(band, key=lambda e: e.predicted.memory_gib if e.predicted else 0.0).layout
            self.study.enqueue(self.probe)
            console.print(f"[blue]estimator[/] probe: {self.probe.short()} is inside the memory error band; "
                          "it runs to measure, not to be pruned")

    def _candidates(self) -> list[Layout]:
        """The launchable layouts in the order an ordered study visits them. ``sampler: grid``: the space's grid
        order (the axes' product as the YAML lists them). A budget that covers every layout: grouped by size,
        largest first (equal-size trials pack the cluster side by side instead of a large one waiting behind
        small ones), fastest predicted first within a size."""
        if self.cfg.search.sampler == "grid":
            grid = {lo: i for i, lo in enumerate(enumerate_layouts(self.cfg))}
            return sorted((e.layout for e in self.launchable), key=grid.__getitem__)
        return [e.layout for e in sorted(self.launchable, key=lambda e: -e.layout.world_size)]

    def _taken(self, layout: Layout) -> bool:
        """Already decided (recorded, not as an infra failure) or running / waiting for GPUs: never proposed."""
        return _key(layout.to_dict()) in self.decided or self._is_running(layout)

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        self._make_reference()
        self._seed_queue()
        while not self.stop.is_set():
            self._fill()
            if not self.futures:
                break
            self._wait_one()
        if self.stop.is_set():
            self._cancel_all()
            return self._finish("interrupted")
        self._defer_waiting()
        self._confirm()
        return self._finish("finished")

    def _make_reference(self) -> None:
        from sweeper.trial.reference import ensure_reference

        outcome = ensure_reference(self.cfg, self.handle, self.dir.root / "reference")
        self.reference = outcome.path
        console.print(f"[blue]equivalence[/] {outcome.note}")
        meta = self.dir.read_meta()
        meta.reference = outcome.to_json()
        self.dir.write_meta(meta)

    def _seed_queue(self) -> None:
        if self.options.resume:
            for run_id in self.tracker.close_orphans():
                console.print(f"resume: MLflow run {run_id} of a trial running at the crash marked KILLED")
            for layout, attrs in self.study.take_over_running():
                if "sweeper_number" in attrs:
                    self.resumed[_key(layout.to_dict())] = (attrs["sweeper_number"], attrs.get("attempt", 1))
                    self.study.enqueue(layout, again=True)
                    console.print(f"resume: trial #{attrs['sweeper_number']} {layout.short()} was running at the "
                                  "crash; it runs again as a new attempt")
        for text in self.cfg.search.seeds:
            self.study.enqueue(layout_from_string(self.cfg, text))
        if self.study.mode == "tpe":  # the estimator's two favourites open the study (a prior), then TPE takes over
            for entry in self.launchable[:PRIOR_PROPOSALS]:
                if not self._taken(entry.layout):
                    self.study.enqueue(entry.layout)
            self._enqueue_probe()

    @property
    def launched(self) -> int:
        """Distinct explored trials launched so far (retries of a trial count once)."""
        return len(self.counted)

    def _budget_left(self) -> bool:
        if self.launched >= self.max_trials:
            return False
        wall = self.cfg.search.wall_time_s
        if wall is not None and time.monotonic() - self.t0 > wall:
            return False
        hours = self.cfg.search.gpu_hours
        return hours is None or self.busy_gpu_s / 3600 < hours

    def _fill(self) -> None:
        alive = self.handle.capacity_total()
        for run in [r for r in self.deferred if r.layout.world_size <= alive]:  # capacity came back (node join)
            self.deferred.remove(run)
            self.retry.append(run)
        while not self.stop.is_set() and len(self.futures) < self._parallel_cap():
            if self.retry:
                run = self.retry[0]
                if run.layout.world_size > self.handle.capacity_total():
                    self.deferred.append(self.retry.pop(0))  # nodes were lost: wait for capacity, don't block
                    continue
                slot = self.handle.reserve(run.layout)
                if slot is None:
                    return  # wait for capacity (a lost node may come back, or running trials end)
                self.retry.pop(0)
                self._launch(run.layout, run.number, run.attempt + 1, "explore", run.proposal, run.predicted, slot)
                continue
            if not self._budget_left():
                return
            # Never a decided or running layout, so this loop ends: each turn launches (budget), holds for GPUs
            # (return), or refuses a layout not refused before (a queued seed, or one calibration no longer fits),
            # recorded once; the study spends at most two asks per proposal.
            proposal = self.study.propose(self._taken)
            if proposal is None:
                return  # every launchable layout has been proposed
            layout = proposal.layout
            entry = assess(self.cfg, layout, self.calibrator.current)
            reason = self._refusal(entry)
            if reason is not None:
                self._record_pruned(entry, reason, proposal.trial)
                continue
            number, attempt = self._number_for(layout)
            slot = self.handle.reserve(layout)
            if slot is None:
                waiting = Running(number, attempt, "explore", layout, proposal.trial, _predicted(entry), None, "", None)
                if layout.world_size > self.handle.capacity_total():
                    self.deferred.append(waiting)  # more GPUs than are alive now (nodes lost): wait for a join
                    continue
                # Hold this proposal until GPUs free up, so large trials are not starved by small ones.
                self.retry.insert(0, waiting)
                return
            self._launch(layout, number, attempt + 1, "explore", proposal.trial, _predicted(entry), slot)

    def _number_for(self, layout: Layout) -> tuple[int, int]:
        """(sweeper trial number, attempts so far): a trial that was running when a driver died keeps its number."""
        resumed = self.resumed.pop(_key(layout.to_dict()), None)
        if resumed is not None:
            return resumed
        self.next_number += 1
        return self.next_number - 1, 0

    def _refusal(self, entry: PlanEntry) -> tuple[str, str] | None:
        if entry.reasons:
            return "; ".join(entry.reasons), "invalid_layout"
        why = self._memory_verdict(entry) if entry.predicted is not None else None
        if why is not None:
            return why, "oom"
        unsupported = self.handle.unsupported(self.cfg.model, entry.layout)
        if unsupported:
            return unsupported, "unsupported"
        return None

    def _parallel_cap(self) -> int:
        cap = self.options.parallel or (self.cfg.search.parallel if self.cfg.search.parallel != "auto" else 0)
        return cap or 1_000_000

    def _is_running(self, layout: Layout) -> bool:
        waiting = self.retry + self.deferred
        return any(r.layout == layout for r in list(self.futures.values()) + waiting)

    def _launch(self, layout: Layout, number: int, attempt: int, phase: Phase, proposal: Any,
                predicted: dict[str, Any] | None, slot: Any) -> None:
        first = phase == "explore" and number not in self.counted
        if phase == "explore":
            self.counted.add(number)
        inject = self._injection_for(self.launched if first else -1)
        if inject == "node-join":
            console.print(f"[magenta]inject node-join[/]: node {self.handle.add_node()} added")
            inject = None
        if proposal is not None:  # lets a resumed sweep re-run this trial under its number if the driver dies now
            proposal.set_user_attr("sweeper_number", number)
            proposal.set_user_attr("attempt", attempt)
        run_id = self.tracker.start_trial(number, attempt, layout, phase, predicted)
        run = Running(number, attempt, phase, layout, proposal, predicted, run_id, _now(), slot)
        cancel = threading.Event()
        trial_dir = self.dir.trial_dir(number, attempt, phase)
        steps = (self.cfg.search.confirm_steps or 2 * self.cfg.training.steps) if phase == "confirm" else None
        future = self.pool.submit(self.handle.run_trial, self.cfg, layout, trial_dir, reservation=slot,
                                  inject=inject, cancel=cancel, steps=steps, reference=self.reference)
        self.futures[future] = run
        self.cancels[id(future)] = cancel
        console.print(f"[cyan]launch[/] #{number}.{attempt} {phase} {layout.short()} on {','.join(slot.labels)}"
                      + (f" [magenta](inject {inject})[/]" if inject else ""))

    def _injection_for(self, nth: int) -> str | None:
        for inj in self.options.injections:
            if inj.trial == nth:
                if inj.kind in ("node-loss", "node-join"):
                    return inj.kind  # the trial runner's handle performs these while the trial runs
                return {"kill-rank": "crash"}.get(inj.kind, inj.kind)
        return None

    def _wait_one(self) -> None:
        done, _ = cf.wait(list(self.futures), timeout=5.0, return_when=cf.FIRST_COMPLETED)
        for future in done:
            run = self.futures.pop(future)
            self.cancels.pop(id(future), None)
            self.handle.release(run.slot)
            self.busy_gpu_s += (time.monotonic() - run.started) * run.layout.world_size
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - a runner bug must not lose the sweep; record it as infra
                result = TrialResult(status="failed", failure_kind="infra", error=f"trial runner error: {exc}")
            self._record(run, result)

    # -- recording -----------------------------------------------------------------------------------------------
    def _record(self, run: Running, result: TrialResult) -> None:
        killed = self.stop.is_set() and result.failure_kind in ("infra", "timeout", None)
        self.tracker.finish_trial(run.run_id, result, killed=killed)
        record = TrialRecord(
            number=run.number, layout=run.layout.to_dict(), result=result, predicted=run.predicted,
            started_at=run.started_at, ended_at=_now(), attempt=run.attempt, mlflow_run_id=run.run_id,
            phase=run.phase,
        )
        self.dir.append_trial(record)
        self.records.append(record)
        colour = "green" if result.passed else "red"
        m = result.metrics
        outcome = (f"{result.failure_kind}: {result.error}" if result.failure_kind else
                   f"{m.tokens_per_s or 0:,.0f} tokens/s, peak {m.peak_memory_gib or 0:.2f} GiB")
        console.print(f"[{colour}]{result.status}[/] #{run.number}.{run.attempt} {run.layout.short()} {outcome}")
        fitted = self.calibrator.add(run.layout, result)
        if fitted is not None:
            for line in fitted.lines():
                console.print(f"[blue]estimator[/] {line}")
        evidence = self.evidence.add(run.number, run.layout.short(), self._raw(run.layout), result)
        raised, self.calibrator.hot_rank_raised = self.calibrator.hot_rank_raised, False
        if fitted is not None or raised or evidence:
            self.launchable = self._launchable()  # what may fit follows the calibration and the measured trials
            self.study.set_candidates(self._candidates())
        if run.layout == self.probe:
            self.probe = None
            if result.passed:
                self._enqueue_probe()
        self._print_progress()
        if run.phase == "confirm":
            return
        if result.failure_kind in NOT_THE_LAYOUTS and not self.stop.is_set():
            if run.attempt < MAX_ATTEMPTS[result.failure_kind]:
                self.retry.append(run)
                return
        if self.stop.is_set() and killed:
            return  # the layout said nothing: left open, re-run on --resume
        self.decided.add(_key(run.layout.to_dict()))
        value = objective_value(result, self.cfg) if is_stable(result, self.cfg) else 0.0
        infeasible = result.failure_kind in ("oom", "invalid_layout", "unsupported") or (
            result.passed and not is_stable(result, self.cfg))
        self.study.tell(run.proposal, None if result.failure_kind in NOT_THE_LAYOUTS else value, infeasible)

    def _print_progress(self) -> None:
        best = candidates(self.records, self.cfg)
        top = (best[0].layout.short(), objective_value(best[0].explore.result, self.cfg)) if best else None
        console.print(f"[dim]{self.progress.line(self.records, len(self.futures), self.launched, top)}[/]")

    def _record_pruned(self, entry: PlanEntry, reason: tuple[str, str], trial: Any,
                       number: int | None = None) -> None:
        text, kind = reason
        result = TrialResult.pruned(text, kind=kind)  # type: ignore[arg-type]
        record = TrialRecord(
            number=number or self.next_number, layout=entry.layout.to_dict(), result=result,
            predicted=_predicted(entry), ended_at=_now(), attempt=0,
        )
        if number is None:
            self.next_number += 1
        self.dir.append_trial(record)
        self.records.append(record)
        self.decided.add(_key(entry.layout.to_dict()))
        # An infra refusal (capacity lost) says nothing about the layout: FAIL for Optuna, not a zero.
        self.study.tell(trial, None if kind == "infra" else 0.0, infeasible=kind != "infra")

    def _defer_waiting(self) -> None:
        """Layouts still waiting for GPUs when nothing else runs (e.g. nodes were lost): recorded, not dropped."""
        for run in self.retry + self.deferred:
            alive = self.handle.capacity_total()
            text = f"deferred: needs {run.layout.world_size} GPUs, {alive} alive when the sweep ended"
            entry = assess(self.cfg, run.layout)
            self._record_pruned(entry, (text, "infra"), run.proposal, number=run.number)
        self.retry.clear()
        self.deferred.clear()

    # -- confirmation, cancellation, finish ---------------------------------------------------------------------
    def _confirm(self) -> None:
        """Re-run the best candidates with more steps until ``confirm_top`` of them passed their confirmation
        (a candidate that fails it is dropped and the next one is tried; at most 2 x confirm_top runs)."""
        wanted = self.cfg.search.confirm_top
        budget = 2 * wanted
        while wanted and not self.stop.is_set():
            cands = candidates(self.records, self.cfg)
            good = [c for c in cands if c.confirmations and c.confirmed]
            pending = {r.number for r in self.futures.values() if r.phase == "confirm"}
            todo = [c for c in cands if not c.confirmations and c.number not in pending]
            slot = None
            if len(good) + len(pending) < wanted and budget > 0 and todo:
                slot = self.handle.reserve(todo[0].layout)
            if slot is not None:
                budget -= 1
                self._launch(todo[0].layout, todo[0].number, 1, "confirm", None, todo[0].explore.predicted, slot)
            elif self.futures:
                self._wait_one()
            else:
                break

    def _cancel_all(self) -> None:
        for event in self.cancels.values():
            event.set()
        deadline = time.monotonic() + 120
        while self.futures and time.monotonic() < deadline:
            self._wait_one()
        for run in self.futures.values():
            self.tracker.kill_trial(run.run_id)

    def _finish(self, status: str) -> int:
        winner = choose(candidates(self.records, self.cfg), self.cfg, confirmed_only=self.cfg.search.confirm_top > 0)
        if winner is not None:
            self.dir.write_best(best_layout_document(self.cfg, winner, self.tracker.tracking_uri))
        elapsed = time.monotonic() - self.t0
        gpus = self.handle.capacity_total() or 1
        meta = self.dir.read_meta()
        meta.status, meta.ended_at = status, _now()
        meta.best = None if winner is None else {
            "number": winner.number, "layout": winner.layout.short(),
            self.cfg.search.objective: winner.median(self.cfg.search.objective)}
        meta.scheduling_efficiency = self.busy_gpu_s / (elapsed * gpus) if elapsed > 0 else None
        meta.calibration = self.calibrator.report.lines() if self.calibrator.report else [
            "not calibrated: no trial measured device memory (the CPU backend measures host RSS)"]
        self.dir.write_meta(meta)
        from sweeper.report.render import render_report

        report = render_report(self.dir.root)
        self.tracker.finish_sweep("KILLED" if status == "interrupted" else "FINISHED",
                                  {"status": status, "best": winner.layout.short() if winner else "none"})
        console.print(f"report: {report}")
        if winner is None:
            console.print("[red]no stable layout passed[/] (see the report for why)")
            return EXIT_FAILED
        console.print(f"[green]best stable layout[/]: {winner.layout.short()} -> {self.dir.best}")
        return EXIT_FAILED if status == "interrupted" else EXIT_OK


def _key(layout: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted((k, v) for k, v in layout.items() if k not in ("dp", "edp")))


def _predicted(entry: PlanEntry) -> dict[str, Any] | None:
    return entry.predicted.to_json() if entry.predicted else None


def run_search(cfg: SweepConfig, options: SearchOptions) -> int:
    """The `search` command: exit 0 with a stable layout, 1 without one, 2 on bad input (raised as UsageError)."""
    sweep_dir = SweepDir(options.out)
    if sweep_dir.exists() and not options.resume:
        raise UsageError(
            f"--out: {options.out} already holds a sweep; pass --resume to continue it or choose another --out")
    if options.resume and not sweep_dir.exists():
        raise UsageError(f"--resume: {options.out} holds no sweep to resume")
    for i, text in enumerate(cfg.search.seeds):  # bad seeds are bad input: refused before anything is written
        try:
            layout_from_string(cfg, text)
        except LayoutError as exc:
            raise UsageError(f"search.seeds[{i}]: {exc}".replace("--layout: ", "")) from None
    from sweeper.record.tracking import Tracker
    from sweeper.trial.host import open_host

    tracker = Tracker(cfg.tracking.mlflow_tracking_uri, cfg.experiment_name)  # creates the store first
    sweep_dir.create()
    meta = sweep_dir.read_meta()
    with open_host(cfg, options.address) as handle:
        doctor = handle.doctor(cfg)
        if not doctor.ok:
            console.print("[red]doctor: nodes disagree[/]: " + "; ".join(doctor.problems))
            return EXIT_FAILED
        parent = tracker.start_sweep(
            cfg.name, _sweep_params(cfg), {"estimator": "sweeper.estimate", "backend": handle.backend_name,
                                           "proxy": str(is_proxy(cfg.model)).lower()},
            resume_run_id=(meta.mlflow or {}).get("parent_run_id") if options.resume else None,
        )
        meta.name, meta.model, meta.cluster = cfg.name, cfg.model.model_dump(), cfg.cluster.model_dump()
        meta.memory_headroom, meta.objective, meta.status = cfg.search.memory_headroom, cfg.search.objective, "running"
        meta.started_at = meta.started_at or _now()
        meta.memory_kind = "host" if handle.simulated else "device"
        meta.mlflow = {"tracking_uri": tracker.tracking_uri, "experiment": cfg.experiment_name, "parent_run_id": parent}
        sweep_dir.write_meta(meta)
        sweep = Sweep(cfg, options, handle, tracker)
        previous = _install_signal_handlers(sweep.stop)
        try:
            return sweep.run()
        finally:
            _restore_signal_handlers(previous)
            sweep.pool.shutdown(wait=False, cancel_futures=True)


def _sweep_params(cfg: SweepConfig) -> dict[str, Any]:
    c = cfg.cluster
    space = " ".join(f"{a.name}={cfg.world_sizes if a.name == 'gpus' else cfg.space.values(a.name)}"
                     for a in SEARCHED if a.name != "distributed_optimizer")
    return {
        "model": cfg.model.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
        "gpu_memory_gib": c.gpu_memory_gib, "compute_capability": c.compute_capability,
        "seq_length": cfg.training.seq_length, "global_batch_size": cfg.training.global_batch_size,
        "steps": cfg.training.steps, "space": space,
        "max_trials": cfg.search.max_trials, "objective": cfg.search.objective,
        "memory_headroom": cfg.search.memory_headroom,
    }


def _install_signal_handlers(stop: threading.Event) -> dict[int, Any]:
    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for trials to wind down
        console.print(f"[yellow]{signal.Signals(signum).name}: stopping launches, cancelling running trials[/]")
        stop.set()

    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
