"""The confirmation watches its whole run (issue 53): a real sweep (`python -m sweeper search`, simulated Ray
cluster, real megatron-core on CPU) where one layout carries a slow numerical fault (``--inject drift@trial=N``: one
rank's gradient scaled by 5% from step 3 on). The equivalence gate, one forward/backward before the steps, passes
it; its confirmation, held against the reference layout's loss and gradient-norm trajectory, fails naming step 3,
while the clean layout's confirmation stays within the FP32 band."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sweeper.backends.megatron.smoke import DRIFT_FROM_STEP
from sweeper.trial.reference import TrajectoryKey, trajectory_file

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def tiny_gpt_search(tmp_path: Path, nodes: int, gbs: int, search: dict[str, Any],
                    *extra: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``sweeper search`` of the tiny GPT's FP32 two-rank layouts (DP2 and PP2) on ``nodes`` simulated nodes of one
    GPU, or one node of two: what it said and its trial records."""
    doc = {
        "name": f"e2e-{tmp_path.name}"[:90],
        "model": "tiny-gpt",
        "cluster": {"nodes": nodes, "gpus_per_node": 2 if nodes == 1 else 1, "gpu_memory_gib": 4,
                    "compute_capability": "9.0"},
        "training": {"seq_length": 32, "global_batch_size": gbs, "steps": 3, "warmup_steps": 1, "checkpoint": False,
                     "trial_timeout_s": 240},
        "space": {"gpus": [2], "tp": [1], "pp": [1, 2], "mbs": [1], "precision": ["fp32"]},
        "search": {"max_trials": 2, "sampler": "grid", **search},
    }
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([sys.executable, "-m", "sweeper", "search", str(space), "--out", "sweep", *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    trials = tmp_path / "sweep" / "trials.jsonl"
    records = [json.loads(line) for line in trials.read_text().splitlines()] if trials.is_file() else []
    return proc, records


def test_a_slow_drift_the_gate_passes_fails_the_confirmation_naming_its_step(tmp_path: Path) -> None:
    # Two layouts of two ranks (DP2 and PP2), both confirmed: the first launched one drifts.
    proc, records = tiny_gpt_search(tmp_path, 1, 4, {"confirm_top": 2, "parallel": 1}, "--inject", "drift@trial=1")
    explored = sorted((r for r in records if r["phase"] == "explore"), key=lambda r: r["started_at"])
    assert len(explored) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    drifting = explored[0]["number"]
    # The one-step gate cannot see it: the drifting layout's exploration passed its gate.
    assert explored[0]["result"]["status"] == "passed", explored[0]["result"]["error"]
    assert explored[0]["result"]["checks"]["equivalence_rel_err"] < 1e-3
    confirmed = {r["number"]: r["result"] for r in records if r["phase"] == "confirm"}
    assert set(confirmed) == {r["number"] for r in explored}, proc.stdout[-3000:]
    bad = confirmed[drifting]
    assert bad["status"] == "failed" and bad["failure_kind"] == "equivalence"
    assert f"left the reference layout TP1-PP1-DP1-MBS1-fp32's at step {DRIFT_FROM_STEP} (of 6)" in bad["error"]
    good = confirmed[explored[1]["number"]]
    assert good["status"] == "passed" and any("within the fp32 band" in n for n in good["notes"]), good
    # The reference trajectory was made once (both confirmations share its global batch and precision), and kept.
    assert trajectory_file(tmp_path / "sweep" / "reference", TrajectoryKey(4, 1, "fp32"), 6).is_file()
    assert len(list((tmp_path / "sweep").glob("trajectory-*-run"))) == 1
