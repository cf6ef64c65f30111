"""The space: every Layout a search YAML describes, and the ``--only`` filter over it.

``enumerate_layouts`` is the product of the space's axes with SP ``auto`` resolved (on whenever TP > 1), the
global batch from ``training``, and Megatron's uneven pipeline split filled in where layers do not divide by PP.
Duplicates (e.g. ``sp: [auto, true]``) collapse to one layout.
"""

from __future__ import annotations

import itertools
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.space.layout import Layout, parse_assignments, resolve_sp
from sweeper.space.pipeline import with_pipeline_split


def enumerate_layouts(cfg: SweepConfig) -> list[Layout]:
    s = cfg.space
    seen: dict[Layout, None] = {}
    for gpus, tp, pp, vpp, cp, ep, etp, sp, mbs, precision, recompute, dist_opt in itertools.product(
        cfg.world_sizes, s.tp, s.pp, s.vpp, s.cp, s.ep, s.etp, s.sp, s.mbs, s.precision, s.recompute,
        s.distributed_optimizer,
    ):
        layout = Layout(
            world_size=gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sp=resolve_sp(sp, tp), mbs=mbs,
            gbs=cfg.training.global_batch_size, precision=precision, recompute=recompute,
            distributed_optimizer=dist_opt,
        )
        seen.setdefault(with_pipeline_split(layout, cfg.model), None)
    return list(seen)


def only_filter(text: str | None) -> dict[str, Any]:
    """Parse ``--only "tp=2,ep=4,sp=true"`` into the keys a layout must match."""
    if text is None:
        return {}
    return parse_assignments(text, what="--only")


def matches(layout: Layout, only: dict[str, Any]) -> bool:
    for key, value in only.items():
        actual = layout.world_size if key == "gpus" else getattr(layout, key)
        if key == "sp":
            value = resolve_sp(value, layout.tp)
        if actual != value:
            return False
    return True
