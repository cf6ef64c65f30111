"""What measured trials decide about layouts not yet run (issue 15): dominance pruning.

Two inferences, each from a trial that ran, for the layouts that differ from it in one axis only:
  - out of memory at micro-batch k: the same layout with a larger micro-batch runs out too. Everything else
    equal, model state does not change with the micro-batch and every activation term grows with it: a rank
    holds min(in-flight, micro-batches) x mbs = min(in-flight x mbs, global batch / DP) sequences' activations,
    non-decreasing in mbs (1F1B and interleaved alike), and the transient and logits buffers are per micro-batch.
  - stable without recompute: the same layout with any recompute is dominated. Recompute only re-runs forward
    work to free activations; when the layout already fits within the headroom, it costs throughput and buys
    nothing (every objective sweeper offers is a throughput).
Each dominated layout is listed with its reason and the trial that decided it (``sweep.json`` ``dominated``, the
report), like the layouts pruned on memory, and is never proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout


@dataclass(frozen=True)
class Decided:
    number: int  # the sweeper trial that decided it
    layout: str  # its short name
    mbs: int = 0


class Dominance:
    def __init__(self) -> None:
        self._oom: dict[Layout, Decided] = {}  # layout with mbs=1 -> the smallest micro-batch measured OOM
        self._plain: dict[Layout, Decided] = {}  # layout with recompute=none -> a stable trial of it
        # layout -> (it with mbs=1, it with recompute=none): the frontier asks every candidate on every event, and
        # building a Layout (validated) for each cost seconds per event on a 1,024-GPU space
        self._variants: dict[Layout, tuple[Layout, Layout]] = {}

    def add(self, number: int, layout: Layout, result: TrialResult, stable: bool) -> bool:
        """Learn from one recorded trial; True when it dominates layouts it did not before."""
        if result.failure_kind == "oom":
            key = replace(layout, mbs=1)
            known = self._oom.get(key)
            if known is None or layout.mbs < known.mbs:
                self._oom[key] = Decided(number, layout.short(), layout.mbs)
                return True
        elif stable and layout.recompute == "none" and layout not in self._plain:
            self._plain[layout] = Decided(number, layout.short())
            return True
        return False

    def verdict(self, layout: Layout) -> str | None:
        """Why a measured trial makes ``layout`` not worth running, or None."""
        if not self._oom and not self._plain:
            return None
        variants = self._variants.get(layout)
        if variants is None:
            variants = self._variants[layout] = (replace(layout, mbs=1), replace(layout, recompute="none"))
        oom = self._oom.get(variants[0]) if self._oom else None
        if oom is not None and layout.mbs > oom.mbs:
            return (f"dominated: micro-batch {oom.mbs} of this layout ran out of memory (trial #{oom.number} "
                    f"{oom.layout}), and activations only grow with the micro-batch")
        if layout.recompute != "none" and self._plain:
            plain = self._plain.get(variants[1])
            if plain is not None:
                return (f"dominated: the same layout without recompute is stable (trial #{plain.number} "
                        f"{plain.layout}); recompute would only cost throughput")
        return None
