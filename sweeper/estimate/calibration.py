"""Calibration: fit the estimator's uncertain parts to measured trials and persist the factors.

A measured peak is modelled as

    measured_reserved = s * state + a * fragmentation * dynamic + c

with ``state`` = weights + grads + optimizer + FP8 weight copies + workspaces and ``dynamic`` = the larger of
forward/backward's activations + transients + logits and the optimizer step's FP32 grad copies, on the predicted
worst rank. The state is not multiplied by the fragmentation: Megatron allocates it as a
few large tensors at start-up (DDP's param and grad buffers, the optimizer's shards), which the caching allocator
holds without slack (``StageMemory.reserved_gib`` uses the same model). The state's bytes follow from the
parameter counts and the run settings, but a run whose settings differ from what the YAML says (BF16 grads where
FP32 were assumed, BF16 Adam moments, FP8 weights) is off in the state, not in the activations; so ``s`` is
fitted too and can lower (or raise) the model state, not only the activations (issue 13).

How much the data can tell: with one or two samples, or samples whose state/dynamic mix does not vary, a single
ratio scales the whole prediction (``s = a``, ``c = 0``); with three, ``s`` and ``a`` apart; with four or more,
``s``, ``a`` and the fixed overhead ``c``. Linear least squares (``scipy.optimize.lsq_linear``), factors clamped
to a plausible range. Step time gets one multiplicative factor (the median ratio, robust to one slow outlier).
Factors are stored as JSON under ``"<cluster>/<model>"`` keys in a file the caller chooses, so a later sweep on the
same cluster starts calibrated.
"""

from __future__ import annotations

import errno
import fcntl
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sweeper.config.files import write_atomic
from sweeper.estimate.step_time import term_factor

# A fitted activation factor outside this range means the samples disagree with the model's structure (wrong
# recompute setting, a different optimizer); clamping keeps one bad sample from wrecking every prediction.
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0
# The model state is bytes per parameter times exact parameter counts: a run setting the YAML does not say (grad
# dtype, moment dtype, FP8 weights) moves it by at most about a factor of two either way.
MIN_STATE_FACTOR, MAX_STATE_FACTOR = 0.5, 1.5
# Samples needed to fit the state and activation factors apart, and the fixed overhead as well.
MIN_SAMPLES_FOR_SPLIT = 3
MIN_SAMPLES_FOR_OFFSET = 4
# Columns whose smallest singular value is below this share of the largest are taken as dependent (their normal
# matrix's condition number past 1e9): the fit would split the peak between factors on rounding noise.
DEPENDENT_COLUMNS = 1e-9 ** 0.5
# Components of ``Estimate.breakdown``: the model state (made once, kept), what forward/backward allocates and
# frees (activations, transients, logits), and what the optimizer step allocates while no activation is alive
# (FP32 copies of BF16 main grads, ``memory.StateBytes.grad_copies``). The peak holds the state and the larger of
# the other two.
STATE_KEYS = ("weights", "grads", "optimizer", "fp8_weights", "workspaces")
DYNAMIC_KEYS = ("activations", "transient", "logits")
STEP_KEYS = ("grad_copies",)


def dynamic_gib(parts: dict[str, float]) -> float:
    """What the peak holds beyond the state: forward/backward's memory or the optimizer step's, the larger."""
    return max(sum(parts.get(k, 0.0) for k in DYNAMIC_KEYS), sum(parts.get(k, 0.0) for k in STEP_KEYS))


@dataclass(frozen=True)
class Calibration:
    """Multiplicative / additive corrections applied by ``estimate(..., calibration=...)``."""

    activation_factor: float = 1.0  # scales activations, transients and logits
    overhead_gib: float = 0.0  # added to the predicted reserved memory (and so to fits)
    state_factor: float = 1.0  # scales the model state (weights, grads, optimizer, FP8 copies, workspaces, grad copies)
    # The largest MoE hot-rank factor trials measured (the smoke run's router statistics, any backend); the
    # estimator routes max(this, EstimatorConstants.moe_hot_rank_factor) tokens to the busiest EP rank.
    moe_hot_rank_factor: float | None = None
    step_time_factor: float = 1.0  # scales the predicted step time (each term whose own factor was not fitted)
    samples: int = 0
    # Step-time terms fitted on their own (step_time term name -> efficiency factor, estimate.step_fit)
    step_term_factors: dict[str, float] = field(default_factory=dict)

    def step_factor(self, term: str) -> float:
        """The calibrated factor of one step-time term (``step_time.term_factor``)."""
        return term_factor(term, self.step_term_factors, self.step_time_factor)


