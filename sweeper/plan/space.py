"""The space: every Layout a search YAML describes, and the ``--layout`` / ``--only`` strings resolved against it.

``enumerate_layouts`` is the product of the space's axes with SP ``auto`` resolved (on whenever TP > 1), the
global batch from ``training``, and Megatron's uneven pipeline split filled in where layers do not divide by PP.
Duplicates (e.g. ``sp: [auto, true]``) collapse to one layout.
"""

from __future__ import annotations

import itertools
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.space.layout import Layout, LayoutError, parse_assignments
from sweeper.plan.rules import with_pipeline_split


def enumerate_layouts(cfg: SweepConfig) -> list[Layout]:
    s = cfg.space
    seen: dict[Layout, None] = {}
    for gpus, tp, pp, vpp, cp, ep, etp, sp, mbs, precision, recompute, dist_opt in itertools.product(
        cfg.world_sizes, s.tp, s.pp, s.vpp, s.cp, s.ep, s.etp, s.sp, s.mbs, s.precision, s.recompute,
        s.distributed_optimizer,
    ):
        layout = Layout(
            world_size=gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sp=_sp(sp, tp), mbs=mbs,
            gbs=cfg.training.global_batch_size, precision=precision, recompute=recompute,
            distributed_optimizer=dist_opt,
        )
        seen.setdefault(with_pipeline_split(layout, cfg.model), None)
    return list(seen)


def _sp(value: str | bool, tp: int) -> bool:
    return tp > 1 if value == "auto" else bool(value)


def layout_from_string(cfg: SweepConfig, text: str) -> Layout:
    """A full Layout from a partial ``--layout`` string: unspecified axes take the space's first value, the world
    size comes from ``gpus=``, or ``dp=`` (W = TP*PP*CP*DP), or else the space's largest world size."""
    given = parse_assignments(text, what="--layout")
    s = cfg.space
    axes: dict[str, Any] = {
        "tp": s.tp[0], "pp": s.pp[0], "vpp": s.vpp[0], "cp": s.cp[0], "ep": s.ep[0], "etp": s.etp[0],
        "sp": s.sp[0], "mbs": s.mbs[0], "precision": s.precision[0], "recompute": s.recompute[0],
        "distributed_optimizer": s.distributed_optimizer[0], "gbs": cfg.training.global_batch_size,
    }
    axes.update({k: v for k, v in given.items() if k not in ("gpus", "dp", "edp")})
    model_parallel = axes["tp"] * axes["pp"] * axes["cp"]
    if "gpus" in given:
        world = given["gpus"]
    elif "dp" in given:
        world = model_parallel * given["dp"]
    else:
        world = max(cfg.world_sizes)
    if "gpus" in given and "dp" in given and world != model_parallel * given["dp"]:
        raise LayoutError(f"--layout: gpus={world} but tp*pp*cp*dp = {model_parallel * given['dp']}")
    if world > cfg.cluster.total_gpus:
        raise LayoutError(f"--layout: needs {world} GPUs but the cluster has {cfg.cluster.total_gpus}")
    sp = _sp(axes.pop("sp"), axes["tp"])
    layout = with_pipeline_split(Layout(world_size=world, sp=sp, **axes), cfg.model)
    if "edp" in given and given["edp"] != layout.edp:
        raise LayoutError(f"--layout: edp={given['edp']} but W/(etp*ep*pp) = {layout.edp}")
    return layout


def only_filter(text: str | None) -> dict[str, Any]:
    """Parse ``--only "tp=2,ep=4,sp=true"`` into the keys a layout must match."""
    if text is None:
        return {}
    return parse_assignments(text, what="--only")


def matches(layout: Layout, only: dict[str, Any]) -> bool:
    for key, value in only.items():
        actual = layout.world_size if key == "gpus" else getattr(layout, key)
        if key == "sp" and value == "auto":
            value = layout.tp > 1
        if actual != value:
            return False
    return True
