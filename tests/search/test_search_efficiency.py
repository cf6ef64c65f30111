"""benchmarks/search_efficiency.py replays sweeps on a measured landscape as a sweep runs them (no trial runs: the
landscape's stored measurements stand in for the trials, which is what the benchmark is for)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import search_efficiency as bench  # noqa: E402

from sweeper.config.load import load_config  # noqa: E402


@pytest.fixture(scope="module")
def dense() -> tuple:
    table = json.loads((ROOT / "tests" / "data" / "landscape_dense.json").read_text())
    cfg = load_config(ROOT / table["space"])
    return cfg, bench.measured_landscape(table, cfg)


@pytest.mark.parametrize("mode", ["tpe", "random", "ordered", "ranked"])
def test_a_replay_never_launches_a_recompute_variant_of_a_layout_that_ran_stable(dense: tuple, mode: str) -> None:
    cfg, land = dense
    assert any(lo.recompute != "none" for lo in land.samples), "the dense landscape has a recompute axis"
    for seed in range(2):
        outcome = bench.run_study(cfg, land, target=float("inf"), seed=seed, mode=mode)  # runs every candidate
        stable_plain: set = set()
        for layout, stable in outcome.order:
            if layout.recompute != "none":
                assert replace(layout, recompute="none") not in stable_plain, (mode, seed, layout.short())
            elif stable:
                stable_plain.add(layout)
        launched = [lo for lo, _ in outcome.order]
        assert len(launched) == len(set(launched)) == outcome.launched
        # Every layout is either launched or dominated by one that was: nothing is lost from the landscape.
        skipped = set(land.samples) - set(launched)
        assert skipped and all(replace(lo, recompute="none") in stable_plain for lo in skipped)
