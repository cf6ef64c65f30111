"""`sweeper search`: the command around the sweep loop. It refuses bad input before anything is written, holds the
sweep folder's driver lock for the whole sweep (issue 43), opens the cluster and the MLflow parent run, records what
the sweep runs on in sweep.json, and lets SIGINT / SIGTERM stop launches (a second one stops waiting) while the loop
(``search.run.sweep.Sweep``) winds down and exports."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from sweeper.config.files import write_atomic
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.errors import EXIT_FAILED, LayoutError, UsageError
from sweeper.models.proxy import is_proxy
from sweeper.record.lock import DriverLock
from sweeper.record.schema import is_rehearsal
from sweeper.record.sweepdir import SET_HEADER, SweepDir
from sweeper.search.console import console, quiet_libraries, sweep_log
from sweeper.search.decide.summary import space_params
from sweeper.search.run.sweep import SearchOptions, Sweep, now

if TYPE_CHECKING:
    from sweeper.record.tracking import Tracker


def run_search(cfg: SweepConfig, options: SearchOptions) -> int:
    """The `search` command: exit 0 with a stable layout, 1 without one, 2 on bad input (raised as UsageError)."""
    sweep_dir = SweepDir(options.out)
    if sweep_dir.exists() and not options.resume:
        raise UsageError(
            f"--out: {options.out} already holds a sweep; pass --resume to continue it or choose another --out")
    if options.resume and not sweep_dir.exists():
        raise UsageError(f"--resume: {options.out} holds no sweep to resume")
    if options.resume:
        refuse_other_kind(sweep_dir, options)
    for i, text in enumerate(cfg.search.seeds):  # bad seeds are bad input: refused before anything is written
        try:
            layout_from_string(cfg, text)
        except LayoutError as exc:
            raise UsageError(f"search.seeds[{i}]: {exc}".replace("--layout: ", "")) from None
    # One driver per folder (issue 43), taken before anything is written to it; a second driver is refused here.
    with DriverLock(sweep_dir.lock, say=lambda line: console.print(f"[yellow]{escape(line)}[/]", important=True)):
        # Deferred: MLflow and Ray load only once the input is known good (bad input exits in a fraction of a second).
        from sweeper.record.tracking import Tracker

        quiet_libraries()  # MLflow's store migration lines are not sweeper's to show
        experiment = f"{cfg.experiment_name}-rehearsal" if options.rehearse else cfg.experiment_name
        tracker = Tracker(cfg.tracking.mlflow_tracking_uri, experiment,  # creates the store first
                          cfg.tracking.connect_timeout_s, say=lambda line: console.print(line, important=True))
        sweep_dir.create()
        if options.space is not None and not options.resume:
            header = "".join(f"{SET_HEADER}{item}\n" for item in options.overrides)
            write_atomic(sweep_dir.space, header + options.space.read_text())
        with sweep_log(sweep_dir.root, options.verbosity, options.display):
            return _run(cfg, options, sweep_dir, tracker)


def refuse_other_kind(sweep_dir: SweepDir, options: SearchOptions) -> None:
    """A rehearsal resumes only a rehearsal's folder and a sweep only a sweep's: their modelled and measured records
    would otherwise mix in trials.jsonl, the Optuna journal and the winner's checkpoints (issue 54)."""
    folder_rehearsed = is_rehearsal(sweep_dir.read_meta(), sweep_dir.read_trials())
    if folder_rehearsed is None or folder_rehearsed == options.rehearse:
        return
    if options.rehearse:
        raise UsageError(f"--resume: {options.out} holds a sweep that ran trials; a rehearsal (--rehearse) resumes "
                         "only a rehearsal's folder: choose another --out")
    raise UsageError(f"--resume: {options.out} holds a rehearsal (modelled trials); resume it with --rehearse, or "
                     "run the sweep in another --out")


def _host(cfg: SweepConfig, options: SearchOptions) -> contextlib.AbstractContextManager[Any]:
    """The cluster the sweep runs on: the real (or simulated) one, or a rehearsal's modelled one."""
    if options.rehearse:
        from sweeper.trial.rehearsal import Faults, RehearsalHost

        return contextlib.nullcontext(RehearsalHost(cfg, Faults.parse(options.rehearse_faults), cfg.search.seed))
    from sweeper.trial.host import open_host

    return open_host(cfg, options.address)


