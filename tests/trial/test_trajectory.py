"""The reference trajectory a confirmation is held against (issue 53): which batch and precision it depends on,
the reference layout that makes it, and its file (no Ray, no Megatron)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from sweeper.config.load import load_config, proxy_config
from sweeper.record.checkpoints import REFERENCE_FILE
from sweeper.search.run.faults import injection_for, parse_injections
from sweeper.space.layout import Layout
from sweeper.trial.proxy_run import proxy_run_layout
from sweeper.trial.reference import (
    Trajectory,
    TrajectoryKey,
    read_trajectory,
    trajectory_file,
    trajectory_key,
    trajectory_layout,
    written_layout,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_reference_layout_runs_the_confirmations_batch_and_precision() -> None:
    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    confirmation = Layout(world_size=4, tp=2, gbs=8, mbs=2, precision="bf16")
    assert trajectory_key(cfg, confirmation) == TrajectoryKey(8, 2, "bf16")
    made = trajectory_layout(cfg, Layout(world_size=1, gbs=4, precision="fp32"), trajectory_key(cfg, confirmation))
    # the same micro-batches: a MoE's load-balancing loss is a micro-batch's
    assert made == Layout(world_size=1, gbs=8, mbs=2, precision="bf16")
    # a reference whose data parallelism cannot split the batch cannot make its trajectory
    assert trajectory_layout(cfg, Layout(world_size=4, gbs=4, precision="fp32"), TrajectoryKey(6, 1, "fp32")) is None


def test_a_proxy_confirmation_is_compared_on_the_batch_share_it_runs() -> None:
    cfg = proxy_config(load_config(ROOT / "search_spaces" / "nemotron.yaml"))
    layout = Layout(world_size=16, tp=2, gbs=64, mbs=1, precision="bf16")
    run = proxy_run_layout(layout)
    key = trajectory_key(cfg, layout)
    assert run.gbs < layout.gbs and key == TrajectoryKey(run.gbs, 1, "bf16")
    made = trajectory_layout(cfg, Layout(world_size=1, gbs=4, precision="fp32"), key)
    # the reference layout with the data-parallel copies its own proxy run needs to keep the whole share
    assert made == Layout(world_size=2, gbs=run.gbs, mbs=1, precision="bf16")
    assert proxy_run_layout(made).gbs == run.gbs


def test_the_trajectory_file_round_trips_and_the_writer_layout_is_read_from_the_reference(tmp_path: Path) -> None:
    made = Trajectory("TP1-PP1-DP1-MBS1-fp32", "fp32", 8, [2.0, 1.9], [1.0, 0.9])
    path = trajectory_file(tmp_path, TrajectoryKey(8, 1, "fp32"), 2)
    path.write_text(json.dumps(asdict(made)))
    assert read_trajectory(path) == made
    assert read_trajectory(tmp_path / "missing.json") is None
    assert written_layout(tmp_path) is None
    writer = Layout(world_size=1, gbs=4, precision="fp32")
    (tmp_path / REFERENCE_FILE).write_text(json.dumps({"layout": writer.to_dict()}))
    assert written_layout(tmp_path) == writer


def test_drift_is_injected_by_the_backend() -> None:
    [inj] = parse_injections(["drift@trial=2"], simulated=True)
    assert injection_for([inj], 2) == "drift" and injection_for([inj], 1) is None
