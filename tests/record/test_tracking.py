"""The MLflow experiment a sweep writes to opens on its runs (issue 32): MLflow 3 shows an experiment without a kind
in its GenAI view, so the Tracker tags it ``mlflow.experimentKind = custom_model_development``, also when the
experiment already existed. A real MLflow store (sqlite in the test's folder)."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from sweeper.record.schema import TrialMetrics, TrialResult
from sweeper.record.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, SHARED_VIEW_TAG, Tracker
from sweeper.space.layout import Layout


def test_the_sweeps_experiment_is_tagged_a_training_experiment(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    old = client.create_experiment("made-before")  # e.g. by an older sweeper or by hand
    for name in ("new-sweep", "made-before"):
        tracker = Tracker(uri, name)
        tags = client.get_experiment(tracker.experiment_id).tags
        assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert Tracker(uri, "made-before").experiment_id == old


def test_each_sweep_shares_a_runs_view_of_its_trials_fastest_first(tmp_path: Path) -> None:
    """MLflow's shared view (the tag its UI's "Share" button writes): the sweep's trials, not other sweeps' runs,
    with tokens/s, memory, status and failure kind and the axes as columns. Its filter is run through MLflow's own
    search here, so a filter MLflow cannot parse or that lists the wrong runs fails."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    tracker = Tracker(uri, "sweep")
    parent = tracker.start_sweep("sweep", {}, {}, None)
    for number, tps in ((1, 900.0), (2, 1500.0)):
        run = tracker.start_trial(number, 1, Layout(world_size=2, tp=2), "explore", None)
        tracker.finish_trial(run, TrialResult(status="passed", metrics=TrialMetrics(tokens_per_s=tps)))
    Tracker(uri, "sweep").start_sweep("another sweep", {}, {}, None)  # its runs stay out of the first one's view
    view = json.loads(client.get_experiment(tracker.experiment_id).tags[SHARED_VIEW_TAG + parent])
    assert {"metrics.`tokens_per_s`", "metrics.`peak_memory_gib`", "tags.`sweeper.status`",
            "tags.`sweeper.failure_kind`", "params.`tensor_model_parallel_size`"} <= set(view["selectedColumns"])
    runs = client.search_runs([tracker.experiment_id], filter_string=view["searchFilter"],
                              order_by=["metrics.tokens_per_s DESC"])
    assert [r.data.metrics["tokens_per_s"] for r in runs] == [1500.0, 900.0]
    assert view["orderByKey"] == "metrics.`tokens_per_s`" and view["orderByAsc"] is False
    assert tracker.view_hint() == (
        f"mlflow ui --backend-store-uri {uri}, then http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}/runs"
        f"?viewStateShareKey={parent}&workflowType=machine_learning")


def test_a_uris_credentials_are_never_recorded() -> None:
    """What sweeper records and prints of the tracking URI (sweep.json, best_layout.yaml, the report, the console)
    is Tracker.tracking_uri: a user name and password written into the URI are dropped."""
    from sweeper.record.tracking import public_uri

    assert public_uri("https://alice:s3cret@mlflow.example/tracking") == "https://mlflow.example/tracking"
    assert public_uri("http://token@127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert public_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert public_uri("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
