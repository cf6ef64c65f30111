"""Which decoder layers land on which pipeline rank and virtual stage, exactly as Megatron-Core 0.16 places them.

GPT models follow ``get_num_layers_to_build``/``get_transformer_layer_offset``: an even split, or an uneven one
with ``num_layers_in_first/last_pipeline_stage`` and the rest spread evenly over the middle stages; with
interleaving (VPP) every stage's count is cut into VPP chunks and chunk ``v`` of every rank comes after all
chunks ``v-1``. ``account_for_embedding/loss_in_pipeline_split`` count the embedding (first virtual stage of rank
0) and the loss (last virtual stage of the last rank) as one layer each: ``num_layers + 1 + 1`` slots split evenly,
one fewer decoder layer where they sit. ``pipeline_model_parallel_layout`` names every virtual stage's layers
(``PipelineParallelLayerLayout``: stage ``v * PP + rank``). Hybrid Mamba models
(``MambaStack._select_layers_for_pipeline_parallel``) use the even or uneven counts without VPP and ignore the
other two options. Layer counts Megatron would assert on (or silently truncate, for hybrids) raise ValueError here.
``with_pipeline_split`` picks the split for layers that do not divide by PP x VPP (uneven first/last, else the
embedding and loss accounted as layers).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from typing import Any

from sweeper.models.spec import Block, ModelSpec
from sweeper.space.layout import Layout, PipelineSplit

Chunk = tuple[int, ...]  # layer indices (0-based) of one virtual stage


@lru_cache(maxsize=1024)
def stage_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Layers per pipeline rank."""
    if pp == 1:
        return (num_layers,)
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"num_layers ({num_layers}) is not divisible by pipeline size ({pp})")
        return (num_layers // pp,) * pp
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (
        middle_stages and middle_layers % middle_stages
    ):
        raise ValueError(
            f"with {first} first-stage and {last} last-stage layers, the remaining {middle_layers} layers "
            f"do not divide over {middle_stages} middle stages"
        )
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


@lru_cache(maxsize=256)
def parse_layout(text: str, pp: int) -> tuple[str, ...]:
    """The stages of a pipeline_model_parallel_layout string, as megatron-core 0.16.1 reads it
    (pipeline_parallel_layer_layout.py ``parse_str_to_list``): commas dropped, ``(...)*n`` then ``x*n`` unrolled,
    split on ``|``; characters E (embedding), L (loss), t (decoder layer), m (multi-token prediction)."""
    flat = text.replace(",", "")
    flat = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    flat = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    bad = sorted(set(flat) - set("ELtm|"))
    if bad:
        raise ValueError(f"pipeline_model_parallel_layout: Invalid layer character: {bad[0]!r}")
    stages = tuple(flat.split("|"))
    if len(stages) % pp:
        raise ValueError(f"pipeline_model_parallel_layout has {len(stages)} stages, not a multiple of "
                         f"pipeline_model_parallel_size ({pp})")
    return stages


def check_layout(text: str, pp: int, num_layers: int) -> tuple[str, ...]:
    """The stages of a layout string that Megatron's ``validate_layer_layout`` accepts for a model of
    ``num_layers`` decoder layers and no MTP layers; ValueError with Megatron's reason otherwise."""
    stages = parse_layout(text, pp)
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError("pipeline_model_parallel_layout must start with the embedding (E) and end with the loss "
                         "(L), each exactly once")
    if flat.count("t") != num_layers:
        raise ValueError(f"Number of decoder layers ({flat.count('t')}) in pipeline_model_parallel_layout must "
                         f"match num_layers ({num_layers})")
    if "m" in flat:
        raise ValueError("pipeline_model_parallel_layout places multi-token-prediction layers (m); this model has "
                         "none (mtp_num_layers 0)")
    return stages


@lru_cache(maxsize=1024)
def stage_layers(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
    split: PipelineSplit | None = None,
) -> tuple[tuple[Chunk, ...], ...]:
    """For each pipeline rank, its virtual stages' layer indices (one chunk when VPP is 1). ``split`` (Megatron's
    options, ``Layout.split``) takes the place of ``first``/``last`` when given."""
    split = split or PipelineSplit(first, last)
    if split.layout is not None:
        return _layout_layers(split.layout, num_layers, pp)
    if split.embedding or split.loss:
        return _accounted_layers(num_layers, pp, vpp, split.embedding, split.loss)
    first, last = split.first, split.last
    counts = stage_counts(num_layers, pp, first, last)
    if any(c % vpp for c in counts):
        raise ValueError(f"layers per pipeline stage {counts} are not divisible by virtual stages ({vpp})")
    per_chunk = [c // vpp for c in counts]
    round_size = num_layers // vpp  # layers in one pass of virtual stage v over all ranks
    out: list[tuple[Chunk, ...]] = []
    for rank in range(pp):
        before = sum(per_chunk[:rank])
        out.append(
            tuple(
                tuple(range(v * round_size + before, v * round_size + before + per_chunk[rank]))
                for v in range(vpp)
            )
        )
    return tuple(out)


def _accounted_layers(num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool
                      ) -> tuple[tuple[Chunk, ...], ...]:
    """transformer_block.py ``get_num_layers_to_build`` and transformer_layer.py ``get_transformer_layer_offset``
    with account_for_embedding/loss: ``num_layers + e + l`` slots, ``slots / PP / VPP`` per virtual stage, one
    fewer decoder layer on the first virtual stage of rank 0 (embedding) and the last of the last rank (loss)."""
    slots = num_layers + embedding + loss
    if slots % pp or (slots // pp) % vpp:
        raise ValueError(f"num_layers ({num_layers}) + embedding/loss ({slots}) does not split into {pp} pipeline "
                         f"ranks x {vpp} virtual stages")
    per_chunk = slots // pp // vpp
    out: list[tuple[Chunk, ...]] = []
    for rank in range(pp):
        chunks = []
        for v in range(vpp):
            start = v * (slots // vpp) + rank * per_chunk
            count = per_chunk
            if embedding and (v, rank) == (0, 0):
                count -= 1
            else:
                start -= embedding
            if loss and (v, rank) == (vpp - 1, pp - 1):
                count -= 1
            chunks.append(tuple(range(start, start + count)))
        out.append(tuple(chunks))
    return tuple(out)


def _layout_layers(text: str, num_layers: int, pp: int) -> tuple[tuple[Chunk, ...], ...]:
    """Layer indices per rank and virtual stage of a pipeline_model_parallel_layout (decoder layers numbered in
    stage order, stage ``v * PP + rank``)."""
    stages = check_layout(text, pp, num_layers)
    vpp = len(stages) // pp
    chunks: dict[tuple[int, int], Chunk] = {}
    next_layer = 0
    for i, stage in enumerate(stages):
        count = stage.count("t")
        chunks[(i % pp, i // pp)] = tuple(range(next_layer, next_layer + count))
        next_layer += count
    return tuple(tuple(chunks[(rank, v)] for v in range(vpp)) for rank in range(pp))


LayerKind = tuple[Block, ...]


@lru_cache(maxsize=4096)
def stage_layer_kinds(
    spec: ModelSpec, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
    split: PipelineSplit | None = None,
) -> tuple[tuple[tuple[LayerKind, int], ...], ...]:
    """For each pipeline rank, how many layers of each kind (its tuple of blocks) it holds over all its virtual
    stages. Estimating per kind instead of per layer keeps ``estimate`` fast on 50-layer hybrid models."""
    out = []
    for rank_chunks in stage_layers(spec.num_layers, pp, vpp, first, last, split):
        kinds = Counter(spec.layer_blocks[i] for chunk in rank_chunks for i in chunk)
        out.append(tuple(sorted(kinds.items())))
    return tuple(out)


@lru_cache(maxsize=4096)
def uneven_split(layers: int, pp: int, vpp: int = 1) -> tuple[int, int] | None:
    """Megatron's num_layers_in_first/last_pipeline_stage for layers that do not divide by PP: the most balanced
    split with the first stage getting the extra layer (the last stage also holds the output layer and logits),
    every count a multiple of VPP. 27 layers on PP=2 gives (14, 13)."""
    best: tuple[int, int, int, int] | None = None  # (imbalance, last - first, first, last)
    for first in range(1, layers):
        for last in range(1, layers - first + 1):
            middle_layers, middle_stages = layers - first - last, pp - 2
            if (middle_layers > 0) != (middle_stages > 0) or middle_layers < 0:
                continue
            per_middle = middle_layers // middle_stages if middle_stages else None
            if middle_stages and middle_layers % middle_stages:
                continue
            counts = [first, last] + ([per_middle] if per_middle is not None else [])
            if any(n % vpp or n == 0 for n in counts):
                continue
            key = (max(counts) - min(counts), last - first, first, last)
            if best is None or key < best:
                best = key
    return None if best is None else (best[2], best[3])


def accounted_split(layers: int, pp: int, vpp: int = 1) -> tuple[bool, bool] | None:
    """(account_for_embedding, account_for_loss) that make ``layers`` split over PP x VPP with a decoder layer on
    every virtual stage, both preferred (NVIDIA's recipes: Llama-3.1-405B's 126 layers + 2 on PP8 x VPP8 give 2 per
    virtual stage, 1 beside the embedding and 1 beside the loss); None when none does."""
    for embedding, loss in ((True, True), (True, False), (False, True)):
        slots = layers + embedding + loss
        # Every virtual stage keeps at least one decoder layer (Megatron allows an empty one; sweeper does not pick
        # it for the user: a stage holding only the embedding or only the loss is a poor split).
        if slots % pp == 0 and (slots // pp) % vpp == 0 and slots // pp // vpp >= 2:
            return embedding, loss
    return None


def with_pipeline_split(layout: Layout, model: ModelSpec) -> Layout:
    """The layout with Megatron's pipeline split filled in when the layers do not divide by PP x VPP and the layout
    names no split itself: the uneven first/last stage sizes (27 layers on PP2: 14/13), else the embedding and the
    loss accounted as layers (126 layers on PP8 x VPP8)."""
    if layout.pp == 1 or not layout.split.even:
        return layout
    fields = pipeline_split_fields(model, layout.pp, layout.vpp)
    return replace(layout, **fields) if fields else layout


def pipeline_split_fields(model: ModelSpec, pp: int, vpp: int) -> dict[str, Any]:
    """The Layout fields ``with_pipeline_split`` sets for ``model`` on PP x VPP (empty: the even split)."""
    if pp == 1 or model.num_layers % pp == 0:
        return {}
    split = uneven_split(model.num_layers, pp, vpp)
    if split is not None:
        return {"first_stage_layers": split[0], "last_stage_layers": split[1]}
    accounted = None if model.is_hybrid else accounted_split(model.num_layers, pp, vpp)
    if accounted is not None:
        return {"account_for_embedding": accounted[0], "account_for_loss": accounted[1]}
    return {}
