"""End to end: `python -m sweeper search search_spaces/quickstart.yaml` on a simulated 2-node x 2-GPU Ray cluster,
every trial real megatron-core on CPU (gloo), MLflow's default store in the working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from sweeper.config.load import load_config
from sweeper.plan.rules import check
from sweeper.space.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
MAX_TRIALS = 4


def _overlapping(records: list[dict]) -> bool:
    spans = sorted((datetime.fromisoformat(r["started_at"]), datetime.fromisoformat(r["ended_at"])) for r in records)
    return any(b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_quickstart_search_end_to_end(tmp_path: Path) -> None:
    space = ROOT / "search_spaces" / "quickstart.yaml"
    cfg = load_config(space)
    started = time.monotonic()
    proc = subprocess.run(
        # 4 of the quickstart's 8 trials keep the suite short; the two seeds still share the cluster.
        [sys.executable, "-m", "sweeper", "search", str(space), "--out", "sweep", "--max-trials", str(MAX_TRIALS),
         "--set", "budget.tokens=1e9", "--set", "budget.gpu_hour_usd=2.5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert elapsed < 600, f"quickstart sweep took {elapsed:.0f} s"

    out = tmp_path / "sweep"
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    launched = [r for r in records if r["result"]["status"] != "pruned"]
    assert len({r["number"] for r in launched if r["phase"] == "explore"}) == MAX_TRIALS

    # Nothing the rules reject or the estimator predicts over budget was launched.
    for r in launched:
        layout = Layout.from_dict(r["layout"])
        assert check(cfg.model, layout, cfg.cluster, cfg.training.seq_length) == []
        assert r["predicted"]["fits"] is True
    assert _overlapping(launched), "no two trials ran at the same time"

    # MLflow: one parent run, one child per launched attempt, with the contract's fields.
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(cfg.name)
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("sweeper.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == len(launched)
    for child in children:
        assert {"tensor_model_parallel_size", "expert_model_parallel_size", "micro_batch_size"} <= set(child.data.params)
        assert {"sweeper.status", "sweeper.backend", "sweeper.nodes", "sweeper.layout"} <= set(child.data.tags)
        assert "predicted_memory_gib" in child.data.metrics
    passed = [c for c in children if c.data.tags["sweeper.status"] == "passed"]
    assert passed and all({"tokens_per_s", "peak_memory_gib", "step_time_s"} <= set(c.data.metrics) for c in passed)
    # The series behind the summary: every step's time, every rank's peak memory.
    one = next(c for c in passed if c.data.tags["sweeper.phase"] == "explore")
    world = int(one.data.params["world_size"])
    assert len(client.get_metric_history(one.info.run_id, "step_time_per_step_s")) == cfg.training.steps
    assert len(client.get_metric_history(one.info.run_id, "step_time_s")) == 1  # the median, compared by
    assert {f"peak_memory_gib/rank_{r:03d}" for r in range(world)} <= set(one.data.metrics)
    # The parent run: the winner's metrics, one parameter per axis (the same names), the folder's files, a table.
    parent = client.get_run(parents[0].info.run_id)
    assert {"tokens_per_s", "trials_launched", "best_trial"} <= set(parent.data.metrics)
    assert parent.data.params["tensor_model_parallel_size"] == str(cfg.space.values("tp"))
    assert parent.data.tags["sweeper.status"] == "finished" and "mlflow.source.git.commit" in parent.data.tags
    logged = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"space.yaml", "best_layout.yaml", "launch_megatron_lm.sh", "megatron_bridge_overrides.yaml",
            "report.html", "trials.jsonl", "sweep.json", "trials_table.json", "figures"} <= logged
    figures = {a.path for a in client.list_artifacts(parent.info.run_id, "figures")}
    assert "figures/throughput_vs_memory.html" in figures and "figures/predicted_vs_measured.html" not in figures

    # The exported winner is a stable trial that passed its confirmation run, and the report exists.
    best = yaml.safe_load((out / "best_layout.yaml").read_text())
    winner = [r for r in launched if r["number"] == best["trial"]]
    assert {r["phase"] for r in winner} == {"explore", "confirm"}
    assert all(r["result"]["status"] == "passed" for r in winner)
    assert best["megatron_args"] and best["megatron_bridge_overrides"]
    # Issue 17: every passed trial timed its checkpoint and measured the host memory its save held; each loaded
    # the reference resharded, so the winner is among the layouts a checkpoint moves into; a confirmation of an
    # EP > 1 layout ran the routing stress, and only those did.
    for r in launched:
        if r["result"]["status"] == "passed":
            m = r["result"]["metrics"]
            assert m["checkpoint_save_s"] > 0 and m["checkpoint_load_s"] > 0 and m["checkpoint_save_host_gib"] > 0
            assert r["result"]["reference_load"]["tensors"] > 0
            stressed = r["phase"] == "confirm" and r["layout"]["ep"] > 1
            assert (r["result"]["routing_stress"] is not None) == stressed
            assert (m["stress_peak_memory_gib"] is not None) == stressed
    assert Layout.from_dict(best["layout"]).short() in best["checkpoint_moves_to"]["layouts"]
    assert (out / "report.html").stat().st_size > 10_000
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["status"] == "finished"
    # Issue 18: the decision names the winner first, projects the budget from the estimator's GPU prediction (a CPU
    # sweep measured the CPU) and says why; the report shows it.
    first = meta["decision"]["layouts"][0]
    assert first["number"] == best["trial"] and first["role"] == "winner"
    assert first["tokens_per_s"]["basis"].startswith("predicted") and first["projection"]["cost_usd"] > 0
    assert first["why"].startswith(Layout.from_dict(best["layout"]).short())
    assert "Decision: time and cost to train" in (out / "report.html").read_text()


def test_a_moe_knob_space_sweeps_on_the_cpu_and_lists_what_it_cannot_run(tmp_path: Path) -> None:
    """Issue 18: search_spaces/moe_knobs.yaml on the simulated cluster. Its two seeds run the alltoall and the
    allgather dispatcher for real; flex dispatch, the A2A overlap and activation offload are listed with the CPU
    backend's reason and never launched; the decision projects the YAML's budget."""
    proc = subprocess.run(
        [sys.executable, "-m", "sweeper", "search", str(ROOT / "search_spaces" / "moe_knobs.yaml"), "--out", "sweep",
         "--max-trials", "2", "--set", "search.confirm_top=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "sweep"
    records = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    ran = {r["layout"].get("moe_token_dispatcher"): r["result"] for r in records}
    assert set(ran) == {"alltoall", "allgather"} and all(r["status"] == "passed" for r in ran.values())
    assert all(r["checks"]["equivalence_rel_err"] is not None for r in ran.values())
    meta = json.loads((out / "sweep.json").read_text())
    reasons = " ".join(u["reason"] for u in meta["unsupported"])
    for knob in ("moe_token_dispatcher flex:deepep", "moe_a2a_overlap", "offload_layers 1"):
        assert f"{knob}" in reasons and "unsupported on this backend (megatron-core-cpu)" in reasons
    assert not any(r["layout"].get("offload_layers") or r["layout"].get("moe_a2a_overlap") for r in records)
    projection = meta["decision"]["layouts"][0]["projection"]
    assert projection["gpus"] == 1024 and projection["cost_usd"] > 0
    best = yaml.safe_load((out / "best_layout.yaml").read_text())
    assert any(a.startswith("--moe-token-dispatcher-type=") for a in best["megatron_args"])
