"""The space: every Layout a search YAML describes, and the ``--only`` filter over it.

``enumerate_layouts`` is the product of the space's axes with SP ``auto`` resolved (on whenever TP > 1), each
layout's share of the production run's global batch (``SweepConfig.trial_global_batch``), and Megatron's pipeline
split filled in where layers do not divide by PP x VPP (``pipeline_splits``: sweeper's uneven or accounted split,
and the balanced pipeline_model_parallel_layout string besides it). Duplicates (e.g. ``sp: [auto, true]``)
collapse to one layout.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.models.spec import ModelSpec
from sweeper.space.axes import AUTO_LAYOUT, AXIS, PIPELINE_SPLIT, SEARCHED
from sweeper.space.layout import Layout, PipelineSplit, parse_assignments, resolve_sp
from sweeper.space.pipeline import balanced_layout, parse_layout, pipeline_split_fields, stage_layers


def enumerate_layouts(cfg: SweepConfig) -> list[Layout]:
    return SpaceProduct(cfg).layouts()


class SpaceProduct:
    """The space's layouts as the product of its axes, each built only when asked for: all of them, or those at
    some places of the space (a worker of a large plan builds its own blocks, sweeper/plan/shards.py)."""

    def __init__(self, cfg: SweepConfig) -> None:
        # Each axis value goes through the Layout constructor once (checked, canonical spelling); the product's
        # layouts are then assembled from checked values, which is what keeps a hundred thousand of them quick.
        # Duplicates are dropped among each axis's values (SP's per TP, the pipeline's per PP) before the product, so
        # no layout is built twice and none needs a key: a layout keeps the place in the product where its values
        # first appear.
        defaults = vars(Layout(world_size=1, gbs=cfg.training.global_batch_size))
        values = {a.name: list(dict.fromkeys(_checked(a.field, cfg.world_sizes if a.name == "gpus"
                                                      else cfg.space.values(a.name)))) for a in SEARCHED}
        patches = {a.name: [{a.field: v} for v in values[a.name]] for a in SEARCHED}
        patches["gpus"] = [{"world_size": w, "gbs": cfg.trial_global_batch(w)} for w in values["gpus"]]
        sp = {tp: [{"sp": on} for on in dict.fromkeys(resolve_sp(v, tp) for v in values["sp"])]
              for tp in values["tp"]}
        rows = [dict(defaults)]
        after_sp = [a.name for a in SEARCHED].index("sp") + 1
        for axis in SEARCHED[:after_sp]:
            by_row = (lambda row: sp[row["tp"]]) if axis.name == "sp" else (lambda row, p=patches[axis.name]: p)
            rows = [{**row, **patch} for row in rows for patch in by_row(row)]
        # The axes after SP take the same values in every row: their product, the pipeline's parts innermost (its
        # axis is the last), is one list of patches per (PP, VPP), and each layout costs one copy of its row.
        tail: list[dict[str, Any]] = [{}]
        for axis in SEARCHED[after_sp:-1]:
            tail = [{**t, **patch} for t in tail for patch in patches[axis.name]]
        parts = _pipeline_parts(cfg.model, values["pp"], values["vpp"], values["pipeline_layout"], defaults)
        inner = {key: [{**t, **part} for t in tail for part in pipeline] for key, pipeline in parts.items()}
        self._rows = [(row, inner[row["pp"], row["vpp"]]) for row in rows]
        self._starts = list(itertools.accumulate((len(patches) for _, patches in self._rows), initial=0))

    def __len__(self) -> int:
        return self._starts[-1]

    def layouts(self, places: Sequence[range] | None = None) -> list[Layout]:
        """Every layout of the space, in its order; or those at ``places`` (ranges of it, in that order)."""
        if places is None:
            return [Layout.from_checked({**row, **patch}) for row, patches in self._rows for patch in patches]
        out: list[Layout] = []
        for where in places:
            r = bisect.bisect_right(self._starts, where.start) - 1  # the row of the range's first layout
            while r < len(self._rows) and self._starts[r] < where.stop:
                row, patches = self._rows[r]
                first = self._starts[r]
                out += [Layout.from_checked({**row, **patch})
                        for patch in patches[max(where.start - first, 0):where.stop - first]]
                r += 1
        return out


def _pipeline_parts(model: ModelSpec, pps: list[int], vpps: list[int], layouts: list[str | None],
                    defaults: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """The VPP and pipeline-split fields each (PP, VPP) gives over the pipeline_layout values, each set of them only
    where it first appears for its PP: a layout string sets its own VPP, so every VPP of the axis gives it again, and
    auto's balanced string can be one the space lists."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for pp in pps:
        seen: set[tuple[Any, ...]] = set()
        for vpp in vpps:
            out[pp, vpp] = []
            for layout in layouts:
                for split in pipeline_splits(model, pp, vpp, layout):
                    part = {"vpp": vpp, **split}
                    key = tuple(part.get(name, defaults[name]) for name in ("vpp", *PIPELINE_SPLIT))
                    if key not in seen:
                        seen.add(key)
                        out[pp, vpp].append(part)
    return out


def pipeline_splits(model: ModelSpec, pp: int, vpp: int, layout: str | None) -> list[dict[str, Any]]:
    """The pipeline-split fields of the layouts one (PP, VPP, pipeline_layout value) gives. ``auto`` (held as
    None): sweeper's split (``pipeline_split_fields``) and, where the layers do not divide by PP x VPP, the balanced
    layout string besides it unless it places the layers the same way. A layout string: itself, with the VPP it
    sets (stages / PP), where its stages divide over PP; none elsewhere (the string names the pipeline's depth)."""
    if layout is not None:
        try:
            stages = len(parse_layout(layout, 1))
        except ValueError:  # not a layout Megatron parses: the rules say why (plan lists it as invalid)
            return [{"pipeline_layout": layout}]
        return [{"pipeline_layout": layout, "vpp": stages // pp}] if stages % pp == 0 else []
    fields = pipeline_split_fields(model, pp, vpp)
    out = [{"pipeline_layout": None, **fields}]
    if pp > 1 and not model.is_hybrid and model.num_layers % (pp * vpp):
        generated = balanced_layout(model.num_layers, pp, vpp, model.mtp_num_layers)
        if generated is None:
            return out
        if not fields or _placement(model, pp, vpp, PipelineSplit(layout=generated)) != _placement(
                model, pp, vpp, Layout(world_size=1, pp=pp, vpp=vpp, **fields).split):
            out.append({"pipeline_layout": generated})
    return out


def _placement(model: ModelSpec, pp: int, vpp: int, split: PipelineSplit) -> tuple[Any, ...] | None:
    """Which decoder layers each rank's virtual stages hold (None: a split Megatron would refuse)."""
    try:
        return stage_layers(model.num_layers, pp, vpp, split=split)
    except ValueError:
        return None


def pipeline_layout_values(cfg: SweepConfig) -> list[str | None]:
    """Every pipeline_layout a layout of the space can hold (None: sweeper's split without a string): Optuna's
    choices for the axis, the generated strings included."""
    values: dict[str | None, None] = {}
    for value in cfg.space.values("pipeline_layout"):
        layout = None if value == AUTO_LAYOUT else value
        for pp, vpp in itertools.product(cfg.space.values("pp"), cfg.space.values("vpp")):
            for split in pipeline_splits(cfg.model, pp, vpp, layout):
                values.setdefault(split["pipeline_layout"])
    return list(values)


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
        if key == "pipeline_layout" and value == AUTO_LAYOUT:  # the layouts without a string (sweeper's own split)
            value = None
        if actual != value:
            return False
    return True
