"""Which decoder layers land on which pipeline rank and virtual stage, exactly as Megatron-Core 0.16 places them.

GPT models follow ``get_num_layers_to_build``/``get_transformer_layer_offset``: an even split, or an uneven one
with ``num_layers_in_first/last_pipeline_stage`` and the rest spread evenly over the middle stages; with
interleaving (VPP) every stage's count is cut into VPP chunks and chunk ``v`` of every rank comes after all
chunks ``v-1``. Hybrid Mamba models (``MambaStack._select_layers_for_pipeline_parallel``) use the same counts
without VPP. Layer counts Megatron would assert on (or silently truncate, for hybrids) raise ValueError here.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from sweeper.models.spec import Block, ModelSpec

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


@lru_cache(maxsize=1024)
def stage_layers(
    num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> tuple[tuple[Chunk, ...], ...]:
    """For each pipeline rank, its virtual stages' layer indices (one chunk when VPP is 1)."""
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


LayerKind = tuple[Block, ...]


@lru_cache(maxsize=4096)
def stage_layer_kinds(
    spec: ModelSpec, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None
) -> tuple[tuple[tuple[LayerKind, int], ...], ...]:
    """For each pipeline rank, how many layers of each kind (its tuple of blocks) it holds over all its virtual
    stages. Estimating per kind instead of per layer keeps ``estimate`` fast on 50-layer hybrid models."""
    out = []
    for rank_chunks in stage_layers(spec.num_layers, pp, vpp, first, last):
        kinds = Counter(spec.layer_blocks[i] for chunk in rank_chunks for i in chunk)
        out.append(tuple(sorted(kinds.items())))
    return tuple(out)
