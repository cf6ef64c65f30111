"""What a sweep's phases share: its state (config, folder, records, cluster, scheduler, frontier, study, estimator)
and the steps every phase takes with a trial: launch it, wait for one to end, record it, print the progress.

The driver thread owns every decision and every write (trials.jsonl, Optuna, MLflow); trials run in worker threads
that only block on Ray. The phases (``run.reference``, ``run.explore``, ``run.confirm``, ``run.finish``) are run in
order by ``run.sweep.Sweep``.
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

from sweeper.config.schema import SweepConfig
from sweeper.estimate.calibrator import Calibrator, Measured
from sweeper.plan.assess import PlanEntry, invalid_reasons
from sweeper.record.schema import Phase, SweepMeta, TrialRecord, TrialResult
from sweeper.record.sweepdir import SweepDir
from sweeper.search.console import Display, Verbosity, console
from sweeper.search.decide.candidates import candidates, run_gpus
from sweeper.search.decide.objective import objective_value
from sweeper.search.decide.verdicts import (
    GATE_OFF,
    NOT_THE_LAYOUTS,
    attribute,
    held_to_trajectory,
    is_stable,
    steady,
    unsteady_reasons,
)
from sweeper.search.progress import Progress
from sweeper.search.propose.frontier import Frontier, layout_key
from sweeper.search.propose.ranked import Ranked
from sweeper.search.propose.study import LayoutStudy, Mode
from sweeper.search.run.capacity import CapacityWait
from sweeper.search.run.faults import Injection, injection_for
from sweeper.search.run.repeated import RepeatedFailure
from sweeper.search.run.scheduler import Running, Scheduler
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Host, Reservation
from sweeper.trial.reference import Trajectory, TrajectoryKey, trajectory_key

if TYPE_CHECKING:
    from sweeper.record.tracking import Tracker

# A failure that says nothing about the layout (decide.candidates.NOT_THE_LAYOUTS): Optuna is told nothing (FAIL);
# the layout runs again as a new attempt, up to these many attempts.
MAX_ATTEMPTS = {"infra": 3, "internal": 2}
# sweep.json is written with the sweep's progress (``spent``, the frontier's per-layout lists; ``save_progress``) at
# most every SAVE_EVERY_S, less often while a write would take over SAVE_SHARE of the driver's CPU since the last
# one (DeepSeek-V3's 1,024-GPU space: 38 MB, 4 s of CPU), but at least every SAVE_AT_LEAST_S; whole when a phase ends
# the sweep.
SAVE_EVERY_S = 30.0
SAVE_SHARE = 0.1
SAVE_AT_LEAST_S = 300.0


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


class SweepState:
    """One sweep's state, and the steps every phase takes with a trial."""

    def __init__(self, cfg: SweepConfig, options: SearchOptions, handle: Host, tracker: Tracker) -> None:
        self.cfg, self.options, self.handle, self.tracker = cfg, options, handle, tracker
        self.dir = SweepDir(options.out)
        self.max_trials = options.max_trials or cfg.search.max_trials
        self.records = self.dir.read_trials()
        self.stop = threading.Event()
        # How every phase waits for GPUs (the clock: a rehearsal's virtual one, else the machine's).
        self.capacity = CapacityWait(handle, self.stop, getattr(handle, "now", time.monotonic))
        self.scheduler = Scheduler(handle, self.parallel_cap(), self.capacity.never)
        self.t0 = self.scheduler.now()
        # The budget spent by the driver runs before this one (--resume): wall time, busy GPU-seconds, waits.
        before = self.dir.read_meta().spent or {}
        self.spent_before = {key: float(before.get(key, 0.0)) for key in ("wall_s", "gpu_s", "waited_s")}
        # When save_progress last wrote sweep.json (monotonic), the driver's CPU seconds then, and the write's CPU
        self._saved: tuple[float, float, float] | None = None
        self.counted = {r.number for r in self.records if r.phase == "explore" and r.attempt >= 1}
        self.resumed: dict[tuple[Any, ...], tuple[int, int]] = {}  # layout -> (number, attempt) running at a crash
        self.next_number = 1 + max((r.number for r in self.records), default=0)
        search = cfg.search
        confirm_runs = search.confirm_top * self.confirm_steps / cfg.training.steps
        self.progress = Progress(self.max_trials, search.objective, self.t0, confirm_runs, self.scheduler.now,
                                 modelled=options.rehearse, production_gpus=cfg.production_gpus)
        # A simulated cluster's ranks share this host's cores: the step-time model prices that (search.propose.refit).
        self.calibrator = Calibrator(cfg, options.out, host_cores=(os.cpu_count() or 1) if handle.simulated else None,
                                     shared=not options.rehearse)
        self.probe: Layout | None = None  # the calibration probe in flight (TPE mode)
        self.backfilled: list[int] = []  # trials started on free GPUs while a larger one waited for its own
        self.stopped_early: str | None = None
        self.repeated = RepeatedFailure()
        self.halted: str | None = None  # why the sweep stopped itself (a cause that is not transient)
        self.frontier = Frontier(cfg, handle, self.calibrator, self.records, self.scheduler.is_running)
        self.save_progress()  # the verdict lists of the space as the sweep starts
        skipped = self.frontier.unsupported
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
        # auto and ranked: the calibrated estimator's order with exploration (search.propose.ranked, issue 54).
        mode: Mode = ("ordered" if self.exhaustive else "random" if cfg.search.sampler == "random"
                      else "tpe" if cfg.search.sampler == "tpe" else "ranked")
        chooser = Ranked(cfg, self.calibrator.step) if mode == "ranked" else None
        self.study = LayoutStudy(cfg, self.dir.journal, mode, cfg.search.seed, self.frontier.order(), chooser)
        self.reference: str | None = None  # the equivalence gate's reference checkpoint (set by run.reference)
        # The reference layout's trajectory per batch a confirmation is held against (run.reference.ensure_trajectory;
        # None: it could not be made, the confirmation is not held).
        self.trajectories: dict[TrajectoryKey, Trajectory | None] = {}
        self.drifting: set[int] = set()  # trials injected with "drift" (--inject drift@trial=N)
        # What a phase does with an ended attempt of its own, after it is recorded (``wait_one``).
        self.ended_handlers: dict[Phase, Callable[[Running, TrialResult], None]] = {}

    def wall_s(self) -> float:
        """The sweep's wall time over all its driver runs (``search.wall_time_s``)."""
        return self.spent_before["wall_s"] + self.scheduler.now() - self.t0

    def gpu_s(self) -> float:
        """GPU-seconds the sweep's trials held over all its driver runs (``search.gpu_hours``)."""
        return self.spent_before["gpu_s"] + self.scheduler.busy_gpu_s

    def spent(self) -> dict[str, float]:
        """sweep.json's ``spent``: what the sweep has spent of its budget so far."""
        return {"wall_s": self.wall_s(), "gpu_s": self.gpu_s(),
                "waited_s": self.spent_before["waited_s"] + self.capacity.waited_s}

    def progress_meta(self) -> SweepMeta:
        """sweep.json as the sweep stands: the budget spent and the frontier's per-layout lists."""
        meta = self.dir.read_meta()
        meta.spent = self.spent()
        for key, entries in self.frontier.verdict_lists().items():
            setattr(meta, key, entries)
        return meta

    def save_progress(self) -> None:
        """sweep.json with the sweep's progress, at most every SAVE_EVERY_S and within SAVE_SHARE of the driver's
        CPU (written on every event it cost seconds on a 1,024-GPU space: the JSON of tens of thousands of pruned
        layouts, megabytes written), at least every SAVE_AT_LEAST_S. What a driver killed between two saves loses
        is that much of its budget's count and lists the frontier makes again from trials.jsonl on ``--resume``;
        the phases that end the sweep write it whole."""
        if self._saved is not None:
            at, cpu_then, cost = self._saved
            waited = time.monotonic() - at
            if waited < SAVE_EVERY_S or (waited < SAVE_AT_LEAST_S
                                         and time.process_time() - cpu_then < cost / SAVE_SHARE):
                return
        started = time.process_time()
        self.dir.write_meta(self.progress_meta())
        self._saved = (time.monotonic(), time.process_time(), time.process_time() - started)

    @property
    def launched(self) -> int:
        """Distinct explored trials launched so far (retries of a trial count once)."""
        return len(self.counted)

    def confirm_alone(self) -> bool:
        """search.confirm_alone, null meaning on GPU clusters (a simulated cluster's nodes are one machine)."""
        alone = self.cfg.search.confirm_alone
        return not self.handle.simulated if alone is None else alone

    @property
    def confirm_steps(self) -> int:
        return self.cfg.search.confirm_steps or 2 * self.cfg.training.steps

    def parallel_cap(self) -> int:
        cap = self.options.parallel or (self.cfg.search.parallel if self.cfg.search.parallel != "auto" else 0)
        return cap or 1_000_000

    def launch(self, layout: Layout, number: int, attempt: int, phase: Phase, proposal: Any,
                predicted: dict[str, Any] | None, slot: Reservation) -> None:
        first = phase == "explore" and number not in self.counted
        if phase == "explore":
            self.counted.add(number)
        inject = injection_for(self.options.injections, self.launched if first else -1)
        if inject == "drift" or number in self.drifting:  # a layout's own fault: every run of the trial has it
            self.drifting.add(number)
            inject = "drift"
        if inject == "node-join":
            console.print(f"[magenta]inject node-join[/]: node {self.handle.add_node()} added")
            inject = None
        if proposal is not None:  # lets a resumed sweep re-run this trial under its number if the driver dies now
            proposal.set_user_attr("sweeper_number", number)
            proposal.set_user_attr("attempt", attempt)
        run_id = self.tracker.start_trial(number, attempt, layout, phase, predicted)
        run = Running(number, attempt, phase, layout, proposal, predicted, run_id, now(), slot)
        steps = self.confirm_steps if phase == "confirm" else None
        self.scheduler.submit(run, cfg=self.cfg, layout=layout, trial_dir=self.dir.trial_dir(number, attempt, phase),
                              inject=inject, steps=steps, reference=self.reference,
                              routing_stress=phase == "confirm")  # finalists only (issue 17)
        console.print(f"[cyan]launch[/] #{number}.{attempt} {phase} {layout.short()} on {nodes_text(slot.labels)}"
                      + (f" [magenta](inject {inject})[/]" if inject else ""))
        self.print_progress(line=False)

    def wait_one(self) -> None:
        """Wait for a trial to end (a few seconds at most), record it, and hand it to its phase's handler."""
        ended = self.scheduler.wait_one()
        for run, result in ended:
            if self.record(run, result) and run.phase in self.ended_handlers:
                self.ended_handlers[run.phase](run, result)
        if not ended:
            self.print_progress(line=False)  # the live table's elapsed times move on; no line is printed

    def record(self, run: Running, result: TrialResult) -> bool:
        """Record an ended attempt (trials.jsonl, MLflow, the console, the estimator, the frontier); False when the
        sweep halts on it (a cause that is not transient: the phase leaves the layout open)."""
        if self.reference is None and result.passed and GATE_OFF not in result.notes:
            result.notes.append(GATE_OFF)  # nothing proved it computes the model: stable only if the YAML says so
        as_run = result  # the fault as the trial saw it: a cause repeated across layouts is not theirs (repeated)
        result = attribute(result, [r.result for r in self.records if r.number == run.number
                                    and r.phase == run.phase and r.attempt >= 1])
        if result is not as_run:
            console.print(f"[yellow]fault[/] #{run.number}.{run.attempt}: {result.notes[-1]}", important=True)
        if run.phase == "confirm":  # the whole run against the proven layout's, not only the gate's one step
            result = held_to_trajectory(result, self.trajectories.get(trajectory_key(self.cfg, run.layout)))
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
                   f"{m.tokens_per_s or 0:,.0f} tokens/s, peak {m.peak_memory_gib or 0:.2f} GiB "
                   f"{'modelled' if self.options.rehearse else 'measured'} on its {run.layout.world_size} GPUs")
        console.print(f"[{colour}]{result.status}[/] #{run.number}.{run.attempt} {run.layout.short()} {outcome}",
                      important=not result.passed)
        if run.phase == "confirm" and result.passed and not steady(result, self.cfg):
            why = "; ".join(unsteady_reasons(result, self.cfg))
            console.print(f"[yellow]unsteady[/] #{run.number}.{run.attempt} confirm: {why}: not confirmed",
                          important=True)
        for warning in result.placement_warnings:
            console.print(f"[yellow]placement[/] #{run.number}.{run.attempt}: {warning}"
                          + ("" if self.cfg.search.allow_cross_node_tp else
                             " (not stable: search.allow_cross_node_tp is false)"), important=True)
        update = self.calibrator.add(run.layout, Measured(
            passed=result.passed, step_time_s=m.step_time_s, peak_memory_gib=m.peak_memory_gib,
            peak_on_device=result.memory_kind == "device", moe_hot_rank_factor=m.moe_hot_rank_factor), run.number)
        for line in update.fit.lines() if update.fit else []:
            console.print(f"[blue]estimator[/] {line}")
        if update.warning:
            console.print(f"[yellow]estimator[/] {update.warning}", important=True)
        if self.frontier.learn(run.number, run.layout, result, update.changed):
            self.study.set_candidates(self.frontier.order())
        self.save_progress()
        self.print_progress()
        halt = None if self.stop.is_set() else self.repeated.add(layout_key(run.layout.to_dict()), run.attempt,
                                                                  as_run)
        if halt is not None:
            self.halted = halt
            console.print(f"[red]{halt}[/]", important=True)
            self.stop.set()  # running trials are cancelled and left open for --resume
            return False  # this layout too: its cause was not its own
        return True

    def outcome(self, result: TrialResult, layout: Layout) -> tuple[float | None, bool]:
        """What Optuna is told of an ended attempt: its objective (0 when not stable; None when the attempt said
        nothing about the layout) and whether its region is infeasible."""
        stable = is_stable(result, self.cfg)
        value = objective_value(result, self.cfg, layout, self.calibrator.current) if stable else 0.0
        infeasible = result.failure_kind in ("oom", "checkpoint_host_oom", "invalid_layout", "unsupported") or (
            result.passed and not is_stable(result, self.cfg))
        return None if result.failure_kind in NOT_THE_LAYOUTS else value, infeasible

    def recorded_outcome(self, attrs: dict[str, Any]) -> tuple[float | None, bool] | None:
        """A trial Optuna still holds as running whose attempt trials.jsonl already has (the driver died between
        recording it and telling Optuna): that outcome, or None when the attempt must run (again)."""
        number, attempt = attrs.get("sweeper_number"), attrs.get("attempt", 1)
        record = next((r for r in self.records if r.phase == "explore" and r.number == number
                       and r.attempt == attempt), None)
        if record is None or record.result.failure_kind in NOT_THE_LAYOUTS:
            return None
        return self.outcome(record.result, Layout.from_dict(record.layout))

    def print_progress(self, line: bool = True) -> None:
        """The progress summary and the running trials: the live table on a terminal; ``line``: also as a plain
        line otherwise (and in sweep.log)."""
        best = candidates(self.records, self.cfg, self.calibrator.current)
        lead = max(best, key=lambda c: c.figure(self.cfg)) if any(c.confirmations for c in best) else (
            best[0] if best else None)  # exploring: the best explored; confirming: the best figure (issue 53)
        top = (lead.layout.short(), lead.figure(self.cfg)) if lead is not None else None
        at_scale = lead.at_scale if lead is not None else None
        summary = self.progress.line(self.records, len(self.scheduler.in_flight), self.launched, top,
                                     others=self.scheduler.host.held_by_others(),
                                     waiting=bool(self.scheduler.waiting),
                                     at_scale_gpus=run_gpus(at_scale) if at_scale is not None else 0)
        running = [{"trial": f"{r.number}.{r.attempt}", "phase": r.phase, "layout": r.layout.short(),
                    "gpus": r.layout.world_size, "nodes": ",".join(r.slot.labels) if r.slot else "",
                    "elapsed_s": self.scheduler.now() - r.started} for r in self.scheduler.in_flight]
        console.progress(f"[dim]{summary}[/]", running, line=line)

    def record_pruned(self, entry: PlanEntry, reason: tuple[str, str], trial: Any,
                       number: int | None = None) -> None:
        text, kind = reason
        result = TrialResult.pruned(text, kind=kind)  # type: ignore[arg-type]
        record = TrialRecord(
            number=number or self.next_number, layout=entry.layout.to_dict(), result=result,
            predicted=predicted(entry), ended_at=now(), attempt=0,
        )
        if number is None:
            self.next_number += 1
        self.dir.append_trial(record)
        self.records.append(record)
        self.frontier.decide(entry.layout)
        # An infra refusal (capacity lost) says nothing about the layout: FAIL for Optuna, not a zero.
        self.study.tell(trial, None if kind == "infra" else 0.0, infeasible=kind != "infra")

    def cancel_all(self) -> None:
        self.scheduler.cancel_all()
        deadline = time.monotonic() + 120
        while self.scheduler.in_flight and time.monotonic() < deadline:
            self.wait_one()
        for run in self.scheduler.in_flight:
            if run.run_id is not None:
                self.tracker.kill_trial(run.run_id)

    def abandon(self) -> None:
        """A second Ctrl-C: the sweep stops without waiting for its trials (the caller's shutdown kills them). What
        was recorded stays; sweep.json and MLflow say the sweep was interrupted, and ``--resume`` continues it."""
        meta = self.progress_meta()
        meta.status, meta.ended_at = "interrupted", now()
        self.dir.write_meta(meta)
        self.tracker.kill_sweep()


def nodes_text(labels: list[str]) -> str:
    """The nodes a trial runs on, for one console line: named up to four, else counted (a 1,024-GPU trial's 128
    names are in its record and the live table)."""
    names = list(dict.fromkeys(labels))
    return ",".join(names) if len(names) <= 4 else f"{len(names)} nodes ({names[0]} ... {names[-1]})"


def predicted(entry: PlanEntry) -> dict[str, Any] | None:
    return entry.predicted.to_json() if entry.predicted else None
