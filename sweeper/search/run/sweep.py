"""The sweep loop (``Sweep.run``). Optuna proposes (``search.propose.study``), the scheduler launches trials on free
GPUs (``search.run.scheduler``), MLflow records.

The driver thread owns every decision and every write (trials.jsonl, Optuna, MLflow); trials run in worker
threads that only block on Ray. One loop: fill free capacity with proposals (the study proposes only layouts
the frontier, ``search.propose.frontier``, holds launchable: the rules accept them, memory does not rule them out, no
measured trial dominates them and the backend can run them; a queued seed that is not launchable is refused and
recorded once, without launching), wait for a trial to end, record it, repeat until the budget or
the launchable layouts are spent; then confirm the top candidates and export the winner. Infrastructure
failures (a node lost, an actor killed) are not the layout's fault: the same layout is re-queued as a new
attempt of the same trial.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.errors import EXIT_FAILED, EXIT_OK
from sweeper.estimate.calibrator import Calibrator
from sweeper.export import EXECUTABLE, export_files
from sweeper.plan.assess import PlanEntry, assess, invalid_reasons
from sweeper.record.schema import Phase, TrialRecord, TrialResult
from sweeper.record.sweepdir import SweepDir
from sweeper.report.render import render_report, report_figures
from sweeper.search.console import Display, Verbosity, console
from sweeper.search.decide.candidates import (
    GATE_OFF,
    NOT_THE_LAYOUTS,
    best_layout_document,
    candidates,
    choose,
    confirm_attempts,
    is_stable,
    steady,
    step_time_drift,
    trials_without_improvement,
)
from sweeper.search.decide.checkpoints import prune_checkpoints
from sweeper.search.decide.decision import decision, summary_line
from sweeper.search.decide.objective import objective_value
from sweeper.search.decide.summary import folder_artifacts, sweep_metrics, trials_table
from sweeper.search.progress import Progress
from sweeper.search.propose.frontier import Frontier, layout_key
from sweeper.search.propose.refit import turn as refit_turn
from sweeper.search.propose.study import LayoutStudy, Mode
from sweeper.search.run.faults import Injection, injection_for
from sweeper.search.run.repeated import RepeatedFailure
from sweeper.search.run.scheduler import HOLD, Running, Scheduler
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Host, Reservation
from sweeper.trial.reference import ensure_reference
from sweeper.trial.runner import HOST_OUT_OF_MEMORY

if TYPE_CHECKING:
    from sweeper.record.tracking import Tracker

# A failure that says nothing about the layout (selection.NOT_THE_LAYOUTS): Optuna is told nothing (FAIL); the
# layout runs again as a new attempt, up to these many attempts.
MAX_ATTEMPTS = {"infra": 3, "internal": 2}
# In TPE mode on GPUs, the estimator's fastest predicted layouts are proposed first (a prior). Not on a simulated
# cluster: the estimator prices the GPUs its cluster section names, while the trials there measure CPU ranks sharing
# this machine's cores, where its favourites (more ranks, BF16) are among the slowest layouts (measured:
# benchmarks/search_efficiency.py on tests/data/landscape_quickstart.json, 12.5 trials with them vs 8.5 without).
PRIOR_PROPOSALS = 2


def prior_proposals(simulated: bool) -> int:
    """How many of the estimator's favourites open a TPE study (see PRIOR_PROPOSALS)."""
    return 0 if simulated else PRIOR_PROPOSALS


