"""The space: every Layout a search YAML describes, and the ``--only`` filter over it.

``enumerate_layouts`` is the product of the space's axes with SP ``auto`` resolved (on whenever TP > 1), the
global batch from ``training``, and Megatron's uneven pipeline split filled in where layers do not divide by PP.
Duplicates (e.g. ``sp: [auto, true]``) collapse to one layout.
"""

from __future__ import annotations

import itertools
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.space.axes import AXIS, SEARCHED
from sweeper.space.layout import Layout, parse_assignments, resolve_sp
from sweeper.space.pipeline import with_pipeline_split


def enumerate_layouts(cfg: SweepConfig) -> list[Layout]:
    names = [a.name for a in SEARCHED]
    choices = [cfg.world_sizes if name == "gpus" else cfg.space.values(name) for name in names]
    seen: dict[Layout, None] = {}
    for values in itertools.product(*choices):
        axes = dict(zip(names, values, strict=True))
        world = axes.pop("gpus")
        sp = resolve_sp(axes.pop("sp"), axes["tp"])
        layout = Layout(world_size=world, sp=sp, gbs=cfg.training.global_batch_size, **axes)
        seen.setdefault(with_pipeline_split(layout, cfg.model), None)
    return list(seen)


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
