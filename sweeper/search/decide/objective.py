"""The sweep's one objective: the production run's throughput (issue 43).

A sweep compares layouts of different sizes (``space.gpus: [8, 16]``), but the user runs one of them on the
production run's N GPUs (``budget.gpus``, else the cluster's): a layout measured on W GPUs stands for the production
layout with ``N // W`` copies of it side by side, its data parallelism scaled by that many. Its projected production
throughput is the measured rate times the copies, less what the larger data parallelism costs: the estimator's step
time of the production layout over the trial layout's, added to the measured step (the DP/EDP gradient reduce over
more ranks, the distributed optimizer's smaller shard). Comparing raw tokens/s instead lets a 16-GPU layout at 1.8x
an 8-GPU one's tokens/s win, where the 8-GPU layout doubled would train faster.

The search (what Optuna is told, the refit model's proposals), the choice, the report's decision and
``best_layout.yaml`` all rank by ``objective_value``; ``search.objective: tflops_per_gpu`` is per GPU already, so
only the larger data parallelism's cost applies to it.
"""

from __future__ import annotations

from sweeper.config.schema import SweepConfig
from sweeper.errors import LayoutError
from sweeper.estimate import Estimate, Estimator
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout

# Predicted step-time differences per (estimator inputs, layout, N): candidates() re-ranks every stable record on each
# event, and the estimator is the same for the whole sweep.
_EXTRA_S: dict[tuple[str, Layout, int], float] = {}
_INPUT_KEYS: dict[int, tuple[SweepConfig, str]] = {}


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


def extra_step_s(cfg: SweepConfig, layout: Layout) -> float:
    """What the production layout's step costs over the trial layout's, as the estimator prices both (seconds)."""
    k = copies(cfg, layout)
    if k <= 1:  # the production run is the trial's layout itself, or holds none
        return 0.0
    key = (_inputs_key(cfg), layout, k)
    if key not in _EXTRA_S:
        production = production_layout(cfg, layout)
        assert production is not None
        estimator = Estimator.for_config(cfg)
        try:
            trial_s, production_s = estimator(layout).step_time_s, estimator(production).step_time_s
        except (LayoutError, ValueError):  # a layout the estimator cannot price: projected without the difference
            trial_s = production_s = None
        _EXTRA_S[key] = max(0.0, production_s - trial_s) if trial_s and production_s else 0.0
    return _EXTRA_S[key]


def _inputs_key(cfg: SweepConfig) -> str:
    """The estimator's inputs of ``cfg`` as text, serialised once per config object (a sweep asks on every event
    for every stable record; the config never changes once loaded: changes are model_copy's new objects)."""
    held = _INPUT_KEYS.get(id(cfg))
    if held is None or held[0] is not cfg:  # the config held keeps its id from being reused
        held = _INPUT_KEYS[id(cfg)] = (cfg, cfg.model_dump_json(include={"model", "cluster", "training", "estimate",
                                                                         "run"}))
    return held[1]


def production_rate(cfg: SweepConfig, layout: Layout, rate: float, step_time_s: float | None,
                    per_gpu: bool = False) -> float:
    """A trial's rate projected to the production run: times the copies for a whole-layout rate (tokens/s), as it is
    for a per-GPU one (``per_gpu``: TFLOP/s per GPU), slowed by the larger data parallelism's extra step time."""
    k = copies(cfg, layout)
    if k == 0 or rate <= 0:
        return 0.0
    slowdown = 1.0
    if step_time_s:
        slowdown = step_time_s / (step_time_s + extra_step_s(cfg, layout))
    return rate * (1 if per_gpu else k) * slowdown


def predicted_objective(cfg: SweepConfig, layout: Layout, predicted: Estimate | None) -> float | None:
    """The estimator's objective for ``layout`` on the production run (None without a prediction): what ``plan``
    shows and the frontier orders its launchable layouts by."""
    if predicted is None or not predicted.tokens_per_s or not predicted.step_time_s:
        return None
    return projected(cfg, layout, predicted.tokens_per_s, predicted.step_time_s)


def projected(cfg: SweepConfig, layout: Layout, tokens_per_s: float, step_time_s: float) -> float:
    """The objective of a trial of ``layout`` predicted to run at ``tokens_per_s`` and ``step_time_s``, projected to
    the production run as a measured one is (``objective_value``): the estimator's prediction, or the refit model's
    (``search.propose.refit``)."""
    per_gpu = cfg.search.objective == "tflops_per_gpu"  # in proportion: a space's FLOPs per token are one number
    rate = tokens_per_s / layout.world_size if per_gpu else tokens_per_s
    return production_rate(cfg, layout, rate, step_time_s, per_gpu=per_gpu)


def objective_value(result: TrialResult, cfg: SweepConfig, layout: Layout) -> float:
    """The objective of a trial of ``layout``: its measured ``search.objective`` projected to the production run."""
    measured = float(getattr(result.metrics, cfg.search.objective) or 0.0)
    return production_rate(cfg, layout, measured, result.metrics.step_time_s,
                           per_gpu=cfg.search.objective == "tflops_per_gpu")


def objective_name(cfg: SweepConfig) -> str:
    """How the outputs name the objective, e.g. ``tokens_per_s on the production run's 16 GPUs``."""
    return f"{cfg.search.objective} on the production run's {production_gpus(cfg)} GPUs"


__all__ = ["copies", "extra_step_s", "objective_name", "objective_value", "predicted_objective", "production_gpus",
           "production_layout", "production_rate", "projected"]