def _run(cfg: SweepConfig, options: SearchOptions, sweep_dir: SweepDir, tracker: Tracker) -> int:
    meta = sweep_dir.read_meta()
    with _host(cfg, options) as handle:
        doctor = handle.doctor(cfg, sweep_dir.root)
        for warning in doctor.warnings:
            console.print(f"[yellow]doctor[/] {warning}", important=True)
        if not doctor.ok:
            console.print("[red]doctor: nodes disagree[/]: " + "; ".join(doctor.problems), important=True)
            return EXIT_FAILED
        parent = tracker.start_sweep(
            cfg.name, _sweep_params(cfg), {"estimator": "sweeper.estimate", "backend": handle.backend_name,
                                           "proxy": str(is_proxy(cfg.model)).lower(),
                                           "rehearsal": str(options.rehearse).lower()},
            resume_run_id=(meta.mlflow or {}).get("parent_run_id") if options.resume else None,
        )
        meta.name, meta.model, meta.cluster = cfg.name, cfg.model.model_dump(), cfg.cluster.model_dump()
        meta.memory_headroom, meta.objective, meta.status = cfg.search.memory_headroom, cfg.search.objective, "running"
        meta.started_at = meta.started_at or now()
        meta.rehearsal = options.rehearse
        meta.memory_kind = "host" if handle.simulated else "device"
        meta.mlflow = {"tracking_uri": tracker.tracking_uri, "experiment": tracker.experiment_name,
                       "experiment_id": tracker.experiment_id, "parent_run_id": parent}
        sweep_dir.write_meta(meta)
        sweep = Sweep(cfg, options, handle, tracker)
        previous = _install_signal_handlers(sweep.stop)
        try:
            code = sweep.run()
            if options.rehearse:
                _rehearsal_summary(cfg, sweep, handle, sweep_dir)
            return code
        except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM): no more waiting, but the records say so
            sweep.abandon()
            raise
        finally:
            _restore_signal_handlers(previous)
            sweep.scheduler.shutdown()


def _rehearsal_summary(cfg: SweepConfig, sweep: Sweep, host: Any, sweep_dir: SweepDir) -> None:
    """rehearsal.json beside the sweep's records, and its figures in a few lines."""
    import json

    from sweeper.search.decide.rehearsal import summary

    figures = summary(host, sweep.records, cfg, [e.layout for e in sweep.frontier.launchable],
                      sweep.frontier.valid_layouts)
    write_atomic(sweep_dir.root / "rehearsal.json", json.dumps(figures, indent=1) + "\n")
    reached = figures["trials_to_within_noise_of_best"]
    low, high = figures["band"]["p10"], figures["band"]["p90"]
    console.print(
        f"[magenta]rehearsal[/] (modelled, not measured) {figures['trials']} trials ({figures['runs']} runs), "
        f"{figures['wall_time_h']:.1f} h wall ({low['wall_time_h']:.1f}-{high['wall_time_h']:.1f} h over the "
        f"level's p10-p90), {figures['busy_gpu_hours']:,.0f} GPU-hours busy "
        f"({low['busy_gpu_hours']:,.0f}-{high['busy_gpu_hours']:,.0f}), {figures['reserved_gpu_hours']:,.0f} "
        f"reserved ({low['reserved_gpu_hours']:,.0f}-{high['reserved_gpu_hours']:,.0f}: the cluster for the "
        f"wall time), at most {figures['peak_concurrent_trials']} trials at once, peak disk "
        f"{figures['peak_disk_gib']:,.0f} GiB; "
        + (f"a layout within the noise of the best of {figures['valid_layouts']:,} valid layouts after {reached} "
           "trials (optimistic: the truth is the estimator's own terms)" if reached else
           f"no trial reached the noise of the best of {figures['valid_layouts']:,} valid layouts")
        + f": {sweep_dir.root / 'rehearsal.json'}", important=True)


def _sweep_params(cfg: SweepConfig) -> dict[str, Any]:
    c = cfg.cluster
    return {
        "model": cfg.model.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
        "gpu_memory_gib": c.gpu_memory_gib, "compute_capability": c.compute_capability,
        "seq_length": cfg.training.seq_length, "global_batch_size": cfg.training.global_batch_size,
        "steps": cfg.training.steps, **space_params(cfg),
        "max_trials": cfg.search.max_trials, "objective": cfg.search.objective,
        "memory_headroom": cfg.search.memory_headroom,
    }


def _install_signal_handlers(stop: threading.Event) -> dict[int, Any]:
    def handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for trials to wind down
        console.print(f"[yellow]{signal.Signals(signum).name}: stopping launches, cancelling running trials[/]",
                      important=True)
        stop.set()

    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