@dataclass
class SearchOptions:
    out: Path
    resume: bool = False
    max_trials: int | None = None
    parallel: int | None = None
    address: str | None = None
    injections: list[Injection] = field(default_factory=list)
    space: Path | None = None  # the search YAML, copied into the sweep folder (space.yaml) when the sweep starts
    overrides: list[str] = field(default_factory=list)  # --set items applied over it (named in the copy's header)
    verbosity: Verbosity = "normal"  # -q / -v
    display: Display | None = None  # the live table of running trials (a terminal), None: plain progress lines
    rehearse: bool = False  # modelled trials on a virtual clock (trial.rehearsal), never measured
    rehearse_faults: str | None = None  # --rehearse-faults, checked by trial.rehearsal.Faults.parse


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class Sweep:
    """One sweep: state lives here, the loop is ``run``."""

    def __init__(self, cfg: SweepConfig, options: SearchOptions, handle: Host, tracker: Tracker) -> None:
        self.cfg, self.options, self.handle, self.tracker = cfg, options, handle, tracker
        self.dir = SweepDir(options.out)
        self.max_trials = options.max_trials or cfg.search.max_trials
        self.records = self.dir.read_trials()
        self.stop = threading.Event()
        self.scheduler = Scheduler(handle, self._parallel_cap())
        self.t0 = self.scheduler.now()
        self.counted = {r.number for r in self.records if r.phase == "explore" and r.attempt >= 1}
        self.resumed: dict[tuple[Any, ...], tuple[int, int]] = {}  # layout -> (number, attempt) running at a crash
        self.next_number = 1 + max((r.number for r in self.records), default=0)
        search = cfg.search
        confirm_runs = search.confirm_top * (search.confirm_steps or 2 * cfg.training.steps) / cfg.training.steps
        self.progress = Progress(self.max_trials, search.objective, self.t0, confirm_runs, self.scheduler.now)
        # A simulated cluster's ranks share this host's cores: the step-time model prices that (search.propose.refit).
        self.calibrator = Calibrator(cfg, options.out, host_cores=(os.cpu_count() or 1) if handle.simulated else None,
                                     shared=not options.rehearse)
        self.probe: Layout | None = None  # the calibration probe in flight (TPE mode)
        self.backfilled: list[int] = []  # trials started on free GPUs while a larger one waited for its own
        self.stopped_early: str | None = None
        self.repeated = RepeatedFailure()
        self.halted: str | None = None  # why the sweep stopped itself (a cause that is not transient)
        self.frontier = Frontier(cfg, handle, self.calibrator, self.dir, self.records, self.scheduler.is_running)
        skipped = self.dir.read_meta().unsupported or []
        if skipped:
            console.print(f"[yellow]backend[/] {len(skipped)} valid layouts cannot run here and are not proposed "
                          f"(sweep.json unsupported), e.g. {skipped[0]['layout']}: {skipped[0]['reason']}")
        if not self.frontier.launchable:
            reasons = invalid_reasons(self.frontier.assessed)
            if reasons:  # every layout refused: say the commonest reason (``sweeper plan`` lists them all)
                reason, count = reasons[0]
                console.print(f"[red]space[/] no layout of the space can run: {count} of {len(self.frontier.assessed)}"
                              f" are refused because {reason} (sweeper plan lists every reason)", important=True)
        self.exhaustive = len(self.frontier.launchable) <= self.max_trials or cfg.search.sampler == "grid"
        mode: Mode = "ordered" if self.exhaustive else "random" if cfg.search.sampler == "random" else "tpe"
        self.study = LayoutStudy(cfg, self.dir.journal, mode, cfg.search.seed, self.frontier.order())
        self.reference: str | None = None  # the equivalence gate's reference checkpoint (set by run())

    def _enqueue_probe(self) -> None:
        """TPE mode: queue the launchable layout inside the error band with the lowest predicted memory, one at a
        time, so that what the estimator cannot decide is measured (and calibrates it) early."""
        if self.study.mode != "tpe" or self.probe is not None:
            return
        band = [e for e in self.frontier.launchable if e.uncertain and not self.frontier.taken(e.layout)]
        if band:
            self.probe = min(band, key=lambda e: e.predicted.memory_gib if e.predicted else 0.0).layout
            self.study.enqueue(self.probe)
            console.print(f"[blue]estimator[/] probe: {self.probe.short()} is inside the memory error band; "
                          "it runs to measure, not to be pruned")

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        started = self.handle.prestart([e.layout for e in self.frontier.launchable])
        if started:
            console.print(f"starting {started} warm ranks beside the reference run")
        self._make_reference()
        self._seed_queue()
        while not self.stop.is_set():
            self._fill()
            if not self.scheduler.in_flight:
                break
            self._wait_one()
        if not self.stop.is_set():
            self._defer_waiting()
            self._confirm()
        if self.stop.is_set():  # while exploring or confirming: running trials are cancelled, not left to the end
            self._cancel_all()
            return self._finish("failed" if self.halted else "interrupted")
        return self._finish("finished")

    def _make_reference(self) -> None:
        outcome = ensure_reference(self.cfg, self.handle, self.dir.root / "reference")
        self.reference = outcome.path
        console.print(f"[blue]equivalence[/] {outcome.note}")
        if outcome.path is None:
            console.print("[yellow]equivalence[/] without the reference no trial proves it computes the model: "
                          + ("none can be stable (search.require_equivalence: false accepts them)"
                             if self.cfg.search.require_equivalence else
                             "search.require_equivalence is false, so passed trials may still be stable"),
                          important=True)
        meta = self.dir.read_meta()
        meta.reference = outcome.to_json()
        self.dir.write_meta(meta)

    def _seed_queue(self) -> None:
        if self.options.resume:
            for run_id in self.tracker.close_orphans():
                console.print(f"resume: MLflow run {run_id} of a trial running at the crash marked KILLED")
            missing = self.tracker.log_missing(self.records)  # trials that ended while MLflow was behind
            if missing:
                console.print(f"resume: {missing} trial attempt(s) recorded while MLflow was behind logged to it now")
            for layout, attrs in self.study.take_over_running(self._recorded_outcome):
                if "sweeper_number" in attrs:
                    self.resumed[layout_key(layout.to_dict())] = (attrs["sweeper_number"], attrs.get("attempt", 1))
                    self.study.enqueue(layout, again=True)
                    console.print(f"resume: trial #{attrs['sweeper_number']} {layout.short()} was running at the "
                                  "crash; it runs again as a new attempt")
            # Their numbers are taken: a trial that had no record yet may hold a number above every recorded one.
            self.next_number = max([self.next_number, *(1 + n for n, _ in self.resumed.values())])
        for text in self.cfg.search.seeds:
            self.study.enqueue(layout_from_string(self.cfg, text))
        if self.study.mode == "tpe":  # the estimator's two favourites open the study (a prior), then TPE takes over
            for entry in self.frontier.launchable[:prior_proposals(self.handle.simulated)]:
                if not self.frontier.taken(entry.layout):
                    self.study.enqueue(entry.layout)
            self._enqueue_probe()

    @property
    def launched(self) -> int:
        """Distinct explored trials launched so far (retries of a trial count once)."""
        return len(self.counted)

    def _budget_left(self) -> bool:
        waiting = sum(1 for r in self.scheduler.waiting if r.number not in self.counted)  # proposals held for GPUs
        if self.launched + waiting >= self.max_trials:
            return False
        if self.stopped_early is None and self.cfg.search.patience is not None:
            stale = trials_without_improvement(self.records, self.cfg)
            if stale >= self.cfg.search.patience:
                self.stopped_early = (f"stopped exploring: {stale} trials without a better stable layout "
                                      f"(search.patience {self.cfg.search.patience})")
                console.print(f"[yellow]{self.stopped_early}[/]", important=True)
        if self.stopped_early is not None:
            return False
        wall = self.cfg.search.wall_time_s
        if wall is not None and self.scheduler.now() - self.t0 > wall:
            return False
        hours = self.cfg.search.gpu_hours
        return hours is None or self.scheduler.busy_gpu_s / 3600 < hours

    def _fill(self) -> None:
        self.scheduler.readmit()  # capacity came back (node join)
        while not self.stop.is_set() and self.scheduler.has_room():
            waiting = self.scheduler.take_retry()
            backfill = waiting == HOLD
            if backfill and not self._may_backfill():
                return  # wait for capacity (a lost node may come back, or running trials end)
            if isinstance(waiting, tuple):
                run, reserved = waiting
                # A proposal that waited for GPUs: what finished meanwhile may rule it out.
                if not run.started_at and self._admitted(run.layout, run.proposal, run.number) is None:
                    self.handle.release(reserved)
                    continue
                self._launch(run.layout, run.number, run.attempt + 1, "explore", run.proposal, run.predicted, reserved)
                continue
            if not self._budget_left():
                return
            # Never a decided or running layout, so this loop ends: each turn launches (budget), holds for GPUs
            # (return), or refuses a layout not refused before (a queued seed, or one calibration no longer fits),
            # recorded once; the study spends at most two asks per proposal. A backfill draws only layouts that
            # fit on the free GPUs now.
            taken = self.frontier.taken
            refused = (lambda lo: taken(lo) or not self.handle.fits(lo)) if backfill else taken
            self._refit_turn(refused)
            proposal = self.study.propose(refused)
            if proposal is None:
                return  # every launchable layout has been proposed (or, backfilling, none fits now)
            layout = proposal.layout
            entry = self._admitted(layout, proposal.trial)
            if entry is None:
                continue
            number, attempt = self._number_for(layout)
            slot = self.handle.reserve(layout)
            if slot is None:
                held = Running(number, attempt, "explore", layout, proposal.trial, _predicted(entry), None, "", None)
                if backfill:  # its GPUs were taken since: it waits behind the head
                    self.scheduler.retry_later(held)
                    return
                # First in line when GPUs free up (or deferred: nodes were lost); the GPUs left free may take a
                # smaller trial meanwhile (backfill).
                self.scheduler.hold(held)
                continue
            if backfill:
                head = self.scheduler.retry[0]
                self.backfilled.append(number)
                console.print(f"[blue]backfill[/] #{number} {layout.short()} runs on free GPUs while #{head.number} "
                              f"waits for {head.layout.world_size}")
            self._launch(layout, number, attempt + 1, "explore", proposal.trial, _predicted(entry), slot)

    def _refit_turn(self, refused: Callable[[Layout], bool]) -> None:
        """TPE mode: queue the refit step-time model's best untried launchable layout (``search.propose.refit``),
        once it has the samples for a turn and nothing else is queued (seeds, the estimator's favourites, the probe)."""
        if self.study.mode != "tpe" or self.study.has_queued():
            return
        untried = [e.layout for e in self.frontier.launchable if not refused(e.layout)]
        choice = refit_turn(self.calibrator.step, self.cfg, untried)
        if choice is not None:
            self.study.enqueue(choice)

    def _may_backfill(self) -> bool:
        """A smaller proposal may start while the head of the queue waits for GPUs (``Scheduler.may_backfill``),
        but never ahead of a queued layout (seeds, the estimator's favourites): those are proposed in order."""
        return self.scheduler.may_backfill() and not self.study.has_queued()

    def _number_for(self, layout: Layout) -> tuple[int, int]:
        """(sweeper trial number, attempts so far): a trial that was running when a driver died keeps its number."""
        resumed = self.resumed.pop(layout_key(layout.to_dict()), None)
        if resumed is not None:
            return resumed
        self.next_number += 1
        return self.next_number - 1, 0

    def _admitted(self, layout: Layout, trial: Any, number: int | None = None) -> PlanEntry | None:
        """The layout's plan entry as it stands now, or None after recording it as pruned (the rules, memory or the
        backend refuse it; ``number``: the trial number it already holds)."""
        entry, reason = self.frontier.assess(layout)
        if reason is None:
            return entry
        self._record_pruned(entry, reason, trial, number=number)
        return None

    def _confirm_alone(self) -> bool:
        """search.confirm_alone, null meaning on GPU clusters (a simulated cluster's nodes are one machine)."""
        alone = self.cfg.search.confirm_alone
        return not self.handle.simulated if alone is None else alone

    def _parallel_cap(self) -> int:
        cap = self.options.parallel or (self.cfg.search.parallel if self.cfg.search.parallel != "auto" else 0)
        return cap or 1_000_000

    def _launch(self, layout: Layout, number: int, attempt: int, phase: Phase, proposal: Any,
                predicted: dict[str, Any] | None, slot: Reservation) -> None:
        first = phase == "explore" and number not in self.counted
        if phase == "explore":
            self.counted.add(number)
        inject = injection_for(self.options.injections, self.launched if first else -1)
        if inject == "node-join":
            console.print(f"[magenta]inject node-join[/]: node {self.handle.add_node()} added")
            inject = None
        if proposal is not None:  # lets a resumed sweep re-run this trial under its number if the driver dies now
            proposal.set_user_attr("sweeper_number", number)
            proposal.set_user_attr("attempt", attempt)
        run_id = self.tracker.start_trial(number, attempt, layout, phase, predicted)
        run = Running(number, attempt, phase, layout, proposal, predicted, run_id, now(), slot)
        steps = (self.cfg.search.confirm_steps or 2 * self.cfg.training.steps) if phase == "confirm" else None
        self.scheduler.submit(run, cfg=self.cfg, layout=layout, trial_dir=self.dir.trial_dir(number, attempt, phase),
                              inject=inject, steps=steps, reference=self.reference,
                              routing_stress=phase == "confirm")  # finalists only (issue 17)
        console.print(f"[cyan]launch[/] #{number}.{attempt} {phase} {layout.short()} on {','.join(slot.labels)}"
                      + (f" [magenta](inject {inject})[/]" if inject else ""))
        self._print_progress(line=False)

    def _wait_one(self) -> None:
        ended = self.scheduler.wait_one()
        for run, result in ended:
            self._record(run, result)
        if not ended:
            self._print_progress(line=False)  # the live table's elapsed times move on; no line is printed

    # -- recording -----------------------------------------------------------------------------------------------
    def _record(self, run: Running, result: TrialResult) -> None:
        if self.reference is None and result.passed and GATE_OFF not in result.notes:
            result.notes.append(GATE_OFF)  # nothing proved it computes the model: stable only if the YAML says so
        killed = self.stop.is_set() and result.failure_kind in ("infra", "timeout", None)
        self.tracker.finish_trial(run.run_id, result, killed=killed)  # no run id: started while MLflow was behind
        record = TrialRecord(
            number=run.number, layout=run.layout.to_dict(), result=result, predicted=run.predicted,
            started_at=run.started_at, ended_at=now(), attempt=run.attempt, mlflow_run_id=run.run_id,
            phase=run.phase, neighbours=sorted(run.neighbours), other_jobs_gpus=run.other_jobs_gpus,
        )
        self.dir.append_trial(record)
        self.records.append(record)
        if self.tracker.behind:  # the tracking server went away: logged from the records once it answers
            self.tracker.catch_up(self.records)
        colour = "green" if result.passed else "red"
        m = result.metrics
        outcome = (f"{result.failure_kind}: {result.error}" if result.failure_kind else
                   f"{m.tokens_per_s or 0:,.0f} tokens/s, peak {m.peak_memory_gib or 0:.2f} GiB")
        console.print(f"[{colour}]{result.status}[/] #{run.number}.{run.attempt} {run.layout.short()} {outcome}",
                      important=not result.passed)
        if run.phase == "confirm" and not steady(result, self.cfg):  # unsteady: the drift exceeded the limit
            drift = step_time_drift(result, self.cfg.training.warmup_steps)
            console.print(f"[yellow]unsteady[/] #{run.number}.{run.attempt} confirm: the last quarter of its steps "
                          f"took {drift:.2f}x the first (search.confirm_max_step_time_drift "
                          f"{self.cfg.search.confirm_max_step_time_drift:g}): not confirmed", important=True)
        for warning in result.placement_warnings:
            console.print(f"[yellow]placement[/] #{run.number}.{run.attempt}: {warning}"
                          + ("" if self.cfg.search.allow_cross_node_tp else
                             " (not stable: search.allow_cross_node_tp is false)"), important=True)
        update = self.calibrator.add(run.layout, result, run.number)
        for line in update.fit.lines() if update.fit else []:
            console.print(f"[blue]estimator[/] {line}")
        if self.frontier.learn(run.number, run.layout, result, update.changed):
            self.study.set_candidates(self.frontier.order())
        if run.layout == self.probe:
            self.probe = None
            if result.passed:
                self._enqueue_probe()
        self._print_progress()
        halt = None if self.stop.is_set() else self.repeated.add(layout_key(run.layout.to_dict()), run.attempt, result)
        if halt is not None:
            self.halted = halt
            console.print(f"[red]{halt}[/]", important=True)
            self.stop.set()  # running trials are cancelled and left open for --resume
            return  # this layout too: its cause was not its own
        if run.phase == "confirm":
            return
        if result.failure_kind in NOT_THE_LAYOUTS and not self.stop.is_set():
            # On a simulated cluster every node is this machine: ranks killed for its host memory would be again.
            exhausted = self.handle.simulated and HOST_OUT_OF_MEMORY in result.notes
            if exhausted:
                console.print(f"[yellow]not re-run[/] #{run.number}: its {len(result.rank_nodes) or 'many'} ranks "
                              f"need more memory than this machine has (not the layout's fault)", important=True)
            elif run.attempt < MAX_ATTEMPTS[result.failure_kind]:
                self.scheduler.retry_later(run)
                return
        if self.stop.is_set() and killed:
            return  # the layout said nothing: left open, re-run on --resume
        self.frontier.decide(run.layout)
        self.study.tell(run.proposal, *self._outcome(result, run.layout))

    def _outcome(self, result: TrialResult, layout: Layout) -> tuple[float | None, bool]:
        """What Optuna is told of an ended attempt: its objective (0 when not stable; None when the attempt said
        nothing about the layout) and whether its region is infeasible."""
        value = objective_value(result, self.cfg, layout) if is_stable(result, self.cfg) else 0.0
        infeasible = result.failure_kind in ("oom", "checkpoint_host_oom", "invalid_layout", "unsupported") or (
            result.passed and not is_stable(result, self.cfg))
        return None if result.failure_kind in NOT_THE_LAYOUTS else value, infeasible

    def _recorded_outcome(self, attrs: dict[str, Any]) -> tuple[float | None, bool] | None:
        """A trial Optuna still holds as running whose attempt trials.jsonl already has (the driver died between
        recording it and telling Optuna): that outcome, or None when the attempt must run (again)."""
        number, attempt = attrs.get("sweeper_number"), attrs.get("attempt", 1)
        record = next((r for r in self.records if r.phase == "explore" and r.number == number
                       and r.attempt == attempt), None)
        if record is None or record.result.failure_kind in NOT_THE_LAYOUTS:
            return None
        return self._outcome(record.result, Layout.from_dict(record.layout))

    def _print_progress(self, line: bool = True) -> None:
        """The progress summary and the running trials: the live table on a terminal; ``line``: also as a plain
        line otherwise (and in sweep.log)."""
        best = candidates(self.records, self.cfg)
        top = (best[0].layout.short(), best[0].values(self.cfg)[0]) if best else None
        summary = self.progress.line(self.records, len(self.scheduler.in_flight), self.launched, top,
                                     others=self.scheduler.host.held_by_others(),
                                     waiting=bool(self.scheduler.waiting))
        running = [{"trial": f"{r.number}.{r.attempt}", "phase": r.phase, "layout": r.layout.short(),
                    "gpus": r.layout.world_size, "nodes": ",".join(r.slot.labels) if r.slot else "",
                    "elapsed_s": self.scheduler.now() - r.started} for r in self.scheduler.in_flight]
        console.progress(f"[dim]{summary}[/]", running, line=line)

    def _record_pruned(self, entry: PlanEntry, reason: tuple[str, str], trial: Any,
                       number: int | None = None) -> None:
        text, kind = reason
        result = TrialResult.pruned(text, kind=kind)  # type: ignore[arg-type]
        record = TrialRecord(
            number=number or self.next_number, layout=entry.layout.to_dict(), result=result,
            predicted=_predicted(entry), ended_at=now(), attempt=0,
        )
        if number is None:
            self.next_number += 1
        self.dir.append_trial(record)
        self.records.append(record)
        self.frontier.decide(entry.layout)
        # An infra refusal (capacity lost) says nothing about the layout: FAIL for Optuna, not a zero.
        self.study.tell(trial, None if kind == "infra" else 0.0, infeasible=kind != "infra")

    def _defer_waiting(self) -> None:
        """Layouts still waiting for GPUs when nothing else runs (e.g. nodes were lost): recorded, not dropped."""
        for run in self.scheduler.drain_waiting():
            alive = self.handle.capacity_total()
            text = f"deferred: needs {run.layout.world_size} GPUs, {alive} alive when the sweep ended"
            entry = assess(self.cfg, run.layout)
            self._record_pruned(entry, (text, "infra"), run.proposal, number=run.number)

    # -- confirmation, cancellation, finish ---------------------------------------------------------------------
    def _confirm(self) -> None:
        """Re-run the best candidates with more steps until ``confirm_top`` of them passed their confirmation
        (a candidate that fails it is dropped and the next one is tried; at most 2 x confirm_top runs)."""
        wanted = self.cfg.search.confirm_top
        budget = 2 * wanted
        while wanted and not self.stop.is_set():
            cands = candidates(self.records, self.cfg)
            good = [c for c in cands if c.confirmations and c.confirmed(self.cfg)]
            pending = {r.number for r in self.scheduler.in_flight if r.phase == "confirm"}
            # A confirmation lost to a fault that is not the layout's (a node, a placement timeout) is made again,
            # up to the attempts an exploration gets; it spends none of the budget of candidates tried.
            todo = [c for c in cands if not c.confirmations and c.number not in pending
                    and confirm_attempts(self.records, c.number)[1] < MAX_ATTEMPTS["infra"]]
            slot = None
            retry = bool(todo) and confirm_attempts(self.records, todo[0].number)[1] > 0
            if len(good) + len(pending) < wanted and (budget > 0 or retry) and todo:
                slot = self.handle.reserve(todo[0].layout, alone=self._confirm_alone())
            if slot is not None:
                budget -= 0 if retry else 1
                attempt = confirm_attempts(self.records, todo[0].number)[0] + 1
                self._launch(todo[0].layout, todo[0].number, attempt, "confirm", None, todo[0].explore.predicted,
                             slot)
            elif self.scheduler.in_flight:
                self._wait_one()
            else:
                break

    def _cancel_all(self) -> None:
        self.scheduler.cancel_all()
        deadline = time.monotonic() + 120
        while self.scheduler.in_flight and time.monotonic() < deadline:
            self._wait_one()
        for run in self.scheduler.in_flight:
            if run.run_id is not None:
                self.tracker.kill_trial(run.run_id)

    def abandon(self) -> None:
        """A second Ctrl-C: the sweep stops without waiting for its trials (the caller's shutdown kills them). What
        was recorded stays; sweep.json and MLflow say the sweep was interrupted, and ``--resume`` continues it."""
        meta = self.dir.read_meta()
        meta.status, meta.ended_at = "interrupted", now()
        self.dir.write_meta(meta)
        self.tracker.kill_sweep()

    def _finish(self, status: str) -> int:
        cands = candidates(self.records, self.cfg)
        winner = choose(cands, self.cfg, confirmed_only=self.cfg.search.confirm_top > 0)
        if winner is not None:
            self.dir.write_best(best_layout_document(self.cfg, winner, self.tracker.tracking_uri, cands),
                                export_files(self.cfg, winner.layout, winner.number), EXECUTABLE)
        elapsed = self.scheduler.now() - self.t0
        gpus = self.handle.capacity_total() or 1
        meta = self.dir.read_meta()
        meta.status, meta.ended_at = status, now()
        meta.best = None if winner is None else {
            "number": winner.number, "layout": winner.layout.short(),
            self.cfg.search.objective: winner.median(self.cfg)}
        meta.scheduling_efficiency = self.scheduler.busy_gpu_s / (elapsed * gpus) if elapsed > 0 else None
        meta.stopped_early = self.halted or self.stopped_early
        meta.decision = decision(self.cfg, cands, winner, self.records, self.calibrator.current)
        meta.calibration = self.calibrator.report.lines() if self.calibrator.report else [
            "not calibrated: no trial measured device memory (the CPU backend measures host RSS)"]
        meta.step_time_fit = self.calibrator.step_time_fit()
        if status == "finished":  # an interrupted sweep may resume and choose another winner (issue 43)
            pruned = prune_checkpoints(self.records, self.cfg.training.keep_checkpoints,
                                       winner.number if winner is not None else None)
            meta.checkpoints = pruned.to_json()
            if (line := pruned.line()) is not None:
                console.print(line)
        self.dir.write_meta(meta)
        report = render_report(self.dir.root)
        if self.tracker.behind:
            self.tracker.catch_up(self.records)
        self.tracker.finish_sweep(
            {"interrupted": "KILLED", "failed": "FAILED"}.get(status, "FINISHED"),
            {"status": status, "best": winner.layout.short() if winner else "none"},
            metrics=sweep_metrics(self.records, winner, self.cfg, meta.scheduling_efficiency),
            table=trials_table(self.records),
            artifacts=folder_artifacts(self.dir),
            figures=report_figures(self.dir.root),
        )
        console.print(f"report: {report}", important=True)
        if (view := self.tracker.view_hint()) is not None:
            console.print(f"trials in MLflow: {view}", important=True)
        if self.halted is not None:
            console.print(f"[red]{self.halted}[/]", important=True)
            return EXIT_FAILED
        if winner is None and status == "interrupted" and any(not c.confirmations for c in cands):
            console.print(f"[yellow]not confirmed yet[/]: {len(cands)} stable layout(s) await their confirmation; "
                          "`sweeper search --resume` confirms them", important=True)
            return EXIT_FAILED
        if winner is None:
            console.print("[red]no stable layout passed[/] (see the report for why)", important=True)
            return EXIT_FAILED
        console.print(f"[green]best stable layout[/]: {winner.layout.short()} -> {self.dir.best}", important=True)
        if (projected := summary_line(meta.decision)) is not None:
            console.print(projected, important=True)
        return EXIT_FAILED if status == "interrupted" else EXIT_OK


def _predicted(entry: PlanEntry) -> dict[str, Any] | None:
    return entry.predicted.to_json() if entry.predicted else None