@dataclass(frozen=True)
class Sample:
    """One measured trial next to what the *uncalibrated* estimator predicted for it."""

    breakdown: dict[str, float]  # Estimate.breakdown (GiB)
    fragmentation: float  # EstimatorConstants.allocator_fragmentation used for the prediction
    predicted_step_s: float | None
    measured_peak_gib: float | None  # max over ranks of max_memory_reserved
    measured_step_s: float | None

    def state(self) -> float:
        return sum(self.breakdown.get(k, 0.0) for k in STATE_KEYS)

    def dynamic(self) -> float:
        return dynamic_gib(self.breakdown)

    def predicted_memory(self, cal: Calibration) -> float:
        return (cal.state_factor * self.state() + self.fragmentation * cal.activation_factor * self.dynamic()
                + cal.overhead_gib)


@dataclass(frozen=True)
class FitReport:
    calibration: Calibration
    memory_error_before: float | None  # median |predicted - measured| / measured
    memory_error_after: float | None
    step_error_before: float | None
    step_error_after: float | None

    def lines(self) -> list[str]:
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{100 * x:.1f}%"

        c = self.calibration
        return [
            f"calibration from {c.samples} trial(s): model state x{c.state_factor:.3f}, activations "
            f"x{c.activation_factor:.3f}, overhead {c.overhead_gib:+.2f} GiB, step time x{c.step_time_factor:.3f}",
            f"memory median abs error: {pct(self.memory_error_before)} -> {pct(self.memory_error_after)}",
            f"step time median abs error: {pct(self.step_error_before)} -> {pct(self.step_error_after)}",
        ]


def _median_rel_error(pairs: Sequence[tuple[float, float]]) -> float | None:
    errors = [abs(p - m) / m for p, m in pairs if m > 0]
    return statistics.median(errors) if errors else None


def _clamp(x: float, lo: float = MIN_FACTOR, hi: float = MAX_FACTOR) -> float:
    return min(hi, max(lo, x))


def _least_squares(rows: np.ndarray, ys: np.ndarray) -> np.ndarray | None:
    """The least-squares solution of ``rows @ x = ys``; None when the columns are (nearly) dependent."""
    from scipy.optimize import lsq_linear  # a third of a second to import: ``plan`` fits nothing and stays instant

    # A column that is (nearly) a combination of the others: the samples cannot tell the factors apart.
    singular = np.linalg.svd(rows, compute_uv=False)  # largest first
    if singular[-1] < DEPENDENT_COLUMNS * singular[0]:
        return None
    # Unbounded: the factors are clamped after the fit, and a clamped fit's offset is refitted (``_fit_memory``).
    return np.asarray(lsq_linear(rows, ys).x)


