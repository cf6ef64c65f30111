"""How a proxy trial runs a layout: on the fewest ranks and micro-batches that still exercise the layout's groups.

A proxy trial proves a layout's distributed mechanics (models/proxy.py), and on the CPU backend its time goes to
per-rank and per-micro-batch work, not to the tiny GEMMs: each micro-batch of each rank costs the same Python and
gloo overhead whatever its width. So a proxy trial keeps every model-parallel size of the layout (TP, PP, VPP, CP,
EP, ETP, SP, the micro-batch size, precision, recompute, FSDP) and shrinks only what repeats the same mechanics:

- data parallelism to the smallest divisor of DP that keeps a DP group (DP >= 2 when the layout has one, so the
  gradient all-reduce or reduce-scatter and the distributed optimizer's sharding still run), that the expert
  layout still divides (EP x ETP divides TP x CP x DP), and that keeps an expert-data-parallel group when the
  layout has one (EDP >= 2: the expert gradients' own reduction);
- the micro-batches per rank and step to max(2, PP): gradient accumulation over micro-batches and every phase of
  the pipeline schedule (warm-up, steady 1F1B, cool-down; the interleaved schedule needs PP of them) still run.

The equivalence gate, the checkpoint save and reload and the replica check run as in any trial; the trial's
record keeps the sweep's layout and notes the ranks and micro-batches that ran.
"""

from __future__ import annotations

from dataclasses import replace

from sweeper.space.layout import Layout

MIN_MICRO_BATCHES = 2  # gradient accumulation needs two


def proxy_run_layout(layout: Layout) -> Layout:
    """The layout a proxy trial runs for ``layout`` (itself when nothing can shrink)."""
    dp, edp = layout.dp, layout.edp
    if not dp or not edp or not layout.num_microbatches:
        return layout  # not a valid layout: the rules say so, on the layout as written
    expert = layout.ep * layout.etp
    dense = layout.tp * layout.cp
    run_dp = next(d for d in range(1, dp + 1) if dp % d == 0 and d >= min(dp, 2) and (dense * d) % expert == 0
                  and dense * d // expert >= min(edp, 2))
    micro_batches = min(layout.num_microbatches, max(MIN_MICRO_BATCHES, layout.pp))
    return replace(layout, world_size=layout.model_parallel * run_dp, gbs=run_dp * layout.mbs * micro_batches)


def proxy_run_note(layout: Layout) -> str | None:
    """The line a proxy trial's record carries when it ran fewer ranks or micro-batches than ``layout``."""
    run = proxy_run_layout(layout)
    if run == layout:
        return None
    ranks = (f"{run.world_size} ranks (DP {run.dp}, EDP {run.edp}) of the layout's {layout.world_size} (DP "
             f"{layout.dp}, EDP {layout.edp})" if run.world_size < layout.world_size else
             f"all {layout.world_size} ranks")
    return (f"proxy run: {ranks}, {run.num_microbatches} micro-batches per rank and step of its "
            f"{layout.num_microbatches}; every model-parallel group of the layout ran")
