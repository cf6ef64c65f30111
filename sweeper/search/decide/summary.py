"""What the sweep's parent MLflow run is given when the sweep ends: the winner's metrics and the sweep's counts,
a table of every trial attempt, and the files of the sweep folder a user compares runs by."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.export import LAUNCH_FILE, OVERRIDES_FILE
from sweeper.record.schema import TrialRecord
from sweeper.record.sweepdir import SweepDir
from sweeper.report.render import BEST_LAYOUT_FILE, REPORT_FILE, SWEEP_FILE, TRIALS_FILE
from sweeper.search.decide.candidates import Candidate
from sweeper.space.axes import SEARCHED
from sweeper.space.layout import Layout

# The sweep folder's files logged on the parent run.
FOLDER_ARTIFACTS = (BEST_LAYOUT_FILE, LAUNCH_FILE, OVERRIDES_FILE, REPORT_FILE, TRIALS_FILE, SWEEP_FILE)
METRIC_COLUMNS = ("tokens_per_s", "step_time_s", "tflops_per_gpu", "peak_memory_gib", "loss_last")


def space_params(cfg: SweepConfig) -> dict[str, Any]:
    """One parent-run parameter per searched axis, under its Megatron name (the child runs' and Optuna's name
    for it), valued with the list the space tries."""
    return {a.param: cfg.world_sizes if a.name == "gpus" else cfg.space.values(a.name)
            for a in SEARCHED}


def sweep_metrics(records: list[TrialRecord], winner: Candidate | None, cfg: SweepConfig,
                  scheduling_efficiency: float | None) -> dict[str, float]:
    """The winner's measured metrics under the child runs' names (so parent runs of several sweeps compare
    column by column), its figure on the production run (``Candidate.figure``), and the sweep's counts."""
    explore = [r for r in records if r.phase == "explore"]
    out: dict[str, float] = {
        "trials_launched": float(len({r.number for r in explore if r.attempt >= 1})),
        "trials_passed": float(len({r.number for r in explore if r.result.status == "passed"})),
        "trials_failed": float(len({r.number for r in explore if r.result.status == "failed"})),
        "layouts_pruned": float(len({r.number for r in explore if r.result.status == "pruned"})),
    }
    if scheduling_efficiency is not None:
        out["scheduling_efficiency"] = scheduling_efficiency
    if winner is not None:
        # The run whose figure chose the winner (its run at scale, else its median run), not the exploration alone.
        out.update({k: float(v) for k, v in vars(winner.figure_run(cfg).result.metrics).items() if v is not None})
        out[f"{cfg.search.objective}_median"] = statistics.median(winner.measured(cfg.search.objective))
        out[f"production_{cfg.search.objective}"] = winner.figure(cfg)
        out["best_trial"] = float(winner.number)
    return out


def trials_table(records: list[TrialRecord]) -> dict[str, list[Any]]:
    """Every recorded attempt, one column per field: number, attempt, phase, layout, the searched axes (Megatron
    names), status, failure kind, the measured and predicted metrics, the child run's id."""
    columns: dict[str, list[Any]] = {k: [] for k in (
        "trial", "attempt", "phase", "layout", *(a.param for a in SEARCHED), "status", "failure_kind",
        *METRIC_COLUMNS, "predicted_memory_gib", "predicted_tokens_per_s", "mlflow_run_id")}
    for rec in records:
        layout = Layout.from_dict(rec.layout)
        predicted = rec.predicted or {}
        row: dict[str, Any] = {
            "trial": rec.number, "attempt": rec.attempt, "phase": rec.phase, "layout": layout.short(),
            **{a.param: a.value(layout) for a in SEARCHED},
            "status": rec.result.status, "failure_kind": rec.result.failure_kind,
            **{k: getattr(rec.result.metrics, k) for k in METRIC_COLUMNS},
            "predicted_memory_gib": predicted.get("memory_gib"),
            "predicted_tokens_per_s": predicted.get("tokens_per_s"), "mlflow_run_id": rec.mlflow_run_id,
        }
        for key, value in row.items():
            columns[key].append(value)
    return columns


def folder_artifacts(folder: SweepDir) -> list[Path]:
    """The files logged on the parent run that exist: the search YAML the sweep ran, the winner's files, the
    report and the records."""
    names = (folder.space.name, *FOLDER_ARTIFACTS)
    return [folder.root / name for name in names if (folder.root / name).is_file()]
