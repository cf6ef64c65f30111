"""Pruning on memory under uncertainty: what the estimator's error band and the measured trials allow (issue 13).

A sweep must never throw away a layout that would have run. So a layout is pruned as out of memory only when

- even the lower end of the estimator's error band (``Estimate.memory_band_gib``, from the errors measured on
  published runs) exceeds the limit, and no measured neighbour proves it fits: a trial of the same sweep that
  passed with its device peak under the limit although its layout was predicted to need at least as much; or
- it is inside the band (predicted over the limit, but possibly fitting) and a trial of the same sweep ran out of
  memory whose layout was predicted to need no more in every part of the estimator's breakdown (weights, gradients,
  optimizer state, activations, ...), not only in total: an inferred decision, recorded with that trial's number.
  A total alone orders structurally different layouts only as well as the estimator's per-layout error (about 19%)
  allows; a layout that needs at least as much of every part needs at least as much whatever the error of each
  (issue 43).

Comparisons use the uncalibrated prediction of both layouts, so a calibration refit never reorders the evidence.
Every pruned layout is listed with its prediction, its band and the reason (``sweep.json`` ``memory_pruned``, the
report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sweeper.estimate import Estimate


def gib_parts(estimate: Estimate) -> dict[str, float]:
    """The estimate's memory breakdown in GiB (its bookkeeping entries, a pipeline rank and a count, left out)."""
    return {k: v for k, v in estimate.breakdown.items() if k not in ("pipeline_rank", "in_flight_microbatches")}


@dataclass(frozen=True)
class Measured:
    number: int
    layout: str  # Layout.short()
    predicted_gib: float  # uncalibrated prediction of its layout
    peak_gib: float | None
    parts_gib: dict[str, float] = field(default_factory=dict)  # that prediction's breakdown (GiB per part)


@dataclass
class MemoryEvidence:
    limit_gib: float  # (1 - memory_headroom) * gpu_memory_gib
    fitted: list[Measured] = field(default_factory=list)  # passed, device peak under the limit
    ran_out: list[Measured] = field(default_factory=list)  # failed with kind oom
    # The most a fitted trial and the least an OOM trial was predicted to need: every layout of the space is asked
    # on every event, and most have no proof either way (a scan of every trial each: growing with the sweep)
    _most_fitted_gib: float = field(default=-math.inf, repr=False)
    _least_oom_gib: float = field(default=math.inf, repr=False)
    # Per uncalibrated prediction (one per layout, by id): it, how many OOM (fitted) trials it was checked against
    # and the proof found. The lists only grow, so a layout is checked against the trials added since (issue 54: a
    # scan of every such trial for every layout, on every event, grew with the sweep).
    _oom_checked: dict[int, tuple[Estimate, int, Measured | None]] = field(default_factory=dict, repr=False)
    _fit_checked: dict[int, tuple[Estimate, int, Measured | None]] = field(default_factory=dict, repr=False)
    # Per uncalibrated prediction: the calibrated prediction its "exceeds the limit" line was written for, and it
    _exceeds: dict[int, tuple[Estimate, str]] = field(default_factory=dict, repr=False)

    def add(self, number: int, layout: str, raw: Estimate, result: Any) -> bool:
        """Remember a finished trial (a TrialResult) as evidence about layouts predicted near it; True when it is
        evidence (a device peak under the limit, or an OOM), so the space needs re-assessing."""
        peak = result.metrics.peak_memory_gib
        seen = Measured(number, layout, raw.memory_gib, peak, gib_parts(raw))
        if result.passed and result.memory_kind == "device" and peak is not None and peak <= self.limit_gib:
            self.fitted.append(seen)
            self._most_fitted_gib = max(self._most_fitted_gib, seen.predicted_gib)
        elif result.failure_kind == "oom":
            self.ran_out.append(seen)
            self._least_oom_gib = min(self._least_oom_gib, seen.predicted_gib)
        else:
            return False
        return True

    def proof_of_fit(self, raw: Estimate) -> Measured | None:
        """A measured trial that passed although predicted to need at least as much as ``raw``."""
        if raw.memory_gib > self._most_fitted_gib:
            return None
        kept = self._fit_checked.get(id(raw))
        checked, proof = (kept[1], kept[2]) if kept is not None and kept[0] is raw else (0, None)
        if proof is None and checked < len(self.fitted):
            proof = next((m for m in self.fitted[checked:] if m.predicted_gib >= raw.memory_gib), None)
        self._fit_checked[id(raw)] = (raw, len(self.fitted), proof)
        return proof

    def proof_of_oom(self, raw: Estimate) -> Measured | None:
        """A trial that ran out of memory although predicted to need no more than ``raw``, in total and in every part
        of the breakdown."""
        if raw.memory_gib < self._least_oom_gib:
            return None
        kept = self._oom_checked.get(id(raw))
        checked, proof = (kept[1], kept[2]) if kept is not None and kept[0] is raw else (0, None)
        if proof is None and checked < len(self.ran_out):
            parts = gib_parts(raw)
            proof = next((m for m in self.ran_out[checked:] if m.predicted_gib <= raw.memory_gib
                          and all(parts.get(k, 0.0) >= v for k, v in m.parts_gib.items())), None)
        self._oom_checked[id(raw)] = (raw, len(self.ran_out), proof)
        return proof

    def verdict(self, predicted: Estimate, raw: Estimate) -> str | None:
        """None when the layout may be launched on memory grounds, else why it is pruned (one line).
        ``predicted`` is the (calibrated) estimate the sweep uses, ``raw`` the uncalibrated one."""
        if predicted.fits:
            return None
        if predicted.may_fit:
            oom = self.proof_of_oom(raw)
            if oom is None:
                return None
            return oom_reason(predicted, oom)
        if self.proof_of_fit(raw) is not None:
            return None
        kept = self._exceeds.get(id(raw))
        if kept is None or kept[0] is not predicted:  # written again only when the calibration changed
            kept = self._exceeds[id(raw)] = (predicted, exceeds_reason(predicted, self.limit_gib))
        return kept[1]


