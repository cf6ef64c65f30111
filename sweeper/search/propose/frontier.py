"""The sweep's frontier: the candidate set and every verdict on a layout, in one object the loop asks.

A layout may be proposed when the rules accept it, memory does not rule it out (the estimator's band and the
measured trials, ``search.propose.memory_evidence``), no measured trial dominates it
(``search.propose.dominance``), the cluster's backend can run it, and it is neither decided (recorded, not as a
failure that is not the layout's) nor running.
``Frontier`` holds all of that; the loop (``search.run``) only moves layouts: next from the frontier,
reserve, launch, record, tell the frontier what the trial measured.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from sweeper.config.schema import SweepConfig
from sweeper.estimate import Estimate, Estimator
from sweeper.estimate.calibrator import Calibrator
from sweeper.estimate.term_table import BREAKDOWN_SIZES, Predictions, TermTable
from sweeper.plan.assess import PlanEntry, assess
from sweeper.plan.rules import Checker
from sweeper.plan.space import enumerate_layouts
from sweeper.record.schema import TrialRecord, TrialResult
from sweeper.search.decide.objective import predicted_objectives
from sweeper.search.decide.verdicts import NOT_THE_LAYOUTS, is_stable
from sweeper.search.propose.dominance import Dominance
from sweeper.search.propose.memory_evidence import MemoryEvidence, Proofs, exceeds_reason, oom_reason
from sweeper.space.layout import Layout
from sweeper.trial.protocol import Host

Refusal = tuple[str, str]  # (one-line reason, failure kind)
MISSING = object()  # not asked yet


def layout_key(layout: dict[str, Any]) -> tuple[Any, ...]:
    """A layout as the frontier knows it: its axes without the derived DP and EDP."""
    return tuple(sorted((k, v) for k, v in layout.items() if k not in ("dp", "edp")))


class Frontier:
    """The layouts a proposal may name (``launchable``, fastest predicted first) and why every other one may not."""

    def __init__(self, cfg: SweepConfig, handle: Host, calibrator: Calibrator, records: list[TrialRecord],
                 running: Callable[[Layout], bool]) -> None:
        self.cfg, self.handle, self.calibrator = cfg, handle, calibrator
        self._running = running
        # A resumed sweep (perhaps with sweeper fixed) runs again what failed for reasons not the layout's.
        self.decided = {layout_key(r.layout) for r in records if r.result.failure_kind not in NOT_THE_LAYOUTS}
        self.evidence = MemoryEvidence(cfg.memory_limit_gib)
        self.raw: dict[Layout, Estimate] = {}  # uncalibrated predictions, the evidence's common scale
        self.dominance = Dominance(cfg.production_layout)
        for r in records:  # a resumed sweep knows again what its measured trials decided
            if r.attempt >= 1:
                self.dominance.add(r.number, Layout.from_dict(r.layout), r.result, is_stable(r.result, cfg))
        self._layouts = enumerate_layouts(cfg)
        # Every layout with the rules' verdict (no calibration changes them) and the valid ones in the term table's
        # order (the rules pass once; a calibration re-predicts the valid layouts from the table, issue 54)
        checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
        self._judged = [assess(cfg, lo, checker=checker, predict=False) for lo in self._layouts]
        self._valid = [e.layout for e in self._judged if e.valid]
        self._index = {lo: i for i, lo in enumerate(self._valid)}
        self._plan_calibration: object = self  # no prediction made yet (never a calibration)
        self._estimator: Estimator | None = None  # the space's, under the predictions' calibration
        self._table: TermTable | None = None  # the valid layouts' terms, which a calibration only scales
        self._predictions: Predictions | None = None  # the valid layouts' figures under the current calibration
        self._entries: dict[int, PlanEntry] = {}  # plan entries made of them so far, by the layout's row
        self._plan: list[PlanEntry] | None = None  # ``assessed``, made when asked
        self._raw: Predictions | None = None  # the uncalibrated figures, the evidence's common scale
        self._proofs: Proofs | None = None  # each valid layout's memory proofs among the measured trials
        self._pruned: dict[int, tuple[Predictions, int, dict[str, Any]]] = {}  # by row: predictions, proof, JSON
        self._shorts: dict[int, str] = {}  # by row: the layout's short name, in each of its pruned elements
        # Asked of every candidate on every event (issue 54), so kept per layout: its key, the backend's answer, its
        # predicted objective under the prediction it was computed for
        self._keys: dict[Layout, tuple[Any, ...]] = {}
        # Whether each layout asked is decided (a proposal asks it of every launchable layout; hashing its key each
        # time was most of that), and the layouts asked by key, which ``decide`` marks
        self._decided: dict[Layout, bool] = {}
        self._by_key: dict[tuple[Any, ...], list[Layout]] = {}
        self._unsupported: dict[int, str | None] = {}  # by row
        self._objective: dict[int, tuple[Estimate | None, float]] = {}  # by row
        # The last assessment's pruned rows (the predictions they were judged under, the rows, each one's OOM proof
        # or -1: over the band), dominated and unsupported layouts (``verdict_lists``)
        self._verdicts: tuple[tuple[Predictions | None, list[int], list[int]], list[dict[str, Any]],
                              list[dict[str, Any]]] = (None, [], []), [], []
        self.launchable = self._launchable()

    @property
    def assessed(self) -> list[PlanEntry]:
        """Every layout of the space with its rules' verdict and prediction, as the frontier last assessed it (its
        Estimates made when asked: a sweep's events need the arrays only, issue 54)."""
        if self._plan is None:
            assert self._predictions is not None
            predicted = iter(self._predictions.estimates())
            self._plan = [e if not e.valid else PlanEntry(e.layout, e.reasons, next(predicted)) for e in self._judged]
        return self._plan

    @property
    def valid_layouts(self) -> list[Layout]:
        """The layouts of the space the rules accept, in the space's order."""
        return list(self._valid)

    def _predict(self) -> Predictions:
        """The valid layouts' predictions under the current calibration, as arrays: made again only when the
        calibration changed (a new object); a measured trial's memory evidence or dominance changes verdicts, not
        predictions. One vectorised pass over the valid layouts' term table (issue 54), the table built again only
        when the calibration changes what the terms are (the MoE hot-rank factor sizes the activations)."""
        current = self.calibrator.current
        if current is self._plan_calibration and self._predictions is not None:
            return self._predictions
        if self._estimator is None or self._table is None:
            self._estimator = Estimator.for_config(self.cfg, current)
            self._table = TermTable.build(self._estimator, self._valid)
        elif not self._table.serves(self._estimator, current):
            self._estimator = self._estimator.recalibrated(current)
            self._table = TermTable.build(self._estimator, self._table.layouts)
        if self._raw is None:  # the uncalibrated figures: from this table where its activations are those
            raw = Estimator.for_config(self.cfg)
            table = self._table if self._table.serves(raw, None) else TermTable.build(raw, self._valid)
            self._raw = table.predict(None)
            self._proofs = Proofs(self._raw.memory_gib, self._raw.parts_gib(), BREAKDOWN_SIZES)
        self._predictions = self._table.predict(current)
        self._entries, self._plan = {}, None
        self._plan_calibration = current
        return self._predictions

    def _entries_of(self, rows: list[int]) -> list[PlanEntry]:
        """The plan entries of the valid layouts at ``rows`` under the current predictions (one object per row while
        they stand: its predicted objective is kept by it), those not made yet made together."""
        missing = [row for row in rows if row not in self._entries]
        if missing:
            assert self._predictions is not None
            for row, estimate in zip(missing, self._predictions.estimates_of(missing)):
                self._entries[row] = PlanEntry(self._valid[row], [], estimate)
        return [self._entries[row] for row in rows]

    def _launchable(self) -> list[PlanEntry]:
        """The layouts a proposal may name: the rules accept them, memory does not rule them out (the estimator's
        band and the measured trials, ``sweeper.search.propose.memory_evidence``), no measured trial dominates them
        (``sweeper.search.propose.dominance``), and this backend can run them; best predicted objective first.
        Everything else is never proposed (``sweeper plan`` lists it with its reasons; the layouts pruned on memory,
        the dominated and the unsupported ones are kept for sweep.json's lists, ``verdict_lists``, and the report).
        The memory verdicts of the whole space are array operations (issue 54): ``MemoryEvidence.verdict`` for every
        valid layout at once, the layouts predicted to fit never pruned, those inside the band pruned by an OOM trial's
        proof, those over it unless a fitted trial's proof says otherwise."""
        predicted = self._predict()
        proofs = self._proofs
        assert proofs is not None
        proofs.update(self.evidence)
        band = predicted.may_fit & ~predicted.fits
        pruned_by_oom = band & (proofs.oom >= 0)
        pruned = pruned_by_oom | (~predicted.may_fit & (proofs.fit < 0))
        rows = np.flatnonzero(pruned)
        pruned_rows = (predicted, rows.tolist(), np.where(pruned_by_oom[rows], proofs.oom[rows], -1).tolist())
        rows_left: list[int] = []
        dominated: list[dict[str, Any]] = []
        unsupported: list[dict[str, Any]] = []
        for row in np.flatnonzero(~pruned).tolist():
            layout = self._valid[row]
            backend_says = self._unsupported.get(row, MISSING)
            if backend_says is MISSING:  # a backend's support of a layout is fixed for the sweep
                backend_says = self._unsupported[row] = self.handle.unsupported(self.cfg.model, layout)
            if backend_says:
                unsupported.append({"layout": layout.short(), "reason": backend_says})
                continue
            inferred = self.dominance.verdict(layout)
            if inferred is not None and not self.taken(layout):
                dominated.append({"layout": layout.short(), "reason": inferred})
            elif inferred is None:
                rows_left.append(row)
        self._verdicts = pruned_rows, dominated, unsupported
        entries = self._entries_of(rows_left)
        objectives = self._predicted_objectives(rows_left, entries)
        order = sorted(range(len(entries)), key=objectives.__getitem__, reverse=True)  # stable: ties in space order
        return [entries[i] for i in order]

    def _predicted_objectives(self, rows: list[int], entries: list[PlanEntry]) -> list[float]:
        """Each entry's predicted objective (0 when none), kept per row while its prediction is the same object; the
        others priced together (``predicted_objectives``)."""
        kept = self._objective
        new = [i for i, (row, entry) in enumerate(zip(rows, entries))
               if (held := kept.get(row)) is None or held[0] is not entry.predicted]
        values = predicted_objectives(self.cfg, [entries[i].layout for i in new], [entries[i].predicted for i in new])
        for i, value in zip(new, values):
            kept[rows[i]] = (entries[i].predicted, value or 0.0)
        return [kept[row][1] for row in rows]

    @property
    def unsupported(self) -> list[dict[str, Any]]:
        """The valid layouts this backend cannot run, ``{layout, reason}`` (sweep.json ``unsupported``)."""
        return self._verdicts[2]

    def verdict_lists(self) -> dict[str, list[dict[str, Any]]]:
        """sweep.json's per-layout lists as the frontier last assessed them: ``memory_pruned`` (least memory
        first), ``dominated``, ``unsupported``. Built when sweep.json is written, not on every event: the JSON of
        tens of thousands of pruned layouts took a second after each calibration change (issue 54)."""
        (predicted, rows, proofs), dominated, unsupported = self._verdicts
        changed = [i for i, (row, proof) in enumerate(zip(rows, proofs))
                   if not self._pruned_kept(predicted, row, proof)]
        if changed:
            assert predicted is not None
            changed_rows = [rows[i] for i in changed]
            # The Estimates for the reasons, their JSON from the arrays a column at a time (Predictions.json_of).
            for i, estimate, figures in zip(changed, predicted.estimates_of(changed_rows),
                                            predicted.json_of(changed_rows), strict=True):
                self._pruned_json(predicted, rows[i], proofs[i], estimate, figures)
        elements = [self._pruned[row][2] for row in rows]
        return {"memory_pruned": sorted(elements, key=lambda p: p["memory_gib"]), "dominated": dominated,
                "unsupported": unsupported}

    def _pruned_kept(self, predicted: Predictions | None, row: int, proof: int) -> bool:
        """Whether the kept ``memory_pruned`` element of ``row`` is for these predictions and this proof (an event
        that changes no calibration leaves tens of thousands of them as they were; issue 54)."""
        kept = self._pruned.get(row)
        return kept is not None and kept[0] is predicted and kept[1] == proof

    def _pruned_json(self, predicted: Predictions, row: int, proof: int, estimate: Estimate,
                     figures: dict[str, Any]) -> None:
        """sweep.json's ``memory_pruned`` element of the valid layout at ``row`` (predicted ``estimate``, whose JSON
        is ``figures``), pruned by the OOM trial ``proof`` (its index among the evidence's) or, -1, over the band,
        kept by row."""
        why = (oom_reason(estimate, self.evidence.ran_out[proof]) if proof >= 0
               else exceeds_reason(estimate, self.evidence.limit_gib))
        short = self._shorts.get(row)
        if short is None:
            short = self._shorts[row] = self._valid[row].short()
        element = {"layout": short, **figures, "reason": why}
        self._pruned[row] = (predicted, proof, element)

    def raw_estimate(self, layout: Layout) -> Estimate:
        """The layout's uncalibrated prediction (the memory evidence's scale): the space's own for a valid layout of
        it (equal to the estimator's, ``TermTable``), else the estimator's."""
        if layout not in self.raw:
            row = self._index.get(layout)
            predicted = self._raw.estimate(row) if row is not None and self._raw is not None else assess(
                self.cfg, layout).predicted
            assert predicted is not None, "only valid layouts are compared"
            self.raw[layout] = predicted
        return self.raw[layout]

    def memory_verdict(self, entry: PlanEntry) -> str | None:
        """None when memory does not rule the layout out, else the one-line reason it is pruned."""
        assert entry.predicted is not None
        if entry.predicted.fits:
            return None
        return self.evidence.verdict(entry.predicted, self.raw_estimate(entry.layout))

    def order(self) -> list[Layout]:
        """The launchable layouts in the order an ordered study visits them. ``sampler: grid``: the space's grid
        order (the axes' product as the YAML lists them). A budget that covers every layout: grouped by size,
        largest first (equal-size trials pack the cluster side by side instead of a large one waiting behind
        small ones), fastest predicted first within a size."""
        if self.cfg.search.sampler == "grid":
            grid = {lo: i for i, lo in enumerate(self._layouts)}
            return sorted((e.layout for e in self.launchable), key=grid.__getitem__)
        return [e.layout for e in sorted(self.launchable, key=lambda e: -e.layout.world_size)]

    def taken(self, layout: Layout) -> bool:
        """Already decided (recorded, not as an infra failure) or running / waiting for GPUs: never proposed."""
        decided = self._decided.get(layout)
        if decided is None:
            key = self._key(layout)
            decided = self._decided[layout] = key in self.decided
            self._by_key.setdefault(key, []).append(layout)
        return decided or self._running(layout)

    def decide(self, layout: Layout) -> None:
        """The layout has its verdict: never proposed again in this sweep."""
        key = self._key(layout)
        self.decided.add(key)
        for known in self._by_key.get(key, ()):
            self._decided[known] = True

    def _key(self, layout: Layout) -> tuple[Any, ...]:
        """``layout_key`` of the layout, kept (a proposal asks ``taken`` of every launchable layout)."""
        key = self._keys.get(layout)
        if key is None:
            key = self._keys[layout] = layout_key(layout.to_dict())
        return key

    def assess(self, layout: Layout) -> tuple[PlanEntry, Refusal | None]:
        """The layout's plan entry as it stands now, and why it may not run (None: it may). A valid layout of the
        space is predicted from the table (equal to the estimator's), not by a new estimator per proposal."""
        row = self._index.get(layout)
        entry = (PlanEntry(layout, [], self._predict().estimate(row)) if row is not None
                 else assess(self.cfg, layout, self.calibrator.current))
        return entry, self._refusal(entry)

    def _refusal(self, entry: PlanEntry) -> Refusal | None:
        if entry.reasons:
            return "; ".join(entry.reasons), "invalid_layout"
        why = self.memory_verdict(entry) if entry.predicted is not None else None
        if why is not None:
            return why, "oom"
        unsupported = self.handle.unsupported(self.cfg.model, entry.layout)
        if unsupported:
            return unsupported, "unsupported"
        return None

    def learn(self, number: int, layout: Layout, result: TrialResult, calibration_changed: bool) -> bool:
        """What an ended attempt proves about other layouts (memory evidence, dominance) and a changed calibration
        re-assess the space; True when the launchable set was recomputed."""
        evidence = self.evidence.add(number, layout.short(), self.raw_estimate(layout), result)
        dominates = self.dominance.add(number, layout, result, is_stable(result, self.cfg))
        if calibration_changed or evidence or dominates:
            self.launchable = self._launchable()  # what may fit follows the calibration and the measured trials
            return True
        return False


__all__ = ["Frontier", "Refusal", "layout_key"]
