"""The sweep's end: the winner chosen and exported, sweep.json, the report and the MLflow parent run written, the exit
code and the last lines on the console."""

from __future__ import annotations

from sweeper.errors import EXIT_FAILED, EXIT_OK
from sweeper.export import EXECUTABLE, export_files
from sweeper.report.render import render_report, report_figures
from sweeper.search.console import console
from sweeper.search.decide.best_layout import best_layout_document
from sweeper.search.decide.candidates import candidates, choose
from sweeper.search.decide.checkpoints import prune_checkpoints
from sweeper.search.decide.decision import decision, summary_line
from sweeper.search.decide.summary import folder_artifacts, sweep_metrics, trials_table
from sweeper.search.run.state import SweepState, now


def finish(sweep: SweepState, status: str) -> int:
    cands = candidates(sweep.records, sweep.cfg, sweep.calibrator.current)
    # Only a sweep that ran to its end has a winner: an interrupted or failed one has confirmed whatever happened to
    # run before it stopped (``--resume`` finishes it), so nothing is exported under the winner's name.
    winner = choose(cands, sweep.cfg, confirmed_only=sweep.cfg.search.confirm_top > 0) if status == "finished" else None
    meta = sweep.progress_meta()
    rehearsal = bool(meta.rehearsal)  # every output of a rehearsal says its figures were modelled (issue 54)
    if winner is not None:
        sweep.dir.write_best(best_layout_document(sweep.cfg, winner, sweep.tracker.tracking_uri, cands, rehearsal),
                            export_files(sweep.cfg, winner.layout, winner.number, rehearsal=rehearsal), EXECUTABLE)
    elapsed = sweep.scheduler.now() - sweep.t0
    gpus = sweep.handle.capacity_total() or 1
    meta.status, meta.ended_at = status, now()
    meta.best = None if winner is None else {
        "number": winner.number, "layout": winner.layout.short(),
        sweep.cfg.search.objective: winner.figure(sweep.cfg)}
    meta.scheduling_efficiency = sweep.scheduler.busy_gpu_s / (elapsed * gpus) if elapsed > 0 else None
    meta.stopped_early = sweep.halted or sweep.stopped_early
    meta.decision = decision(sweep.cfg, cands, winner, sweep.records, sweep.calibrator.current, rehearsal=rehearsal)
    meta.calibration = sweep.calibrator.report.lines() if sweep.calibrator.report else [
        "not calibrated: no trial measured device memory (the CPU backend measures host RSS)"]
    meta.step_time_fit = sweep.calibrator.step_time_fit()
    if status == "finished":  # an interrupted sweep may resume and choose another winner (issue 43)
        pruned = prune_checkpoints(sweep.records, sweep.cfg.training.keep_checkpoints,
                                   winner.number if winner is not None else None)
        meta.checkpoints = pruned.to_json()
        if (line := pruned.line()) is not None:
            console.print(line)
    sweep.dir.write_meta(meta)
    report = render_report(sweep.dir.root)
    if sweep.tracker.behind:
        sweep.tracker.catch_up(sweep.records)
    sweep.tracker.finish_sweep(
        {"interrupted": "KILLED", "failed": "FAILED"}.get(status, "FINISHED"),
        {"status": status, "best": winner.layout.short() if winner else "none"},
        metrics=sweep_metrics(sweep.records, winner, sweep.cfg, meta.scheduling_efficiency),
        table=trials_table(sweep.records),
        artifacts=folder_artifacts(sweep.dir),
        figures=report_figures(sweep.dir.root),
    )
    console.print(f"report: {report}", important=True)
    if (view := sweep.tracker.view_hint()) is not None:
        console.print(f"trials in MLflow: {view}", important=True)
    if sweep.halted is not None:
        console.print(f"[red]{sweep.halted}[/]", important=True)
        return EXIT_FAILED
    if status == "interrupted":
        waiting = sum(1 for c in cands if not c.confirmations)
        console.print("[yellow]interrupted[/]: no best_layout.yaml until the sweep ends"
                      + (f" ({waiting} stable layout(s) await their confirmation)" if waiting else "")
                      + "; `sweeper search --resume` continues it", important=True)
        return EXIT_FAILED
    if winner is None:
        console.print("[red]no stable layout passed[/] (see the report for why)", important=True)
        return EXIT_FAILED
    kind = " [magenta](modelled: a rehearsal, not measured)[/]" if rehearsal else ""
    console.print(f"[green]best stable layout[/]{kind}: {winner.layout.short()} -> {sweep.dir.best}", important=True)
    if (projected := summary_line(meta.decision)) is not None:
        console.print(projected, important=True)
    return EXIT_OK
