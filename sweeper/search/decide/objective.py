"""The sweep's one objective: the production run's throughput (issue 43).

A sweep compares layouts of different sizes (``space.gpus: [8, 16]``), but the user runs one of them on the
production run's N GPUs (``budget.gpus``, else the cluster's): a layout measured on W GPUs stands for the production
layout with ``N // W`` copies of it side by side, its data parallelism scaled by that many. Its projected production
throughput is the measured rate times the copies, less what the larger data parallelism costs: the estimator's step
time of the production layout over the trial layout's, added to the measured step (the DP/EDP gradient reduce over
more ranks, the distributed optimizer's smaller shard). Comparing raw tokens/s instead lets a 16-GPU layout at 1.8x
an 8-GPU one's tokens/s win, where the 8-GPU layout doubled would train faster.

The difference is priced with the sweep's current calibration (issue 53: ``dp``, ``edp`` and ``pp_p2p`` are fitted
terms of ``estimate.step_fit``), handed in by whoever holds it (``run.state``'s Calibrator); without one (``plan``, a
CPU sweep whose factors are its CPU's) it is the uncalibrated estimator's. That part of the figure is projected, not
measured: ``Projection`` says how much, with the estimator's error on it (``PROJECTED_STEP_ERROR``).

The search (what Optuna is told, the refit model's proposals), the choice, the report's decision and
``best_layout.yaml`` all rank by ``objective_value``; ``search.objective: tflops_per_gpu`` is per GPU already, so
only the larger data parallelism's cost and the GPUs the copies leave idle (N not a multiple of W) apply to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sweeper.config.schema import SweepConfig
from sweeper.errors import LayoutError
from sweeper.estimate import Estimate, Estimator
from sweeper.estimate.calibration import Calibration
from sweeper.estimate.step_time import StepTerms
from sweeper.estimate.term_table import step_seconds
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout

# The estimator's median step-time error on layouts it was not fitted on (docs/benchmarks.md, "step time calibrated
# term by term": 4.2-13.5% per published group from 3 of its trials; the defaults with each family held out: 11.3%):
# the largest, as the relative error of the projected part of a production figure.
PROJECTED_STEP_ERROR = 0.135

# Predicted step-time differences per (estimator inputs, calibration, layout, N): candidates() re-ranks every stable
# record on each event; the calibration moves with each measured trial, so the memo is dropped when it grows large.
_EXTRA_S: dict[tuple[str, str, Layout, int], float] = {}
_EXTRA_S_MAX = 200_000
_ESTIMATORS: dict[tuple[str, str], Estimator] = {}  # by (estimator inputs, calibration): ``Estimator.for_config``'s
_ESTIMATORS_MAX = 64
_INPUT_KEYS: dict[int, tuple[SweepConfig, str]] = {}
# production_terms by (estimator inputs, calibration, layout): the refit proposer asks them of every untried layout.
_TERMS: dict[tuple[str, str, Layout], tuple[StepTerms, StepTerms] | None] = {}


def production_gpus(cfg: SweepConfig) -> int:
    """N: the production run's GPUs (``budget.gpus``, else the cluster's)."""
    return cfg.production_gpus


def copies(cfg: SweepConfig, layout: Layout) -> int:
    """How many copies of the layout the production run holds side by side (0: it needs more GPUs than N)."""
    return cfg.copies(layout.world_size)


def production_layout(cfg: SweepConfig, layout: Layout) -> Layout | None:
    """The layout as the production run runs it: ``copies`` times the data parallelism, each data-parallel rank
    with the trial's micro-batches: the global batch scaled alike, which is the production run's when the trial
    ran its share of it (``SweepConfig.trial_global_batch``); None when N holds no copy."""
    return cfg.production_layout(layout)


def production_terms(cfg: SweepConfig, layout: Layout, calibration: Calibration | None = None,
                     ) -> tuple[StepTerms, StepTerms] | None:
    """The estimator's uncalibrated step-time terms of a trial of ``layout`` and of its production layout: what
    ``extra_step_s`` prices under the sweep's calibration, and the refit proposer under its own factors. None where the
    production run is the trial's layout itself or holds none, or the estimator cannot price them. ``calibration``
    matters to the terms only through the MoE hot-rank factor (an offloaded layer's activations)."""
    if copies(cfg, layout) <= 1:
        return None
    inputs, calibrated = _inputs_key(cfg), repr(calibration)
    key = (inputs, calibrated, layout)
    if key in _TERMS:
        return _TERMS[key]
    if len(_TERMS) > _EXTRA_S_MAX:
        _TERMS.clear()
    production = production_layout(cfg, layout)
    assert production is not None
    estimator = _ESTIMATORS.get((inputs, calibrated))
    if estimator is None:
        if len(_ESTIMATORS) > _ESTIMATORS_MAX:
            _ESTIMATORS.clear()
        estimator = _ESTIMATORS[(inputs, calibrated)] = Estimator.for_config(cfg, calibration)
    try:
        terms: tuple[StepTerms, StepTerms] | None = estimator.step_terms(layout), estimator.step_terms(production)
    except (LayoutError, ValueError):  # a layout the estimator cannot price: projected without the difference
        terms = None
    _TERMS[key] = terms
    return terms


def extra_step_s(cfg: SweepConfig, layout: Layout, calibration: Calibration | None = None) -> float:
    """What the production layout's step costs over the trial layout's, as the estimator prices both (seconds),
    under ``calibration`` (the sweep's current one; None: uncalibrated)."""
    k = copies(cfg, layout)
    if k <= 1:  # the production run is the trial's layout itself, or holds none
        return 0.0
    key = (_inputs_key(cfg), repr(calibration), layout, k)
    if key not in _EXTRA_S:
        if len(_EXTRA_S) > _EXTRA_S_MAX:
            _EXTRA_S.clear()
        terms = production_terms(cfg, layout, calibration)
        factor = (calibration or Calibration()).step_factor  # as the estimator so calibrated prices its terms
        trial_s, production_s = (terms[0].seconds(factor), terms[1].seconds(factor)) if terms else (0.0, 0.0)
        _EXTRA_S[key] = _difference(trial_s, production_s)
    return _EXTRA_S[key]


def _difference(trial_s: float, production_s: float) -> float:
    """What the production step costs over the trial's: nothing where either step could not be priced."""
    return max(0.0, production_s - trial_s) if trial_s and production_s else 0.0


def extra_steps_s(cfg: SweepConfig, layouts: Sequence[Layout], calibration: Calibration | None = None) -> list[float]:
    """``extra_step_s`` of each of ``layouts``, equal to it layout by layout: their trial and production step terms
    priced as arrays (a plan's table orders every valid layout by its objective: 53,739 on DeepSeek-V3)."""
    inputs, calibrated = _inputs_key(cfg), repr(calibration)
    out = [0.0] * len(layouts)
    keys: list[tuple[str, str, Layout, int]] = []  # of the layouts not priced yet (extra_step_s's memo)
    rows: list[int] = []
    for i, layout in enumerate(layouts):
        k = copies(cfg, layout)
        if k > 1:
            key = (inputs, calibrated, layout, k)
            kept = _EXTRA_S.get(key)
            if kept is None:
                keys.append(key)
                rows.append(i)
            else:
                out[i] = kept
    if len(_EXTRA_S) + len(keys) > _EXTRA_S_MAX:
        _EXTRA_S.clear()
    priced: list[int] = []
    trials: list[StepTerms] = []
    productions: list[StepTerms] = []
    for j, i in enumerate(rows):
        terms = production_terms(cfg, layouts[i], calibration)
        if terms is None:  # one the estimator cannot price: no difference, as extra_step_s
            _EXTRA_S[keys[j]] = 0.0
        else:
            priced.append(j)
            trials.append(terms[0])
            productions.append(terms[1])
    trial_s, production_s = step_seconds(trials, calibration).tolist(), step_seconds(productions, calibration).tolist()
    for j, trial, production in zip(priced, trial_s, production_s):
        out[rows[j]] = _EXTRA_S[keys[j]] = _difference(trial, production)
    return out


def _inputs_key(cfg: SweepConfig) -> str:
    """The estimator's inputs of ``cfg`` as text, serialised once per config object (a sweep asks on every event
    for every stable record; the config never changes once loaded: changes are model_copy's new objects)."""
    held = _INPUT_KEYS.get(id(cfg))
    if held is None or held[0] is not cfg:  # the config held keeps its id from being reused
        held = _INPUT_KEYS[id(cfg)] = (cfg, cfg.model_dump_json(include={"model", "cluster", "training", "estimate",
                                                                         "run"}))
    return held[1]


@dataclass(frozen=True)
class Projection:
    """A trial's step on the production run: the part its run measured (on its own W GPUs) and the part the
    estimator priced (the larger data parallelism, ``extra_step_s``), with that part's error."""

    measured_step_s: float
    projected_step_s: float
    calibrated: bool  # the projected part was priced with the sweep's calibration

    @property
    def step_s(self) -> float:
        return self.measured_step_s + self.projected_step_s

    @property
    def projected_share(self) -> float:
        """How much of the production step (and so of its rate) is the estimator's, not measured."""
        return self.projected_step_s / self.step_s if self.step_s > 0 else 0.0

    def band(self, rate: float) -> tuple[float, float]:
        """``rate`` (the projection at this step) with the projected part ``PROJECTED_STEP_ERROR`` slower, faster."""
        low, high = (self.step_s / (self.measured_step_s + self.projected_step_s * (1 + sign * PROJECTED_STEP_ERROR))
                     for sign in (1, -1))
        return rate * low, rate * high


def projection(cfg: SweepConfig, layout: Layout, step_time_s: float,
               calibration: Calibration | None = None) -> Projection:
    """How the production step of a trial of ``layout`` that measured ``step_time_s`` is made up."""
    calibrated = calibration is not None and bool(calibration.step_term_factors or calibration.samples)
    return Projection(step_time_s, extra_step_s(cfg, layout, calibration), calibrated)


def production_rate(cfg: SweepConfig, layout: Layout, rate: float, step_time_s: float | None,
                    per_gpu: bool = False, calibration: Calibration | None = None,
                    extra_s: float | None = None) -> float:
    """A trial's rate projected to the production run: times the copies for a whole-layout rate (tokens/s), times
    the share of the N GPUs the copies use for a per-GPU one (``per_gpu``: TFLOP/s per GPU, the idle GPUs counted),
    slowed by the larger data parallelism's extra step time (priced under ``calibration``; ``extra_s``: that time,
    when the caller priced it already, ``extra_steps_s``)."""
    k = copies(cfg, layout)
    if k == 0 or rate <= 0:
        return 0.0
    slowdown = 1.0
    if step_time_s:
        extra = extra_step_s(cfg, layout, calibration) if extra_s is None else extra_s
        slowdown = step_time_s / (step_time_s + extra)
    scale = k * layout.world_size / production_gpus(cfg) if per_gpu else k
    return rate * scale * slowdown


def predicted_objective(cfg: SweepConfig, layout: Layout, predicted: Estimate | None) -> float | None:
    """The estimator's objective for ``layout`` on the production run (None without a prediction): what ``plan``
    shows and the frontier orders its launchable layouts by."""
    if predicted is None or not predicted.tokens_per_s or not predicted.step_time_s:
        return None
    return projected(cfg, layout, predicted.tokens_per_s, predicted.step_time_s)


def predicted_objectives(cfg: SweepConfig, layouts: Sequence[Layout],
                         predictions: Sequence[Estimate | None]) -> list[float | None]:
    """``predicted_objective`` of each layout with its prediction, equal to it one by one, the production runs' extra
    step times priced together (``extra_steps_s``)."""
    out: list[float | None] = [None] * len(layouts)
    rows = [i for i, p in enumerate(predictions) if p is not None and p.tokens_per_s and p.step_time_s]
    for i, extra in zip(rows, extra_steps_s(cfg, [layouts[i] for i in rows])):
        p = predictions[i]
        assert p is not None and p.tokens_per_s is not None and p.step_time_s is not None
        out[i] = projected(cfg, layouts[i], p.tokens_per_s, p.step_time_s, extra)
    return out


def projected(cfg: SweepConfig, layout: Layout, tokens_per_s: float, step_time_s: float,
              extra_s: float | None = None) -> float:
    """The objective of a trial of ``layout`` predicted to run at ``tokens_per_s`` and ``step_time_s``, projected to
    the production run as a measured one is (``objective_value``): the estimator's prediction, or the refit model's
    (``search.propose.refit``). ``extra_s``: ``production_rate``'s."""
    per_gpu = cfg.search.objective == "tflops_per_gpu"  # in proportion: a space's FLOPs per token are one number
    rate = tokens_per_s / layout.world_size if per_gpu else tokens_per_s
    return production_rate(cfg, layout, rate, step_time_s, per_gpu=per_gpu, extra_s=extra_s)


def objective_value(result: TrialResult, cfg: SweepConfig, layout: Layout,
                    calibration: Calibration | None = None) -> float:
    """The objective of a trial of ``layout``: its measured ``search.objective`` projected to the production run,
    the larger data parallelism priced under ``calibration`` (the sweep's current one)."""
    measured = float(getattr(result.metrics, cfg.search.objective) or 0.0)
    return production_rate(cfg, layout, measured, result.metrics.step_time_s,
                           per_gpu=cfg.search.objective == "tflops_per_gpu", calibration=calibration)


def objective_name(cfg: SweepConfig) -> str:
    """How the outputs name the objective, e.g. ``tokens_per_s on the production run's 16 GPUs``."""
    return f"{cfg.search.objective} on the production run's {production_gpus(cfg)} GPUs"


__all__ = ["PROJECTED_STEP_ERROR", "Projection", "copies", "extra_step_s", "extra_steps_s", "objective_name",
           "objective_value", "predicted_objective", "predicted_objectives", "production_gpus", "production_layout",
           "production_rate", "production_terms", "projected", "projection"]
