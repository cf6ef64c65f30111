"""The space: every Layout a search YAML describes, and the ``--only`` filter over it.

``enumerate_layouts`` is the product of the space's axes with SP ``auto`` resolved (on whenever TP > 1), each
layout's share of the production run's global batch (``SweepConfig.trial_global_batch``), and Megatron's uneven
pipeline split filled in where layers do not divide by PP. Duplicates (e.g. ``sp: [auto, true]``) collapse to one
layout.
"""

from __future__ import annotations

import itertools
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.space.axes import AXIS, SEARCHED
from sweeper.space.layout import Layout, parse_assignments, resolve_sp
from sweeper.space.pipeline import pipeline_split_fields


def enumerate_layouts(cfg: SweepConfig) -> list[Layout]:
    # Each axis value goes through the Layout constructor once (checked, canonical spelling); the product's layouts
    # are then assembled from checked values, which is what keeps ten thousand of them instant.
    defaults = vars(Layout(world_size=1, gbs=cfg.training.global_batch_size))
    fields = [a.field for a in SEARCHED]
    choices = [_checked(a.field, cfg.world_sizes if a.name == "gpus" else cfg.space.values(a.name)) for a in SEARCHED]
    splits: dict[tuple[int, int], dict[str, Any]] = {}
    batches: dict[int, int] = {}  # world size -> the trial's share of the production batch
    seen: dict[tuple[Any, ...], Layout] = {}
    for values in itertools.product(*choices):
        axes = dict(zip(fields, values, strict=True))
        axes["sp"] = resolve_sp(axes["sp"], axes["tp"])
        key = tuple(axes.values())  # the split follows from PP and VPP: equal keys, equal layouts
        if key in seen:
            continue
        pipeline = (axes["pp"], axes["vpp"])
        if pipeline not in splits:
            splits[pipeline] = pipeline_split_fields(cfg.model, *pipeline)
        axes["gbs"] = batches.get(axes["world_size"]) or batches.setdefault(
            axes["world_size"], cfg.trial_global_batch(axes["world_size"]))
        seen[key] = Layout.from_checked({**defaults, **axes, **splits[pipeline]})
    return list(seen.values())


def _checked(field: str, values: list[Any]) -> list[Any]:
    """The values of one axis as a Layout holds them; LayoutError as the constructor raises it for a bad one."""
    return [getattr(Layout(**({"world_size": 1} | {field: value})), field) for value in values]


def only_filter(text: str | None) -> dict[str, Any]:
    """Parse ``--only "tp=2,ep=4,sp=true"`` into the keys a layout must match."""
    if text is None:
        return {}
    return parse_assignments(text, what="--only")


def matches(layout: Layout, only: dict[str, Any]) -> bool:
    for key, value in only.items():
        actual = AXIS[key].value(layout)
        if key == "sp":
            value = resolve_sp(value, layout.tp)
        if actual != value:
            return False
    return True