class Proofs:
    """``MemoryEvidence``'s proofs for many layouts at once (issue 54: the frontier asks all of a space's valid
    layouts on every event): per layout, the index of the first fitted trial that proves it fits
    (``MemoryEvidence.proof_of_fit``) and of the first OOM trial that proves it does not (``proof_of_oom``), -1 where
    none does, from their uncalibrated predictions as arrays. The evidence only grows and the uncalibrated
    predictions never change, so ``update`` compares the layouts without a proof with the trials added since."""

    def __init__(self, raw_gib: np.ndarray, raw_parts: np.ndarray, part_names: Sequence[str]) -> None:
        self.raw_gib, self.raw_parts = raw_gib, raw_parts  # (layouts,), (layouts, parts)
        self.columns = {name: j for j, name in enumerate(part_names)}
        self.fit = np.full(len(raw_gib), -1, dtype=np.intp)
        self.oom = np.full(len(raw_gib), -1, dtype=np.intp)
        self._fitted, self._ran_out = 0, 0  # the trials of each list compared so far

    def update(self, evidence: MemoryEvidence) -> None:
        """Compare the layouts without a proof with the trials ``evidence`` gained since the last update."""
        for k in range(self._fitted, len(evidence.fitted)):
            m = evidence.fitted[k]
            self.fit[(self.fit < 0) & (m.predicted_gib >= self.raw_gib)] = k
        self._fitted = len(evidence.fitted)
        for k in range(self._ran_out, len(evidence.ran_out)):
            m = evidence.ran_out[k]
            proves = (self.oom < 0) & (m.predicted_gib <= self.raw_gib)
            for name, v in m.parts_gib.items():  # a part the layouts lack counts as 0.0, as proof_of_oom's get
                j = self.columns.get(name)
                proves &= (self.raw_parts[:, j] >= v) if j is not None else (0.0 >= v)
            self.oom[proves] = k
        self._ran_out = len(evidence.ran_out)


def oom_reason(predicted: Estimate, oom: Measured) -> str:
    """Why a layout inside the band is pruned: ``oom`` ran out of memory although predicted to need no more."""
    return (f"{_band(predicted)} is at least what trial #{oom.number} ({oom.layout}) was predicted to need "
            f"({oom.predicted_gib:.1f} GiB), in every part, and that trial ran out of memory (inferred)")


def exceeds_reason(predicted: Estimate, limit_gib: float) -> str:
    """Why a layout over the band is pruned (no fitted trial proves otherwise)."""
    return f"{_band(predicted)} exceeds {limit_gib:.1f} GiB even at the band's lower end"


def _band(predicted: Estimate) -> str:
    low, high = predicted.memory_band_gib
    return f"predicted {predicted.memory_gib:.1f} GiB per GPU (error band {low:.1f}-{high:.1f} GiB)"
