"""What measured trials decide about layouts not yet run (issue 15): dominance pruning.

Three inferences, each from a trial that ran; the first two for the layouts that differ from it in one axis only:
  - out of memory at micro-batch k: the same layout with a larger micro-batch runs out too. Everything else
    equal, model state does not change with the micro-batch and every activation term grows with it: a rank
    holds min(in-flight, micro-batches) x mbs = min(in-flight x mbs, global batch / DP) sequences' activations,
    non-decreasing in mbs (1F1B and interleaved alike), and the transient and logits buffers are per micro-batch.
  - stable without recompute: the same layout with any recompute is dominated. Recompute only re-runs forward
    work to free activations; when the layout already fits within the headroom, it costs throughput and buys
    nothing (every objective sweeper offers is a throughput).
  - stable on W GPUs: the layouts the production run runs alike on fewer GPUs (TP1-DP8 on 8 GPUs when TP1-DP16 on
    16 was stable: both are TP1-DP1024 on 1,024) are dominated (issue 53). They are one candidate, and the trial of
    the largest W stands for it (``decide.candidates``): a smaller twin's run would only add a more projected figure.
Each dominated layout is listed with its reason and the trial that decided it (``sweep.json`` ``dominated``, the
report), like the layouts pruned on memory, and is never proposed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout


@dataclass(frozen=True)
class Decided:
    number: int  # the sweeper trial that decided it
    layout: str  # its short name
    mbs: int = 0
    gpus: int = 0


class Dominance:
    def __init__(self, production: Callable[[Layout], Layout | None] | None = None) -> None:
        """``production``: the layout as the production run runs it (``SweepConfig.production_layout``); None: the
        twin inference is off."""
        self.production = production
        self._twins: dict[Layout, Decided] = {}  # production layout -> its stable trial of the largest W
        self._oom: dict[Layout, Decided] = {}  # layout with mbs=1 -> the smallest micro-batch measured OOM
        self._plain: dict[Layout, Decided] = {}  # layout with recompute=none -> a stable trial of it
        # layout -> (it with mbs=1, it with recompute=none, its production layout): the frontier asks every candidate
        # on every event, and building a Layout (validated) for each cost seconds per event on a 1,024-GPU space
        self._variants: dict[Layout, tuple[Layout, Layout, Layout | None]] = {}

    def add(self, number: int, layout: Layout, result: TrialResult, stable: bool) -> bool:
        """Learn from one recorded trial; True when it dominates layouts it did not before."""
        if result.failure_kind == "oom":
            key = replace(layout, mbs=1)
            known = self._oom.get(key)
            if known is None or layout.mbs < known.mbs:
                self._oom[key] = Decided(number, layout.short(), layout.mbs)
                return True
        if not stable:
            return False
        changed = False
        if layout.recompute == "none" and layout not in self._plain:
            self._plain[layout] = Decided(number, layout.short())
            changed = True
        twin = self._variants_of(layout)[2]
        if twin is not None:
            known = self._twins.get(twin)
            if known is None or layout.world_size > known.gpus:
                self._twins[twin] = Decided(number, layout.short(), gpus=layout.world_size)
                changed = True
        return changed

    def verdict(self, layout: Layout) -> str | None:
        """Why a measured trial makes ``layout`` not worth running, or None."""
        if not self._oom and not self._plain and not self._twins:
            return None
        variants = self._variants_of(layout)
        oom = self._oom.get(variants[0]) if self._oom else None
        if oom is not None and layout.mbs > oom.mbs:
            return (f"dominated: micro-batch {oom.mbs} of this layout ran out of memory (trial #{oom.number} "
                    f"{oom.layout}), and activations only grow with the micro-batch")
        if layout.recompute != "none" and self._plain:
            plain = self._plain.get(variants[1])
            if plain is not None:
                return (f"dominated: the same layout without recompute is stable (trial #{plain.number} "
                        f"{plain.layout}); recompute would only cost throughput")
        twin = self._twins.get(variants[2]) if self._twins and variants[2] is not None else None
        if twin is not None and twin.gpus > layout.world_size:
            return (f"dominated: the production run runs it as trial #{twin.number} {twin.layout}, stable on "
                    f"{twin.gpus} GPUs, which stands for both (less of its figure projected)")
        return None

    def _variants_of(self, layout: Layout) -> tuple[Layout, Layout, Layout | None]:
        variants = self._variants.get(layout)
        if variants is None:
            variants = self._variants[layout] = (replace(layout, mbs=1), replace(layout, recompute="none"),
                                                 self.production(layout) if self.production else None)
        return variants
