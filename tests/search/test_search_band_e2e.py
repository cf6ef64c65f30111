"""End to end (issue 13): a sweep launches and measures a layout inside the estimator's error band instead of pruning
it, and prunes, with prediction, band and reason on record, only the one whose band's lower end is over the limit.

A real sweep on a simulated 1 x 2-GPU Ray cluster, real megatron-core on CPU. The tiny dense GPT's predictions are
a few MiB, so the space scales its per-step memory with ``estimate.allocator_fragmentation`` (1000) and drops the
fixed overheads, which puts the three micro-batch sizes on the three sides of a 1.4 GiB simulated GPU (limit 90%:
1.26 GiB): mbs 1 is predicted to fit (~0.69 GiB), mbs 2 (~1.38 GiB, band from ~1.15) may fit, mbs 4 (~2.8 GiB, band
from ~2.3) cannot. Dense, so no measured routing imbalance moves the predictions during the sweep. The ranks' host
memory (~0.8 GiB) stays under the simulated 1.4 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def test_a_layout_inside_the_band_is_launched_and_measured_not_pruned(tmp_path: Path) -> None:
    space = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    space.update(
        name="band", model="tiny-gpt",
        cluster={**space["cluster"], "nodes": 1, "gpus_per_node": 2, "gpu_memory_gib": 1.4},
        training={**space["training"], "steps": 3, "warmup_steps": 1, "checkpoint": False},
        space={"gpus": [2], "mbs": [1, 2, 4], "precision": ["bf16"]},
        search={"max_trials": 4, "confirm_top": 0, "memory_headroom": 0.10},
        estimate={"allocator_fragmentation": 1000.0, "cuda_context_gib": 0.0, "nccl_buffer_gib_per_group": 0.0,
                  "workspace_gib": 0.0},
    )
    path = tmp_path / "band.yaml"
    path.write_text(yaml.safe_dump(space))

    plan = json.loads(subprocess.run(
        [sys.executable, "-m", "sweeper", "plan", str(path), "--json"], cwd=tmp_path, capture_output=True,
        text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout)
    by_mbs = {e["layout"]["mbs"]: e["predicted"] for e in plan}
    assert (by_mbs[1]["fits"], by_mbs[2]["fits"], by_mbs[2]["may_fit"], by_mbs[4]["may_fit"]) == (
        True, False, True, False), by_mbs

    proc = subprocess.run(
        [sys.executable, "-m", "sweeper", "search", str(path), "--out", "sweep"], cwd=tmp_path,
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "sweep" / "trials.jsonl").read_text().splitlines()]
    launched = {r["layout"]["mbs"]: r for r in records if r["result"]["status"] != "pruned"}
    assert set(launched) == {1, 2}
    probe = launched[2]
    assert probe["predicted"]["fits"] is False and probe["predicted"]["may_fit"] is True
    assert probe["result"]["status"] == "passed", probe["result"]
    assert probe["result"]["metrics"]["peak_memory_gib"] > 0  # measured (host RSS on the CPU backend)

    meta = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    pruned = {p["layout"]: p for p in meta["memory_pruned"]}
    assert list(pruned) == ["TP1-PP1-DP2-MBS4-bf16"], pruned
    entry = pruned["TP1-PP1-DP2-MBS4-bf16"]
    assert entry["memory_band_gib"][0] > 1.26 and "lower end" in entry["reason"]
    report = (tmp_path / "sweep" / "report.html").read_text()
    assert "pruned on predicted memory" in report and "TP1-PP1-DP2-MBS4-bf16" in report
