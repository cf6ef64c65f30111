"""The term table: every layout's uncalibrated memory parts and step-time terms as arrays, so a new calibration
re-predicts a whole space in one vectorised pass instead of one ``Estimator`` call per layout (issue 54).

A calibration changes factors on fixed terms: the model state's parts times ``state_factor``, forward/backward's
times ``activation_factor``, an overhead added to the reserved peak, each step-time term times its efficiency
factor. The table keeps, per pipeline stage of every layout, the nine memory parts at factor 1 (in GiB; GIB is a
power of two, so ``factor * (bytes / GIB)`` is bit for bit the estimator's ``factor * bytes / GIB``), and per layout
the step terms as columns (zero where a layout lacks a term). ``estimates`` then evaluates the estimator's own
formulas (``Estimator.__call__``, ``StageMemory``, ``StepTerms.seconds``) in the same order of operations, so its
figures equal a fresh prediction's exactly (``tests/estimate/test_term_table.py`` checks a whole space).

What a calibration may change that the table cannot follow: the MoE hot-rank factor, which sizes the activations
themselves; ``serves`` says no then, and the caller builds a new table.
"""

from __future__ import annotations

import functools
import gc
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from sweeper.estimate.calibration import DYNAMIC_KEYS, STATE_KEYS, STEP_KEYS, Calibration
from sweeper.estimate.estimator import (
    GIB_DIGITS,
    NON_TORCH_SIZES,
    PARTS,
    Estimate,
    Estimator,
    estimates_json,
    non_torch_gib,
    rounded_rows,
)
from sweeper.estimate.step_time import PP_BUBBLE, StepTerms
from sweeper.space.layout import Layout

_STATE_COLS = [PARTS.index(k) for k in STATE_KEYS]
_DYNAMIC_COLS = [PARTS.index(k) for k in DYNAMIC_KEYS]
_STEP_COLS = [PARTS.index(k) for k in STEP_KEYS]
_SCALED_BY_STATE = frozenset((*STATE_KEYS, *STEP_KEYS))  # the rest scale with the activation factor
_T = TypeVar("_T")


def _column_order(names: Sequence[Sequence[str]]) -> list[str]:
    """One order of every term name in which each layout's own terms keep their order (a sum over the columns then
    adds each layout's terms as its dict did: the zeros of the terms it lacks add nothing). Were two layouts ever to
    order two terms differently, the first seen goes first: their sums then differ from the estimator's in the last
    bit at most, and the whole-space test says so."""
    after: dict[str, set[str]] = {}
    for keys in names:
        for i, k in enumerate(keys):
            after.setdefault(k, set()).update(keys[:i])
    order: list[str] = []
    placed: set[str] = set()
    while len(order) < len(after):
        ready = [k for k in after if k not in placed and after[k] <= placed] or [k for k in after if k not in placed]
        first = min(ready, key=list(after).index)  # first seen first: a stable, readable order
        order.append(first)
        placed.add(first)
    return order


def _distinct(items: Sequence[_T]) -> tuple[list[_T], np.ndarray]:
    """The distinct objects of ``items`` by identity, first seen first, and each item's index among them: the
    estimator's memos share their values among layouts, so each is read once."""
    seen: dict[int, int] = {}
    index = [seen.setdefault(id(x), len(seen)) for x in items]
    return list({id(x): x for x in items}.values()), np.array(index, dtype=np.intp)


