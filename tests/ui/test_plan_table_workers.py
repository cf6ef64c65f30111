"""`sweeper plan`'s table of a large space made on several processes (sweeper/ui/plan_table.py): the same table as
one process makes, the workers' parts really made by the workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeper.config.load import load_config
from sweeper.estimate import Calibration
from sweeper.plan.assess import space_layouts
from sweeper.plan.shards import Listed
from sweeper.plan.space import SpaceProduct
from sweeper.ui import plan_table
from tests.workers import shares_made_here

ROOT = Path(__file__).resolve().parents[2]
WIDE = ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml"  # 11,520 layouts, 2,040 valid, MoE + Mamba


@pytest.mark.parametrize(("workers", "block"), [(2, 97), (3, 2048)])
@pytest.mark.parametrize("calibration", [None, Calibration(activation_factor=1.2, state_factor=0.9,
                                                           overhead_gib=1.0, step_time_factor=1.1)])
def test_the_workers_table_is_one_processs(workers: int, block: int, calibration: Calibration | None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(WIDE)
    layouts = SpaceProduct(cfg) if block == 97 else Listed(space_layouts(cfg))  # the whole space, a built list
    made_here = shares_made_here(monkeypatch, plan_table, "_part")
    table = plan_table.plan_table(cfg, layouts, calibration, workers=workers, block=block)
    assert made_here == [0]  # every other worker's part came back from its process
    one = plan_table.plan_table(load_config(WIDE), layouts, calibration, workers=1)
    assert table == one
    assert [e.predicted for e in table.valid] == [e.predicted for e in one.valid]
    assert table.layouts == 11520 and len(table.valid) == 2040
    assert len(table.reasons) > 10 and len({count for _, count in table.reasons}) < len(table.reasons)  # ties

