"""The figure you bet on, measured where the cluster holds it (issue 53): a real sweep (`python -m sweeper search`,
a simulated 4-node Ray cluster, real megatron-core on CPU) whose trials run on 2 GPUs while the production run is the
cluster's 4. The winner's last confirmation runs its production layout itself (two copies side by side as one 4-rank
run on the production batch), and that run's measurement, none of it projected, is the winner's figure in sweep.json
and best_layout.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sweeper.space.layout import Layout
from tests.search.test_trajectory_e2e import tiny_gpt_search

pytestmark = pytest.mark.e2e


def test_the_winner_runs_as_the_production_run_and_that_measurement_is_its_figure(tmp_path: Path) -> None:
    # the two-rank layouts on 4 simulated nodes of one GPU: N = 4, two copies of each
    proc, records = tiny_gpt_search(tmp_path, 4, 8, {"confirm_top": 1, "parallel": 2})
    said = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, said
    confirms = [r for r in records if r["phase"] == "confirm"]
    at_scale = [r for r in confirms if Layout.from_dict(r["layout"]).world_size == 4]
    assert len(at_scale) == 1 and at_scale[0]["result"]["status"] == "passed", said
    run = Layout.from_dict(at_scale[0]["layout"])
    trial = next(Layout.from_dict(r["layout"]) for r in confirms if r not in at_scale)
    assert at_scale[0]["number"] == next(r["number"] for r in confirms if r not in at_scale)
    # The production layout: the trial's data parallelism and global batch doubled, its micro-batches per rank kept.
    assert (run.dp, run.gbs, run.mbs, run.pp) == (2 * trial.dp, 8, trial.mbs, trial.pp) and trial.gbs == 4
    # Held against the reference layout's trajectory on the production batch, as every confirmation is.
    assert any("within the fp32 band" in n for n in at_scale[0]["result"]["notes"]), at_scale[0]["result"]
    meta = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    measured = at_scale[0]["result"]["metrics"]["tokens_per_s"]
    assert meta["best"]["tokens_per_s"] == pytest.approx(measured, rel=1e-12)  # one copy: nothing projected
    best = yaml.safe_load((tmp_path / "sweep" / "best_layout.yaml").read_text())
    objective = best["objective"]
    assert objective["measured_on_gpus"] == 4 and objective["projected_share"] == 0.0
    assert objective["at_scale"]["gpus"] == 4 and objective["figure"] == pytest.approx(measured, rel=1e-12)
    assert best["production"]["layout_string"] == run.to_string()
    assert best["measured_run"]["phase"] == "confirm"
