"""`plan --json`'s fast writer (issue 54): its text is ``json.dumps`` of the entries' ``to_json``, byte for byte, over
whole spaces (MoE + Mamba, the issue-18 knobs, generated pipeline layout strings) and over layouts that take the
writer's other paths (a knob set, the pipeline-split options, an entry without a prediction)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sweeper.config.load import load_config
from sweeper.plan.assess import PlanEntry, build_plan
from sweeper.plan.plan_json import plan_json
from sweeper.space.layout import Layout, layouts_json

ROOT = Path(__file__).resolve().parents[2]
SPACES = [
    ROOT / "benchmarks" / "spaces" / "nemotron_wide.yaml",  # 11,520 layouts, 2,040 valid
    ROOT / "search_spaces" / "moe_knobs.yaml",  # dispatchers, A2A overlap, offload: the knobs' keys
    ROOT / "search_spaces" / "deepseek_v3_1024_vendor.yaml",  # layout strings and uneven splits
]


def _slow_path(entries: list[PlanEntry]) -> str:
    """What `plan --json` printed before issue 54."""
    return json.dumps([e.to_json() for e in entries], check_circular=False)


@pytest.mark.parametrize("space", SPACES, ids=lambda p: p.stem)
def test_the_same_text_as_json_dumps_over_a_space(space: Path) -> None:
    entries = build_plan(load_config(space))
    assert any(e.valid for e in entries) and any(not e.valid for e in entries)
    fast, slow = plan_json(entries), _slow_path(entries)
    if fast != slow:  # entry for entry, to name the first that differs
        for entry, mine in zip(entries, json.loads(fast), strict=True):
            assert mine == entry.to_json(), entry.layout.short()
    assert fast == slow


def test_every_path_of_the_layout_encoder() -> None:
    layouts = [
        Layout(world_size=8, tp=2, sp=True),  # the common keys
        Layout(world_size=8, pp=2, account_for_embedding=True),  # the pipeline-split options written
        Layout(world_size=8, pp=2, pipeline_layout="Et|tL"),
        Layout(world_size=8, cuda_graph="local", offload_layers=1),  # knobs: a dict each
        Layout(world_size=16, pp=3, first_stage_layers=5, last_stage_layers=4, precision="fp8:blockwise"),
        Layout(world_size=8, sp=1),  # type: ignore[arg-type]  # 1 where the others hold True: not taken for it
    ]
    assert layouts_json(layouts) == [json.dumps(lo.to_dict()) for lo in layouts]
    assert layouts_json([]) == []


def test_entries_with_and_without_reasons_or_a_prediction() -> None:
    entries = [PlanEntry(Layout(world_size=8, tp=2, sp=True), [], None),  # valid, not predicted (rules only)
               PlanEntry(Layout(world_size=8, tp=3), ["a reason with \"quotes\" and é"], None),
               PlanEntry(Layout(world_size=8, tp=5), ["first", "second"], None),
               PlanEntry(Layout(world_size=8, tp=6), ["first", "second"], None)]
    assert plan_json(entries) == _slow_path(entries)
    assert plan_json([]) == "[]"
