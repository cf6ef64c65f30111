"""MLflow tracking: one experiment per space, a parent run per sweep, a child run per trial attempt.

The only module that imports mlflow, and the driver is the only writer (ranks never talk to MLflow), so a
crashed rank cannot leave half-written runs. It uses ``MlflowClient`` with explicit run ids rather than
mlflow's global "active run", because several trials are in flight at once. With no tracking URI configured
MLflow's own default store in the working directory is used (``mlflow ui`` there shows it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from sweeper.record.schema import TrialResult
from sweeper.space.axes import AXES
from sweeper.space.layout import Layout

LOG_TAIL_BYTES = 20_000


class Tracker:
    def __init__(self, tracking_uri: str | None, experiment: str) -> None:
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = self.client.tracking_uri
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.experiment = experiment
        self.parent_run_id: str | None = None

    # -- the sweep ------------------------------------------------------------------------------------------------
    def start_sweep(self, name: str, params: dict[str, Any], tags: dict[str, str], resume_run_id: str | None) -> str:
        if resume_run_id is not None:
            self.parent_run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=name, tags={"sweeper.kind": "sweep", **tags})
            self.parent_run_id = run.info.run_id
            self.client.log_batch(self.parent_run_id, params=[Param(k, _text(v)) for k, v in params.items()])
        return self.parent_run_id

    def finish_sweep(self, status: str, summary: dict[str, Any]) -> None:
        """status: FINISHED | FAILED | KILLED (MLflow's run states)."""
        assert self.parent_run_id is not None
        tags = [RunTag(f"sweep.{k}", _text(v)) for k, v in summary.items()]
        self.client.log_batch(self.parent_run_id, tags=tags)
        self.client.set_terminated(self.parent_run_id, status=status)

    def close_orphans(self) -> list[str]:
        """Child runs still RUNNING from a driver that died: mark them KILLED (their trials are re-run)."""
        assert self.parent_run_id is not None
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and attributes.status = 'RUNNING'",
        )
        for run in runs:
            self.client.set_terminated(run.info.run_id, status="KILLED")
        return [run.info.run_id for run in runs]

    # -- trials ---------------------------------------------------------------------------------------------------
    def start_trial(
        self, number: int, attempt: int, layout: Layout, phase: str, predicted: dict[str, Any] | None
    ) -> str:
        assert self.parent_run_id is not None
        tags = {
            "mlflow.parentRunId": self.parent_run_id,
            "layout": layout.short(),
            "trial_number": str(number),
            "attempt": str(attempt),
            "phase": phase,
            "sweeper.kind": "trial",
        }
        run = self.client.create_run(self.experiment_id, run_name=f"{number}.{attempt} {layout.short()}", tags=tags)
        # Every axis under the name a Megatron user knows (TransformerConfig / Megatron-LM), from the axis table.
        params = [Param(a.megatron, _text(a.megatron_value(layout))) for a in AXES if a.megatron]
        params.append(Param("recompute_modules", ",".join(layout.recompute_modules) or "null"))
        metrics = []
        if predicted and predicted.get("memory_gib") is not None:
            metrics.append(Metric("predicted_memory_gib", float(predicted["memory_gib"]), _now_ms(), 0))
        if predicted and predicted.get("tokens_per_s") is not None:
            metrics.append(Metric("predicted_tokens_per_s", float(predicted["tokens_per_s"]), _now_ms(), 0))
        self.client.log_batch(run.info.run_id, params=params, metrics=metrics)
        return run.info.run_id

    def finish_trial(self, run_id: str, result: TrialResult, killed: bool = False) -> None:
        now = _now_ms()
        metrics = [
            Metric(name, float(value), now, 0)
            for name, value in vars(result.metrics).items()
            if value is not None
        ]
        metrics += [Metric("loss", float(loss), now, step) for step, loss in enumerate(result.losses)]
        tags = [
            RunTag("status", result.status),
            RunTag("failure_kind", result.failure_kind or ""),
            RunTag("backend", result.backend),
            RunTag("nodes", ",".join(sorted(set(result.rank_nodes)))),
            RunTag("memory_kind", result.memory_kind or ""),
        ]
        if result.error:
            tags.append(RunTag("error", result.error[:4000]))
        self.client.log_batch(run_id, metrics=metrics, tags=tags)
        self.client.log_text(run_id, json.dumps(result.to_json(), indent=2), "result.json")
        if result.trial_dir:
            for log in sorted(Path(result.trial_dir).glob("rank_*.log")):
                self.client.log_text(run_id, _tail(log), f"logs/{log.name}")
        status = "KILLED" if killed else ("FINISHED" if result.status == "passed" else "FAILED")
        self.client.set_terminated(run_id, status=status)

    def kill_trial(self, run_id: str) -> None:
        self.client.set_terminated(run_id, status="KILLED")


def _tail(path: Path) -> str:
    with path.open("rb") as fh:
        fh.seek(0, 2)
        size = fh.tell()
        fh.seek(max(0, size - LOG_TAIL_BYTES))
        return fh.read().decode("utf-8", errors="replace")


def _text(value: Any) -> str:
    return "null" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))


def _now_ms() -> int:
    return int(time.time() * 1000)
