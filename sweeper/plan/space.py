"""The space: every Layout a search YAML describes, and the ``--only`` filter over it.

``enumerate_layouts`` is the product of the space's axes with SP ``auto`` resolved (on whenever TP > 1), each
layout's share of the production run's global batch (``SweepConfig.trial_global_batch``), and Megatron's pipeline
split filled in where layers do not divide by PP x VPP (``pipeline_splits``: sweeper's uneven or accounted split,
and the balanced pipeline_model_parallel_layout string besides it). Duplicates (e.g. ``sp: [auto, true]``)
collapse to one layout.
"""

from __future__ import annotations

import itertools
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.models.spec import ModelSpec
from sweeper.space.axes import AUTO_LAYOUT, AXIS, SEARCHED
from sweeper.space.layout import Layout, PipelineSplit, parse_assignments, resolve_sp
from sweeper.space.pipeline import balanced_layout, parse_layout, pipeline_split_fields, stage_layers


def enumerate_layouts(cfg: SweepConfig) -> list[Layout]:
    # Each axis value goes through the Layout constructor once (checked, canonical spelling); the product's layouts
    # are then assembled from checked values, which is what keeps ten thousand of them instant.
    defaults = vars(Layout(world_size=1, gbs=cfg.training.global_batch_size))
    fields = [a.field for a in SEARCHED]
    choices = [_checked(a.field, cfg.world_sizes if a.name == "gpus" else cfg.space.values(a.name)) for a in SEARCHED]
    splits: dict[tuple[int, int, str | None], list[dict[str, Any]]] = {}
    batches: dict[int, int] = {}  # world size -> the trial's share of the production batch
    seen: dict[tuple[Any, ...], Layout] = {}
    for values in itertools.product(*choices):
        axes = dict(zip(fields, values, strict=True))
        axes["sp"] = resolve_sp(axes["sp"], axes["tp"])
        pipeline = (axes["pp"], axes["vpp"], axes.pop("pipeline_layout"))
        if pipeline not in splits:
            splits[pipeline] = pipeline_splits(cfg.model, *pipeline)
        gbs = batches.get(axes["world_size"]) or batches.setdefault(
            axes["world_size"], cfg.trial_global_batch(axes["world_size"]))
        for split in splits[pipeline]:
            fields_of = {**defaults, **axes, **split, "gbs": gbs}
            key = tuple(fields_of.values())  # in the order of ``defaults``, every field's: one key per layout
            if key not in seen:
                seen[key] = Layout.from_checked(fields_of)
    return list(seen.values())


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
