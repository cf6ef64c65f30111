"""MLflow tracking: one experiment per space, a parent run per sweep, a child run per trial attempt.

The only module that imports mlflow, and the driver is the only writer (ranks never talk to MLflow), so a
crashed rank cannot leave half-written runs. It uses ``MlflowClient`` with explicit run ids rather than
mlflow's global "active run", because several trials are in flight at once. With no tracking URI configured
MLflow's own default store in the working directory is used (``mlflow ui`` there shows it).

A tracking server that stops answering mid-sweep never stops the sweep (issue 34): the first failed call says so
once (``say``), the tracker falls behind and makes no further calls, and ``trials.jsonl`` stays the record. Each
time a trial ends the sweep asks ``catch_up`` with its records: once the server answers again, every record without
a finished child run (matched by its trial number, attempt and phase tags) gets one, exactly once, and the tracker
is up to date again; ``--resume`` does the same. MLflow's client would retry a dead server for minutes per call
(7 retries with exponential backoff, a 120 s timeout); the tracker lowers that, unless the environment sets it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from sweeper.errors import TrackingError
from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.space.axes import AXES
from sweeper.space.layout import Layout

LOG_TAIL_BYTES = 20_000
# MLflow's HTTP retry settings while a sweep logs: a dead server fails a call within about a minute (2 retries, 1 s
# backoff, 20 s timeout) instead of MLflow's four, and the sweep goes on without it. The environment's own win.
QUICK_FAILURE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
# How long a probe of a server that fell behind waits for it to accept a connection.
PROBE_TIMEOUT_S = 2.0
# What a call to a tracking server that went away raises: MLflow wraps requests' errors in MlflowException, and
# requests' own are OSErrors.
UNANSWERED = (MlflowException, OSError)
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit


TAG = "sweeper."  # the prefix of every tag sweeper sets (MLflow's own mlflow.* tags aside)


def tag(name: str) -> str:
    return f"{TAG}{name}"


# The experiment tag MLflow's UI reads to open an experiment on its runs rather than in the GenAI view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# MLflow's shared runs-table views: an experiment tag with this prefix and a key holds the view's state (JSON); the UI
# opens it at .../#/experiments/<id>/runs?viewStateShareKey=<key> (its "Share" button writes the same tag).
SHARED_VIEW_TAG = "mlflow.sharedViewState."
# The columns a comparison of a sweep's trials needs, beside each axis under its Megatron name.
VIEW_METRICS = ("tokens_per_s", "peak_memory_gib", "predicted_memory_gib", "step_time_s", "tflops_per_gpu")
VIEW_TAGS = ("status", "failure_kind", "phase")


def comparison_view(parent_run_id: str) -> dict[str, Any]:
    """The runs-table view of one sweep: its trials (the parent's children) fastest first, with the metrics, the
    status and failure kind and the layout axes as columns. Keys are MLflow's own view-state fields."""
    def column(kind: str, name: str) -> str:
        return f"{kind}.`{name}`"  # MLflow's column key: type, then the name in backquotes

    columns = [column("metrics", m) for m in VIEW_METRICS] + [column("tags", tag(t)) for t in VIEW_TAGS]
    columns += [column("params", a.megatron) for a in AXES if a.megatron and a.searched]
    return {"searchFilter": f"tags.mlflow.parentRunId = '{parent_run_id}'",
            "orderByKey": column("metrics", "tokens_per_s"), "orderByAsc": False, "selectedColumns": columns}


def comparison_view_url(ui_uri: str, experiment_id: str, parent_run_id: str) -> str:
    """Where MLflow's UI at ``ui_uri`` shows ``comparison_view`` (its "Model training" workflow, not GenAI's)."""
    return (f"{ui_uri.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={parent_run_id}"
            "&workflowType=machine_learning")


def public_uri(uri: str) -> str:
    """The tracking URI as sweeper records and prints it: without a user name or password written into it."""
    parts = urlsplit(uri)
    if not parts.netloc or "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def check_reachable(uri: str, timeout_s: float) -> None:
    """An http(s) tracking server must accept a connection within ``timeout_s`` (MLflow's own client retries for
    minutes, then raises a traceback); other stores are local. Raises TrackingError with one line."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = "no answer"
        raise TrackingError(f"tracking.mlflow_tracking_uri: no MLflow server answers at {public_uri(uri)}: "
                            f"{reason.lower()} (tracking.connect_timeout_s: {timeout_s:g})") from None


class Tracker:
    def __init__(self, tracking_uri: str | None, experiment: str, connect_timeout_s: float = 10.0,
                 say: Callable[[str], None] = print) -> None:
        for name, value in QUICK_FAILURE.items():
            os.environ.setdefault(name, value)
        self.say = say  # one line for the user (the sweep's console)
        self.experiment_name = experiment
        self.behind: str | None = None  # why the server is not being written to, while it is not
        self.client = MlflowClient(tracking_uri=tracking_uri)
        check_reachable(self.client.tracking_uri, connect_timeout_s)
        self.tracking_uri = public_uri(self.client.tracking_uri)  # recorded, printed, exported: no credentials
        try:
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            # MLflow 3 opens an experiment of no kind in its GenAI view (traces); this one holds training runs.
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        except MlflowException as exc:  # e.g. the server refuses the credentials, or is not an MLflow server
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TrackingError(f"tracking.mlflow_tracking_uri: MLflow at {self.tracking_uri} refused the sweep's "
                                f"experiment: {first}") from None
        self.experiment = experiment
        self.parent_run_id: str | None = None

    # -- a server that goes away ----------------------------------------------------------------------------------
    @contextmanager
    def _unless_behind(self) -> Iterator[bool]:
        """Runs the block's calls unless the tracker is behind (yields False then: skip them); a call the server
        does not answer puts it behind, said once, and the block's remaining calls are skipped."""
        if self.behind is not None:
            yield False
            return
        try:
            yield True
        except UNANSWERED as exc:
            self._fall_behind(exc)

    def _fall_behind(self, exc: BaseException) -> None:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        self.behind = first
        self.say(f"[yellow]tracking[/] MLflow at {self.tracking_uri} stopped answering ({first}): the sweep goes on, "
                 "every trial is kept in trials.jsonl, and MLflow is brought up to date when the server answers "
                 "again or on --resume")

    def catch_up(self, records: Sequence[TrialRecord]) -> int | None:
        """Bring a tracker that fell behind up to date from the sweep's records once the server answers again: a
        finished child run for every launched attempt that has none (exactly once: matched by the trial number,
        attempt and phase tags; one left RUNNING is finished). Returns how many it logged, None while the server
        still does not answer (or nothing was behind)."""
        if self.behind is None or self.parent_run_id is None:
            return None
        try:
            check_reachable(self.client.tracking_uri, PROBE_TIMEOUT_S)
        except TrackingError:
            return None
        try:
            logged = self._log_missing(records)
        except UNANSWERED as exc:  # it went away again: stay behind, quietly
            self.behind = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            return None
        self.behind = None
        self.say(f"[blue]tracking[/] MLflow at {self.tracking_uri} answers again: {logged} trial attempt(s) brought "
                 "up to date")
        return logged

    def log_missing(self, records: Sequence[TrialRecord]) -> int:
        """``--resume``: log the records a driver that died while behind could not (0 when none, or when the server
        does not answer; then the tracker is behind and ``catch_up`` tries again)."""
        with self._unless_behind() as up:
            if up:
                return self._log_missing(records)
        return 0

    def _log_missing(self, records: Sequence[TrialRecord]) -> int:
        assert self.parent_run_id is not None
        runs = self.client.search_runs([self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_run_id}'",
                                       max_results=50_000)
        by_key = {tuple(r.data.tags.get(tag(k)) for k in ("trial_number", "attempt", "phase")): r for r in runs}
        logged = 0
        for rec in records:
            if rec.attempt < 1:  # a layout refused before launching has no run
                continue
            run = by_key.get((str(rec.number), str(rec.attempt), rec.phase))
            if run is not None and run.info.status != "RUNNING":
                continue
            layout = Layout.from_dict(rec.layout)
            run_id = run.info.run_id if run is not None else self._start_trial_run(
                rec.number, rec.attempt, layout, rec.phase, rec.predicted)
            self._finish_trial_run(run_id, rec.result)
            logged += 1
        return logged

    # -- the sweep ------------------------------------------------------------------------------------------------
    def start_sweep(self, name: str, params: dict[str, Any], tags: dict[str, str], resume_run_id: str | None) -> str:
        """The parent run: ``params`` (one per axis, under the axes' Megatron names, and the sweep's settings),
        ``tags`` (prefixed ``sweeper.``) and MLflow's source tags (what ran it, sweeper's git commit)."""
        if resume_run_id is not None:
            self.parent_run_id = resume_run_id
            self.client.update_run(resume_run_id, status="RUNNING")
        else:
            all_tags = {tag("kind"): "sweep", **{tag(k): v for k, v in tags.items()}, **_source_tags()}
            run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
            self.parent_run_id = run.info.run_id
            self.client.log_batch(self.parent_run_id, params=[Param(k, _text(v)) for k, v in params.items()])
            self.client.set_experiment_tag(self.experiment_id, SHARED_VIEW_TAG + self.parent_run_id,
                                           json.dumps(comparison_view(self.parent_run_id)))
        return self.parent_run_id

    def view_hint(self) -> str | None:
        """Where to see this sweep's trials side by side (``comparison_view``): the page on a tracking server, or how
        to open it on a local store (``mlflow ui`` serves it at MLflow's default address)."""
        if self.parent_run_id is None:
            return None
        if self.tracking_uri.startswith(("http://", "https://")):
            return comparison_view_url(self.tracking_uri, self.experiment_id, self.parent_run_id)
        url = comparison_view_url("http://127.0.0.1:5000", self.experiment_id, self.parent_run_id)
        return f"mlflow ui --backend-store-uri {self.tracking_uri}, then {url}"

    def finish_sweep(self, status: str, summary: dict[str, Any], metrics: dict[str, float],
                     table: dict[str, list[Any]], artifacts: list[Path], figures: dict[str, Any]) -> None:
        """status: FINISHED | FAILED | KILLED (MLflow's run states). ``summary``: tags; ``metrics``: the winner's and
        the sweep's; ``table``: every trial attempt, column by column (``trials_table.json``, MLflow's table view);
        ``artifacts``: files of the sweep folder; ``figures``: plotly figures by artifact name (the report's)."""
        assert self.parent_run_id is not None
        run = self.parent_run_id
        with self._unless_behind() as up:
            if not up:
                self.say(f"[yellow]tracking[/] MLflow at {self.tracking_uri} is behind: the sweep's results are in "
                         "its folder; `sweeper search --resume` brings MLflow up to date once the server answers")
                return
            now = _now_ms()
            self.client.log_batch(run, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                                  tags=[RunTag(tag(k), _text(v)) for k, v in summary.items()])
            if any(table.values()):  # at least one row
                self.client.log_table(run, table, "trials_table.json")
            for path in artifacts:
                if path.is_file():
                    self.client.log_artifact(run, str(path))
            for name, figure in figures.items():
                self.client.log_figure(run, figure, f"figures/{name}.html")  # plotly: an interactive HTML page
            self.client.set_terminated(run, status=status)

    def close_orphans(self) -> list[str]:
        """Child runs still RUNNING, from a driver that died (on ``--resume``) or one stopping without waiting for its
        trials (``kill_sweep``): mark them KILLED (their trials are re-run on a resume)."""
        assert self.parent_run_id is not None
        closed: list[str] = []
        with self._unless_behind() as up:
            if up:
                runs = self.client.search_runs(
                    [self.experiment_id],
                    filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and attributes.status = 'RUNNING'",
                )
                for run in runs:
                    self.client.set_terminated(run.info.run_id, status="KILLED")
                    closed.append(run.info.run_id)
        return closed

    # -- trials ---------------------------------------------------------------------------------------------------
    def start_trial(
        self, number: int, attempt: int, layout: Layout, phase: str, predicted: dict[str, Any] | None
    ) -> str | None:
        """The trial attempt's child run (None while the tracker is behind: ``catch_up`` makes it later)."""
        with self._unless_behind() as up:
            if up:
                return self._start_trial_run(number, attempt, layout, phase, predicted)
        return None

    def _start_trial_run(
        self, number: int, attempt: int, layout: Layout, phase: str, predicted: dict[str, Any] | None
    ) -> str:
        assert self.parent_run_id is not None
        tags = {
            "mlflow.parentRunId": self.parent_run_id,
            tag("kind"): "trial",
            tag("layout"): layout.short(),
            tag("trial_number"): str(number),
            tag("attempt"): str(attempt),
            tag("phase"): phase,
        }
        run = self.client.create_run(self.experiment_id, run_name=f"{number}.{attempt} {layout.short()}", tags=tags)
        # Every axis under the name a Megatron user knows (TransformerConfig / Megatron-LM), from the axis table;
        # the Optuna study names its parameters the same way (search/study.py).
        params = [Param(a.megatron, _text(a.megatron_value(layout))) for a in AXES if a.megatron]
        params.append(Param("recompute_modules", ",".join(layout.recompute_modules) or "null"))
        metrics = []
        if predicted and predicted.get("memory_gib") is not None:
            metrics.append(Metric("predicted_memory_gib", float(predicted["memory_gib"]), _now_ms(), 0))
        if predicted and predicted.get("tokens_per_s") is not None:
            metrics.append(Metric("predicted_tokens_per_s", float(predicted["tokens_per_s"]), _now_ms(), 0))
        self.client.log_batch(run.info.run_id, params=params, metrics=metrics)
        return run.info.run_id

    def finish_trial(self, run_id: str | None, result: TrialResult, killed: bool = False) -> None:
        """Log the attempt's outcome on its child run (none: started while behind, ``catch_up`` logs it)."""
        if run_id is None:
            return
        with self._unless_behind() as up:
            if up:
                self._finish_trial_run(run_id, result, killed)

    def _finish_trial_run(self, run_id: str, result: TrialResult, killed: bool = False) -> None:
        now = _now_ms()
        metrics = [
            Metric(name, float(value), now, 0)
            for name, value in vars(result.metrics).items()
            if value is not None
        ]
        metrics += [Metric("loss", float(loss), now, step) for step, loss in enumerate(result.losses)]
        # The series behind the summary: each step's time (MLflow plots it against the step; its own key, so that
        # step_time_s stays the median the run is compared by) and each rank's peak memory (grouped under
        # peak_memory_gib/ in the UI).
        metrics += [Metric("step_time_per_step_s", float(t), now, step + 1)
                    for step, t in enumerate(result.step_times_s)]
        metrics += [Metric(f"peak_memory_gib/rank_{rank:03d}", float(gib), now, 0)
                    for rank, gib in enumerate(result.rank_peak_memory_gib) if gib is not None]
        # Routing stress per mode (issue 17), next to the normal peak in the UI.
        for mode, stress in (result.routing_stress or {}).items():
            metrics.append(Metric(f"stress_peak_memory_gib/{mode}", float(stress["peak_memory_gib"]), now, 0))
            if stress.get("hot_rank_factor") is not None:
                metrics.append(Metric(f"stress_hot_rank_factor/{mode}", float(stress["hot_rank_factor"]), now, 0))
        tags = [
            RunTag(tag("status"), result.status),
            RunTag(tag("failure_kind"), result.failure_kind or ""),
            RunTag(tag("backend"), result.backend),
            RunTag(tag("nodes"), ",".join(sorted(set(result.rank_nodes)))),
            RunTag(tag("memory_kind"), result.memory_kind or ""),
        ]
        if result.error:
            tags.append(RunTag(tag("error"), result.error[:4000]))
        if result.placement_warnings:
            tags.append(RunTag(tag("placement_warning"), "; ".join(result.placement_warnings)[:4000]))
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[start:start + MAX_METRICS_PER_BATCH],
                                  tags=tags if start == 0 else [])
        if not metrics:
            self.client.log_batch(run_id, tags=tags)
        self.client.log_text(run_id, json.dumps(result.to_json(), indent=2), "result.json")
        if result.placement:  # which node and GPU each rank of each Megatron group ran on
            self.client.log_dict(run_id, result.placement, "placement.json")
        if result.trial_dir:
            for log in sorted(Path(result.trial_dir).glob("rank_*.log")):
                self.client.log_text(run_id, _tail(log), f"logs/{log.name}")
        status = "KILLED" if killed else ("FINISHED" if result.status == "passed" else "FAILED")
        self.client.set_terminated(run_id, status=status)

    def kill_trial(self, run_id: str | None) -> None:
        if run_id is None:
            return
        with self._unless_behind() as up:
            if up:
                self.client.set_terminated(run_id, status="KILLED")

    def kill_sweep(self) -> None:
        """The sweep stops without finishing (a second Ctrl-C): its trial runs still RUNNING and the parent KILLED."""
        assert self.parent_run_id is not None
        self.close_orphans()
        with self._unless_behind() as up:
            if up:
                self.client.set_terminated(self.parent_run_id, status="KILLED")


def _source_tags() -> dict[str, str]:
    """MLflow's source tags for the parent run: the command, and sweeper's git commit when it runs from a
    checkout (``mlflow.source.git.commit``, shown by the UI next to the run)."""
    root = Path(__file__).resolve().parents[2]
    tags = {"mlflow.source.name": "sweeper search", "mlflow.source.type": "LOCAL", tag("version"): _version()}
    if not (root / ".git").exists():  # an installed copy, not a checkout
        return tags
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return tags
    return {**tags, "mlflow.source.git.commit": commit}


def _version() -> str:
    try:
        return importlib.metadata.version("sweeper")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