def _fit_memory(mem: Sequence[Sample]) -> tuple[float, float, float]:
    """(state factor, activation factor, overhead GiB) for ``measured = s*state + a*frag*dynamic + c``."""
    states = [s.state() for s in mem]
    dynamics = [s.fragmentation * s.dynamic() for s in mem]
    ys = [float(s.measured_peak_gib or 0.0) for s in mem]
    # Relative residuals (each row divided by its measurement): a 1 GiB miss matters on a 10 GiB peak, not on 80.
    rows = np.column_stack([states, dynamics, np.ones(len(mem))]) / np.array(ys)[:, None]
    ones = np.ones(len(mem))
    fitted: list[float] | None = None
    if len(mem) >= MIN_SAMPLES_FOR_OFFSET:
        x = _least_squares(rows, ones)
        fitted = None if x is None else [float(v) for v in x]
    if fitted is None and len(mem) >= MIN_SAMPLES_FOR_SPLIT:
        x = _least_squares(rows[:, :2], ones)
        fitted = None if x is None else [float(x[0]), float(x[1]), 0.0]
    if fitted is not None:
        s, a, c = _clamp(fitted[0], MIN_STATE_FACTOR, MAX_STATE_FACTOR), _clamp(fitted[1]), fitted[2]
        if c and (s, a) != (fitted[0], fitted[1]):  # clamped: the offset takes the mean residual, nothing else
            c = statistics.fmean(y - s * st - a * dy for y, st, dy in zip(ys, states, dynamics))
        return s, a, c
    # Too few samples, or no spread in the state/dynamic mix: one ratio on the whole prediction.
    totals = [st + dy for st, dy in zip(states, dynamics)]
    k = sum(p * y for p, y in zip(totals, ys)) / sum(p * p for p in totals)
    return _clamp(k, MIN_STATE_FACTOR, MAX_STATE_FACTOR), _clamp(k), 0.0


def fit(samples: Sequence[Sample]) -> FitReport:
    """Fit a Calibration to measured samples and report the median error before and after."""
    mem = [s for s in samples if s.measured_peak_gib and s.state() + s.dynamic() > 0]
    s_factor, a, c = _fit_memory(mem) if mem else (1.0, 1.0, 0.0)
    timed = [s for s in samples if s.measured_step_s and s.predicted_step_s]
    ratios = [float(s.measured_step_s or 0) / float(s.predicted_step_s or 1) for s in timed]
    t = statistics.median(ratios) if ratios else 1.0
    cal = Calibration(activation_factor=a, overhead_gib=c, step_time_factor=t, state_factor=s_factor,
                      samples=len(samples))
    identity = Calibration()
    mem_pairs = lambda k: [(s.predicted_memory(k), float(s.measured_peak_gib or 0)) for s in mem]  # noqa: E731
    step_pairs = [(float(s.predicted_step_s or 0), float(s.measured_step_s or 0)) for s in timed]
    return FitReport(
        calibration=cal,
        memory_error_before=_median_rel_error(mem_pairs(identity)),
        memory_error_after=_median_rel_error(mem_pairs(cal)),
        step_error_before=_median_rel_error(step_pairs),
        step_error_after=_median_rel_error([(p * t, m) for p, m in step_pairs]),
    )


def calibration_key(cluster_name: str, model_name: str) -> str:
    return f"{cluster_name}/{model_name}"


# What ``flock`` raises where the filesystem has no locks, as opposed to a lock someone holds: ENOLCK on an NFS mount
# without a lock daemon, EOPNOTSUPP / ENOSYS where the filesystem does not implement flock.
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def save(path: Path, key: str, calibration: Calibration, shared: bool = True) -> bool:
    """Store (or replace) one cluster+model's factors in the JSON file at ``path``; True when stored.

    ``shared``: other sweeps write this file too (the user's cache): the read-modify-write holds an exclusive lock
    on ``<path>.lock``, since two sweeps finishing at once would otherwise each write the file it read and the first
    one's factors would be lost. Where the filesystem has no locks (``NO_LOCKS``) nothing is written and False is
    returned: without the lock a write may drop another sweep's factors. A file only this driver writes (the sweep
    folder's copy, held by the driver lock) is written without one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not shared:
        _store(path, key, calibration)
        return True
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError as exc:
            if exc.errno in NO_LOCKS:
                return False
            raise
        _store(path, key, calibration)
    return True


def _store(path: Path, key: str, calibration: Calibration) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = asdict(calibration)
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def load(path: Path, key: str) -> Calibration | None:
    """The stored factors for ``key``, or None when the file or the key is absent."""
    path = Path(path)
    if not path.is_file():
        return None
    entry = json.loads(path.read_text()).get(key)
    if entry is None:
        return None
    names = ("activation_factor", "overhead_gib", "step_time_factor", "state_factor", "moe_hot_rank_factor", "samples",
             "step_term_factors")
    return Calibration(**{k: entry[k] for k in names if k in entry})
