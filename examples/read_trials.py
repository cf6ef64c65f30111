"""Read a sweep folder into a pandas DataFrame: one row per trial attempt, one column per layout axis.

    python examples/read_trials.py sweeps/quickstart
    python examples/read_trials.py sweeps/quickstart --csv trials.csv

Reads `trials.jsonl` and `sweep.json` through sweeper's own reader (sweeper/record/sweepdir.py), which skips a torn
last line and keys a newer sweeper wrote, so the columns are TrialRecord / TrialResult / TrialMetrics fields
(sweeper/record/schema.py). Prints the passed layouts by throughput and the failures grouped by kind.
pandas comes with MLflow, which sweeper depends on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from sweeper.record.schema import SweepMeta, TrialRecord
from sweeper.record.sweepdir import SweepDir, read_trials
from sweeper.space.axes import CONTRACT_KEYS

# The layout axes as the contract's layout object names them, with the world size first.
LAYOUT_COLUMNS: tuple[str, ...] = ("gpus", *CONTRACT_KEYS)
METRIC_COLUMNS: tuple[str, ...] = ("tokens_per_s", "tflops_per_gpu", "step_time_s", "peak_memory_gib")


def record_row(record: TrialRecord) -> dict[str, Any]:
    """One trial attempt as a flat row: layout axes, outcome, measured metrics and the predicted memory."""
    result, metrics = record.result, record.result.metrics
    row: dict[str, Any] = {"number": record.number, "attempt": record.attempt, "phase": record.phase}
    row.update({key: record.layout.get(key) for key in LAYOUT_COLUMNS})
    row.update(status=result.status, failure_kind=result.failure_kind)
    row.update({key: getattr(metrics, key) for key in METRIC_COLUMNS})
    row.update(predicted_memory_gib=record.predicted_memory_gib, backend=result.backend, error=result.error)
    return row


def trials_frame(records: list[TrialRecord]) -> pd.DataFrame:
    columns = ["number", "attempt", "phase", *LAYOUT_COLUMNS, "status", "failure_kind", *METRIC_COLUMNS,
               "predicted_memory_gib", "backend", "error"]
    return pd.DataFrame([record_row(r) for r in records], columns=columns)


def print_summary(meta: SweepMeta, df: pd.DataFrame, skipped: int) -> None:
    memory = {"host": "host RSS (CPU backend)", "device": "device reserved"}.get(meta.memory_kind or "", "unknown")
    print(f"sweep {meta.name or '?'}: status {meta.status or '?'}, {len(df)} trial records"
          + (f" ({skipped} unreadable lines skipped)" if skipped else "") + f"; peak memory is {memory}")
    if meta.best:
        print(f"best: {meta.best}")
    shown = ["number", "attempt", "phase", *LAYOUT_COLUMNS, *METRIC_COLUMNS, "predicted_memory_gib"]

    passed = df[df["status"] == "passed"].sort_values("tokens_per_s", ascending=False)
    print(f"\npassed ({len(passed)}), fastest first:")
    if not passed.empty:
        print(passed[shown].to_string(index=False))

    failed = df[df["status"] != "passed"]
    print(f"\nnot passed ({len(failed)}), by status and failure kind:")
    if not failed.empty:
        groups = failed.fillna({"failure_kind": "-"}).groupby(["status", "failure_kind"], sort=True)
        summary = groups.agg(trials=("number", "count"), first_error=("error", "first"))
        summary["first_error"] = summary["first_error"].fillna("").str.slice(0, 100)
        print(summary.to_string())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("sweep_dir", type=Path, help="a sweep folder, e.g. sweeps/quickstart")
    parser.add_argument("--csv", type=Path, help="also write the whole table to this CSV file")
    args = parser.parse_args(argv)
    sweep = SweepDir(args.sweep_dir)
    if not sweep.trials.is_file():
        print(f"error: {args.sweep_dir}: not a sweep folder (no trials.jsonl)", file=sys.stderr)
        return 2
    records, skipped = read_trials(sweep.trials)  # sweep.read_trials() does the same without the skipped count
    df = trials_frame(records)
    print_summary(sweep.read_meta(), df, skipped)
    if args.csv is not None:
        df.to_csv(args.csv, index=False)
        print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
