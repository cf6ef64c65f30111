"""The MLflow experiment a sweep writes to opens on its runs (issue 32): MLflow 3 shows an experiment without a kind
in its GenAI view, so the Tracker tags it ``mlflow.experimentKind = custom_model_development``, also when the
experiment already existed. A real MLflow store (sqlite in the test's folder)."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from sweeper.record.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker


def test_the_sweeps_experiment_is_tagged_a_training_experiment(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    old = client.create_experiment("made-before")  # e.g. by an older sweeper or by hand
    for name in ("new-sweep", "made-before"):
        tracker = Tracker(uri, name)
        tags = client.get_experiment(tracker.experiment_id).tags
        assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    assert Tracker(uri, "made-before").experiment_id == old
