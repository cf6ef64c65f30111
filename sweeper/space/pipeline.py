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


def check_layout(text: str, pp: int, num_layers: int, mtp_num_layers: int = 0) -> tuple[str, ...]:
    """The stages of a layout string that Megatron's ``validate_layer_layout`` (pipeline_parallel_layer_layout.py)
    accepts for a model of ``num_layers`` decoder layers and ``mtp_num_layers`` multi-token-prediction layers;
    ValueError with Megatron's reason otherwise."""
    stages = parse_layout(text, pp)
    flat = "".join(stages)
    if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
        raise ValueError("pipeline_model_parallel_layout must start with the embedding (E) and end with the loss "
                         "(L), each exactly once")
    if flat.count("t") != num_layers:
        raise ValueError(f"Number of decoder layers ({flat.count('t')}) in pipeline_model_parallel_layout must "
                         f"match num_layers ({num_layers})")
    if flat.count("m") != mtp_num_layers:
        raise ValueError(f"Number of mtp layers in layout ({flat.count('m')}) must match mtp_num_layers "
                         f"({mtp_num_layers})")
    if "m" in flat:
        vpp = len(stages) // pp
        # Megatron numbers layers in stage order (stage v * PP + rank), so "after" is the flat string's order.
        if "t" in flat[flat.index("m"):]:
            raise ValueError("pipeline_model_parallel_layout: decoder layers must be placed before MTP layers")
        holding = [i for i, stage in enumerate(stages) if "m" in stage]
        if any(i // pp != vpp - 1 for i in holding):
            raise ValueError("pipeline_model_parallel_layout: MTP must be in the last virtual pipeline stage of its "
                             "pipeline rank")
        if len(holding) > 1:
            raise ValueError("pipeline_model_parallel_layout: all of the MTP layers must be in the same one virtual "
                             "pipeline stage")
    return stages


def balanced_layout(num_layers: int, pp: int, vpp: int = 1, mtp_num_layers: int = 0) -> str | None:
    """The pipeline_model_parallel_layout Megatron users write when the layers do not divide over PP x VPP: the
    embedding, the loss and each MTP layer weigh one decoder layer, every virtual stage gets the smallest even
    load, the embedding's stage gives up layers first (rank 0 also holds the most micro-batches' activations)
    and the loss and MTP sit on the last stage. DeepSeek-V3's 61 layers with one MTP layer on PP8 x VPP4 give
    ``Et|(tt|)*30mL``, 30 layers on PP4 x VPP8 ``E|(t|)*30L`` (what the embedding and loss accounted as layers
    build). None when a middle virtual stage would hold no decoder layer (more stages than layers)."""
    count = pp * vpp
    extra = [0] * count  # what each stage holds besides decoder layers, in layer equivalents
    extra[0] += 1
    extra[-1] += 1 + mtp_num_layers
    base, heavy = divmod(num_layers + sum(extra), count)
    # The lighter stages (one unit less): the embedding's first, then middle stages spread evenly, the loss's last.
    middle = list(range(1, count - 1))
    light_middle = max(0, min(len(middle), count - heavy - 1))
    light = {0} if count > heavy else set()
    light |= {middle[(2 * j + 1) * len(middle) // (2 * light_middle)] for j in range(light_middle)}
    if count - heavy - 1 > len(middle):
        light.add(count - 1)
    layers = [base + (i not in light) - extra[i] for i in range(count)]
    # A stage whose own extras outweigh its load (MTP on a short last stage) holds none; others give up the deficit.
    deficit = -sum(n for n in layers if n < 0)
    layers = [max(0, n) for n in layers]
    for _ in range(deficit):
        layers[max(range(count), key=lambda i: (layers[i], -i))] -= 1
    if not all(layers[1:-1]):
        # A middle virtual stage with no decoder layer only adds a pipeline hop: not a layout sweeper picks.
        return None
    stages = ["E" * (i == 0) + _decoder_run(n) + "m" * mtp_num_layers * (i == count - 1) + "L" * (i == count - 1)
              for i, n in enumerate(layers)]
    return _compact(stages)


def _decoder_run(n: int) -> str:
    return "t" * n if n <= 2 else f"t*{n}"


def _compact(stages: list[str]) -> str:
    """Stages joined by ``|`` with runs of equal middle stages written ``(s|)*n`` (Megatron's own shorthand)."""
    out, i = [stages[0] + "|"], 1
    while i < len(stages) - 1:
        run = 1
        while i + run < len(stages) - 1 and stages[i + run] == stages[i]:
            run += 1
        out.append(f"({stages[i]}|)*{run}" if run > 1 else stages[i] + "|")
        i += run
    out.append(stages[-1])
    return "".join(out)


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
    stages = parse_layout(text, pp)  # the rules check the rest (plan.rules.pipeline_split)
    if sum(stage.count("t") for stage in stages) != num_layers:
        raise ValueError(f"pipeline_model_parallel_layout {text!r} does not hold num_layers ({num_layers})")
    vpp = len(stages) // pp
    chunks: dict[tuple[int, int], Chunk] = {}
    next_layer = 0
    for i, stage in enumerate(stages):
        count = stage.count("t")
        chunks[(i % pp, i // pp)] = tuple(range(next_layer, next_layer + count))
        next_layer += count
    return tuple(tuple(chunks[(rank, v)] for v in range(vpp)) for rank in range(pp))


LayerKind = tuple[Block, ...]


def mtp_rank(spec: ModelSpec, pp: int, split: PipelineSplit | None = None) -> int | None:
    """The pipeline rank holding the multi-token-prediction layers (None: the model has none): the one whose stage
    has the ``m`` of a layout string, else the last (multi_token_prediction.py ``mtp_on_this_rank``)."""
    if not spec.mtp_num_layers:
        return None
    if split is not None and split.layout is not None:
        stages = parse_layout(split.layout, pp)
        return next((i % pp for i, stage in enumerate(stages) if "m" in stage), pp - 1)
    return pp - 1


@lru_cache(maxsize=4096)
def stage_layer_kinds(
    spec: ModelSpec, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
    split: PipelineSplit | None = None,
) -> tuple[tuple[tuple[LayerKind, int], ...], ...]:
    """For each pipeline rank, how many layers of each kind (its tuple of blocks) it holds over all its virtual
    stages, its multi-token-prediction layers included (each runs a transformer layer of the last decoder layer's
    kind: its weights, activations and compute). Estimating per kind instead of per layer keeps ``estimate`` fast
    on 50-layer hybrid models."""
    out = []
    holder = mtp_rank(spec, pp, split)
    for rank, rank_chunks in enumerate(stage_layers(spec.num_layers, pp, vpp, first, last, split)):
        kinds = Counter(spec.layer_blocks[i] for chunk in rank_chunks for i in chunk)
        if rank == holder:
            kinds[spec.layer_blocks[-1]] += spec.mtp_num_layers
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
    """(account_for_embedding, account_for_loss) that make ``layers`` split over PP x VPP, both preferred (NVIDIA's
    recipes: Llama-3.1-405B's 126 layers + 2 on PP8 x VPP8 give 2 per virtual stage, 1 beside the embedding and 1
    beside the loss); None when none does. A virtual stage may hold only the embedding or only the loss, as
    megatron-core's ``get_num_layers_to_build`` allows (30 layers + 2 on PP4 x VPP8: one slot per virtual stage)."""
    for embedding, loss in ((True, True), (True, False), (False, True)):
        slots = layers + embedding + loss
        if slots % pp == 0 and (slots // pp) % vpp == 0:
            return embedding, loss
    return None


def with_pipeline_split(layout: Layout, model: ModelSpec) -> Layout:
    """The layout with Megatron's pipeline split filled in when the layers do not divide by PP x VPP and the layout
    names no split itself: the uneven first/last stage sizes (27 layers on PP2: 14/13), else the embedding and the
    loss accounted as layers (126 layers on PP8 x VPP8). A layout string with VPP left at 1 gets the VPP it sets
    (stages / PP, as Megatron derives it); a VPP given besides that the string contradicts is the rules' to refuse."""
    if layout.pipeline_layout is not None and layout.vpp == 1:
        try:
            stages = len(parse_layout(layout.pipeline_layout, layout.pp))
        except ValueError:
            return layout
        return replace(layout, vpp=stages // layout.pp)
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