def _terms_matrix(dicts: Sequence[dict[str, float]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The columns (every term, in ``_column_order``), each dict as a row, and whether each row's terms are in the
    columns' order (a sum over the row's columns then adds them as ``sum`` over the dict does)."""
    # The distinct dicts of a space (a few per pipeline stage's shape) name a handful of distinct term lists: the rows
    # of each list are filled at once.
    distinct, index = _distinct(dicts)
    rows_of: dict[tuple[str, ...], list[int]] = {}
    for i, d in enumerate(distinct):
        rows_of.setdefault(tuple(d), []).append(i)
    columns = _column_order(list(rows_of))
    column = {t: j for j, t in enumerate(columns)}
    matrix = np.zeros((len(distinct), len(columns)))
    in_order = np.ones(len(distinct), dtype=bool)
    for names, rows in rows_of.items():
        if names:
            matrix[np.ix_(rows, [column[t] for t in names])] = [list(distinct[i].values()) for i in rows]
            in_order[rows] = _in_order(names, columns)
    return columns, matrix[index], in_order[index]


def _terms_matrices(terms: Sequence[StepTerms]) -> tuple[list[str], np.ndarray, list[str], np.ndarray, np.ndarray]:
    """The stage terms' columns and matrix, the step terms', and the rows whose stage or step terms are in another
    order than the columns (``_priced`` prices those one by one)."""
    stage_names, stage_matrix, stage_in_order = _terms_matrix([t.stage for t in terms])
    step_names, step_matrix, step_in_order = _terms_matrix([t.step for t in terms])
    return stage_names, stage_matrix, step_names, step_matrix, np.flatnonzero(~(stage_in_order & step_in_order))


def _stage_rows(blocks: Sequence[tuple[tuple[float, ...], ...]], width: int, owner: np.ndarray, rank: np.ndarray,
                ) -> np.ndarray:
    """Stage ``rank`` of layout ``owner`` of each row, from ``blocks``: each layout's rows of ``width`` values, a
    tuple per stage."""
    distinct, index = _distinct(blocks)
    lengths = np.array([len(block) for block in distinct], dtype=np.intp)
    values = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(distinct)), float,
                         int(lengths.sum()) * width).reshape(-1, width)
    return values[(np.cumsum(lengths) - lengths)[index][owner] + rank]


def _non_torch(layouts: Sequence[Layout], estimator: Estimator) -> np.ndarray:
    """``non_torch_gib`` of each layout, worked out once per value of the sizes it reads."""
    kept: dict[tuple, float] = {}
    out = []
    for lo in layouts:
        key = NON_TORCH_SIZES(lo)
        value = kept.get(key)
        if value is None:
            value = kept[key] = non_torch_gib(lo, estimator.constants)
        out.append(value)
    return np.array(out, dtype=float)


def _in_order(names: Sequence[str], columns: Sequence[str]) -> bool:
    at = [columns.index(t) for t in names]
    return at == sorted(at)


def _weighted_sum(matrix: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """``sum(f[t] * x[t] for t in terms)`` per row, column by column as Python's ``sum`` adds them."""
    total = np.zeros(matrix.shape[0])
    for j in range(matrix.shape[1]):
        total = total + factors[j] * matrix[:, j]
    return total


@contextmanager
def without_cycle_collection() -> Iterator[None]:
    """Python's cycle collector paused: making tens of thousands of Estimates and plan entries (none of them in a
    cycle) starts it, and its full pass walks the driver's whole heap (1.2 million objects on the DeepSeek-V3 space:
    1.0 s of a 1.25 s re-prediction, 0.26 s without it)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(frozen=True)
class TermTable:
    """The valid layouts of a space with their memory parts (one row per pipeline stage) and step-time terms."""

    layouts: tuple[Layout, ...]
    hot_rank_factor: float  # the MoE hot-rank factor the activations were sized with
    fragmentation: float
    band_divisors: tuple[float, float]  # memory_band's: the band's ends are the worst peak over these
    limit_gib: float
    # Per stage row: the nine parts at factor 1 (GiB), micro-batches in flight, pipeline rank, owning layout.
    parts: np.ndarray  # (stages, 9)
    in_flight: np.ndarray
    rank: np.ndarray
    owner: np.ndarray
    first_stage: np.ndarray  # (layouts,) index of each layout's first stage row
    non_torch: np.ndarray  # (layouts,)
    stage_terms: tuple[str, ...]
    stage_matrix: np.ndarray  # (layouts, stage terms): seconds per micro-batch of the slowest stage
    step_terms_names: tuple[str, ...]
    step_matrix: np.ndarray  # (layouts, step terms): seconds once per step
    microbatches: np.ndarray
    bubble_slots: np.ndarray
    tokens: np.ndarray  # tokens per step (global batch x sequence)
    terms: tuple[StepTerms, ...]  # each layout's own, handed on in its Estimate
    unordered: np.ndarray  # the layouts whose stage or step terms are in another order than the columns (``_priced``)

    @classmethod
    def build(cls, estimator: Estimator, layouts: Sequence[Layout]) -> TermTable:
        """The table of ``layouts`` (valid ones: their sizes divide) under ``estimator``'s model and settings."""
        states, dynamics, terms = zip(*map(estimator.terms, layouts)) if layouts else ((), (), ())
        counts = np.array([len(block) for block in states], dtype=np.intp)
        first = np.cumsum(counts) - counts
        owner = np.repeat(np.arange(len(layouts), dtype=np.intp), counts)
        rank = np.arange(len(owner)) - first[owner]
        # The model state's parts and (in flight, a layer's activations, then the dynamic parts): Estimator.terms
        dynamic = _stage_rows(dynamics, 2 + len(DYNAMIC_KEYS), owner, rank)
        parts = np.hstack([_stage_rows(states, len(PARTS) - len(DYNAMIC_KEYS), owner, rank), dynamic[:, 2:]])
        stage_names, stage_matrix, step_names, step_matrix, unordered = _terms_matrices(terms)
        constants = estimator.constants
        return cls(
            layouts=tuple(layouts), hot_rank_factor=estimator.hot_rank_factor(estimator.calibration),
            fragmentation=constants.allocator_fragmentation,
            band_divisors=(1 + constants.memory_over_prediction, 1 - constants.memory_under_prediction),
            limit_gib=estimator.limit_gib,
            parts=parts, in_flight=dynamic[:, 0].copy(), rank=rank, owner=owner, first_stage=first,
            non_torch=_non_torch(layouts, estimator),
            stage_terms=tuple(stage_names), stage_matrix=stage_matrix, step_terms_names=tuple(step_names),
            step_matrix=step_matrix, microbatches=np.array([t.microbatches for t in terms], dtype=float),
            bubble_slots=np.array([t.bubble_slots for t in terms]),
            tokens=np.array([lo.gbs * estimator.seq_length for lo in layouts], dtype=float), terms=tuple(terms),
            unordered=unordered,
        )

    @property
    def terms_in_column_order(self) -> bool:
        """Every layout's stage and step terms are in the columns' order (``_column_order``): its per-step terms can
        then be read off the matrices in the order its ``StepTerms.per_step`` lists them."""
        return not len(self.unordered)

    def serves(self, estimator: Estimator, calibration: Calibration | None) -> bool:
        """The table can re-predict under ``calibration``: the activations were sized with its hot-rank factor."""
        return estimator.hot_rank_factor(calibration) == self.hot_rank_factor

    def estimates(self, calibration: Calibration | None) -> list[Estimate]:
        """Every layout's ``Estimate`` under ``calibration``, equal to what ``Estimator`` (recalibrated) predicts."""
        predicted = self.predict(calibration)
        with without_cycle_collection():
            return predicted.estimates()

    def predict(self, calibration: Calibration | None) -> Predictions:
        """Every layout's prediction under ``calibration`` as arrays, its ``Estimate`` made only when asked for: a
        sweep looks at the figures of all of them (memory verdicts) but at the Estimates of a few (issue 54)."""
        cal = calibration or Calibration()
        factors = np.array([cal.state_factor if k in _SCALED_BY_STATE else cal.activation_factor for k in PARTS])
        parts = factors * self.parts  # (f * bytes / GIB) exactly: GIB is a power of two
        state = _weighted_sum(parts[:, _STATE_COLS], np.ones(len(_STATE_COLS)))
        dynamic = np.maximum(_weighted_sum(parts[:, _DYNAMIC_COLS], np.ones(len(_DYNAMIC_COLS))),
                             _weighted_sum(parts[:, _STEP_COLS], np.ones(len(_STEP_COLS))))
        allocated = state + dynamic
        reserved = state + self.fragmentation * dynamic
        if calibration is not None:
            reserved = reserved + calibration.overhead_gib
        # The worst stage: the first with the largest reserved peak (the estimator keeps the first on a tie).
        worst_reserved = np.maximum.reduceat(reserved, self.first_stage)
        is_worst = reserved == worst_reserved[self.owner]
        worst = np.minimum.reduceat(np.where(is_worst, np.arange(len(reserved)), len(reserved)), self.first_stage)

        seconds, per_microbatch, step_f, step_u = _priced(self.stage_terms, self.stage_matrix, self.step_terms_names,
                                                          self.step_matrix, self.microbatches, self.bubble_slots, cal,
                                                          self.terms, self.unordered)
        with np.errstate(divide="ignore"):
            tokens_per_s = self.tokens / seconds

        def per_step() -> np.ndarray | None:  # StepTerms.per_step as columns: the stage's, the bubble, the step's
            if not self.terms_in_column_order:
                return None
            return np.column_stack([self.stage_matrix * step_f * self.microbatches[:, None],
                                    cal.step_factor(PP_BUBBLE) * self.bubble_slots * per_microbatch,
                                    self.step_matrix * step_u])

        low, high = worst_reserved / self.band_divisors[0], worst_reserved / self.band_divisors[1]
        return Predictions(
            memory_gib=worst_reserved, band_low=low, band_high=high,
            fits=worst_reserved + self.non_torch <= self.limit_gib, may_fit=low + self.non_torch <= self.limit_gib,
            worst_parts=parts[worst], fragmentation=reserved[worst] - allocated[worst], non_torch=self.non_torch,
            rank=self.rank[worst], in_flight=self.in_flight[worst], step_time_s=seconds, tokens_per_s=tokens_per_s,
            terms=self.terms, step_factor=StepFactors(cal),
            per_step_names=(*self.stage_terms, PP_BUBBLE, *self.step_terms_names),
            per_step=functools.cache(per_step))  # made when JSON is asked for, not on every re-prediction


def _priced(stage_terms: Sequence[str], stage_matrix: np.ndarray, step_terms: Sequence[str], step_matrix: np.ndarray,
            microbatches: np.ndarray, bubble_slots: np.ndarray, cal: Calibration, terms: Sequence[StepTerms],
            unordered: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``StepTerms.seconds`` under ``cal``'s step factors of each row of the terms' matrices (``terms``: each row's
    own), in its order of operations; with the slowest stage's seconds per micro-batch and the factors of the
    stage's and the step's columns. The rows in ``unordered`` list their terms in another order than the columns: a
    sum over the columns could round otherwise than theirs (1 ULP in 491 of a 129,024-layout space's step times), so
    those are priced one by one."""
    step_f = np.array([cal.step_factor(t) for t in stage_terms])
    per_microbatch = _weighted_sum(stage_matrix, step_f)
    slots = microbatches + cal.step_factor(PP_BUBBLE) * bubble_slots
    step_u = np.array([cal.step_factor(t) for t in step_terms])
    seconds = per_microbatch * slots + _weighted_sum(step_matrix, step_u)
    for i in unordered.tolist():
        per_microbatch[i] = sum(cal.step_factor(t) * s for t, s in terms[i].stage.items())
        seconds[i] = terms[i].seconds(cal.step_factor)
    return seconds, per_microbatch, step_f, step_u


def step_seconds(terms: Sequence[StepTerms], calibration: Calibration | None) -> np.ndarray:
    """``[t.seconds(cal.step_factor) for t in terms]`` (``cal``: ``calibration``, or none's factors) as one array, the
    terms priced a column at a time: a plan's table orders every valid layout by its production step (issue 54)."""
    stage_terms, stage_matrix, step_terms, step_matrix, unordered = _terms_matrices(terms)
    return _priced(stage_terms, stage_matrix, step_terms, step_matrix,
                   np.array([t.microbatches for t in terms], dtype=float),
                   np.array([t.bubble_slots for t in terms], dtype=float), calibration or Calibration(), terms,
                   unordered)[0]


# The memory breakdown's sizes in the order an Estimate lists them (its bookkeeping entries, a pipeline rank and a
# count, after them): ``Predictions.parts_gib``'s columns.
BREAKDOWN_SIZES = (*PARTS, "fragmentation", "non_torch")


@dataclass(frozen=True)
class StepFactors:
    """``calibration.step_factor``, each term's asked once (a layout's JSON asks it per term). A plain value, not a
    ``functools.cache`` of the method: the Estimates that carry it pickle (``plan``'s workers send them back)."""

    calibration: Calibration
    known: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, term: str) -> float:
        factor = self.known.get(term)
        if factor is None:
            factor = self.known[term] = self.calibration.step_factor(term)
        return factor


@dataclass(frozen=True)
class Predictions:
    """A table's layouts under one calibration: the figures as arrays (row i: the table's i-th layout), and
    ``estimate(i)`` the i-th layout's ``Estimate``, equal to the estimator's."""

    memory_gib: np.ndarray  # the worst stage's reserved peak
    band_low: np.ndarray
    band_high: np.ndarray
    fits: np.ndarray
    may_fit: np.ndarray
    worst_parts: np.ndarray  # (layouts, 9): the worst stage's parts
    fragmentation: np.ndarray
    non_torch: np.ndarray
    rank: np.ndarray
    in_flight: np.ndarray
    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    terms: tuple[StepTerms, ...]
    step_factor: Callable[[str], float]
    # Each layout's ``StepTerms.per_step`` (calibrated seconds per step of every term, zero where it has none) as
    # columns of these names; None where some layout orders its terms otherwise (``TermTable.terms_in_column_order``)
    per_step_names: tuple[str, ...]
    per_step: Callable[[], np.ndarray | None]

    def parts_gib(self) -> np.ndarray:
        """(layouts, ``BREAKDOWN_SIZES``): each layout's memory breakdown in GiB, the figures its Estimate has."""
        return np.column_stack([self.worst_parts, self.fragmentation, self.non_torch])

    def estimate(self, i: int) -> Estimate:
        """The i-th layout's ``Estimate``."""
        return self.estimates_of([i])[0]

    def estimates(self) -> list[Estimate]:
        """Every layout's ``Estimate``, in the table's order."""
        return self.estimates_of(range(len(self.terms)))

    def estimates_of(self, rows: Sequence[int]) -> list[Estimate]:
        """The ``Estimate`` of each layout in ``rows`` (indices into the table), in that order."""
        index = np.asarray(rows, dtype=np.intp)
        # Plain Python values for the Estimates (a list per column is far faster to walk than numpy scalars).
        columns = [a[index].tolist() for a in (self.worst_parts, self.fragmentation, self.non_torch, self.rank,
                                               self.in_flight, self.memory_gib, self.band_low, self.band_high,
                                               self.fits, self.may_fit, self.step_time_s, self.tokens_per_s)]
        return list(itertools.starmap(self._estimate, zip(*columns, [self.terms[i] for i in rows])))

    def json_of(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        """``Estimate.to_json`` of each layout in ``rows``, in that order, made from the arrays a column at a time:
        a plan writes every valid layout's (issue 54)."""
        per_step = self.per_step()
        if per_step is None:
            return [e.to_json() for e in self.estimates_of(rows)]
        index = np.asarray(rows, dtype=np.intp)
        seconds = self.step_time_s[index]
        return estimates_json(
            memory=self.memory_gib[index], breakdown=rounded_rows(BREAKDOWN_SIZES, self.parts_gib()[index], GIB_DIGITS),
            allocated=_weighted_sum(self.worst_parts[index], np.ones(len(PARTS))),  # as Estimate.to_json sums
            fits=self.fits[index].tolist(), step_time=seconds, terms=self._terms_json(per_step[index]),
            tokens=np.where(seconds > 0, self.tokens_per_s[index], np.nan), band_low=self.band_low[index],
            band_high=self.band_high[index], may_fit=self.may_fit[index].tolist())

    def _terms_json(self, per_step: np.ndarray) -> list[dict[str, float]]:
        """Each row's positive terms (what ``StepTerms.per_step`` keeps), rounded: the rows of one set of terms at a
        time (a space's layouts have a handful)."""
        out: list[dict[str, float]] = [{}] * len(per_step)
        positive = per_step > 0
        # Each row's set of terms as one integer (a bit per column; a space has a few dozen terms at most), whose
        # distinct values np.unique finds far faster than distinct rows of the boolean matrix.
        bits = np.packbits(positive, axis=1, bitorder="little")
        codes: np.ndarray
        if bits.shape[1] <= 8:
            codes = np.zeros(len(per_step), dtype=np.uint64)
            for byte in range(bits.shape[1]):
                codes |= bits[:, byte].astype(np.uint64) << np.uint64(8 * byte)
        else:  # more terms than a code holds: the rows themselves
            codes = np.unique(positive, axis=0, return_inverse=True)[1].ravel()
        _, first, which = np.unique(codes, return_index=True, return_inverse=True)
        for p, row in enumerate(first.tolist()):
            members, columns = np.flatnonzero(which == p), np.flatnonzero(positive[row])
            names = [self.per_step_names[j] for j in columns]
            for i, terms in zip(members.tolist(), rounded_rows(names, per_step[np.ix_(members, columns)])):
                out[i] = terms
        return out

    def _estimate(self, row: list[float], frag: float, non_torch: float, rank: int, flight: float, mem: float,
                  lo: float, hi: float, fit: bool, may: bool, sec: float, tps: float, terms: StepTerms) -> Estimate:
        breakdown = dict(zip(PARTS, row))
        breakdown.update(fragmentation=frag, non_torch=non_torch, pipeline_rank=float(rank),
                         in_flight_microbatches=flight)
        return Estimate(memory_gib=mem, fits=fit, step_time_s=sec, tokens_per_s=tps if sec > 0 else None,
                        breakdown=breakdown, memory_band_gib=(lo, hi), may_fit=may, step_terms=terms,
                        step_factor=self.step_factor)
