"""Step time calibrated term by term: one efficiency factor per step-time term, fitted to measured trials.

A layout's predicted step time is a sum of named terms (``step_time.StepTerms``: compute per block kind and
precision, recompute, TP / CP / EP traffic, kernel launches, the pipeline bubble and point-to-point, DP / EDP
traffic, the optimizer step). Measured trials say how far each term is off on the backend they ran on: a GPU
cluster's links reach another fraction of their bandwidth than assumed, the CPU backend's gloo collectives cost
milliseconds where NCCL's cost microseconds, BF16 GEMMs run slower than FP32 on a CPU without BF16 units. One factor
for the whole prediction moves its level, never its ranking; a factor per term moves both.

The model, in log space (step times spread over decades, and a 10 % miss matters the same on any of them):

    factor(t) = exp(level + theta_t)           theta_t = 0 for a term not freed
    predicted = StepTerms.seconds(factor)      (the bubble's factor is exp(theta_bubble): it scales the slowest
                                                stage's already calibrated time)
    minimise  sum_j (log predicted_j - log measured_j)^2 / NOISE^2  +  sum_t theta_t^2 / PRIOR^2

``level`` is free (no prior): it is what the single step-time factor used to be. Each freed ``theta_t`` is pulled
towards 0, i.e. the term keeps the estimator's relative weight until the trials say otherwise. How many terms are
freed follows what the trials support: none for one or two trials (the level alone), then forward selection, one
term at a time, the term whose freeing lowers the fit's Bayesian information criterion most, with two trials per
freed term (``MAX_FREE``): a fit that passes exactly through its samples extrapolates wildly to the layouts it has
not seen. ``scipy.optimize.least_squares`` (trust-region reflective, the prior as residual rows, each freed theta
bounded by ``MAX_LOG_OFFSET``) solves each fit (a few dozen parameters at most), each newly freed term started from
the best of a coarse grid of offsets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sweeper.estimate.estimator import Estimator
from sweeper.estimate.step_time import PP_BUBBLE, StepTerms, term_factor
from sweeper.space.layout import Layout

# The spread of one smoke run's measured step time around its layout's true one, in log units: the CPU backend's
# repeats spread by 7-15 % (tests/data/landscape_*.json, noise_cv_median), a GPU's by a few percent. The larger one
# keeps a term from being freed to explain noise.
NOISE = 0.10
# Once a layout has run more than once (a confirmation, a retry) the noise is the spread of its repeats instead:
# the pooled standard deviation of log step time within each repeated layout, with at least MIN_REPEAT_DOF degrees
# of freedom, kept within [MIN_NOISE, MAX_NOISE] (a pair that happened to agree must not let every term go free;
# issue 46).
MIN_REPEAT_DOF = 2
MIN_NOISE, MAX_NOISE = 0.02, 0.5
# How far a term's efficiency may plausibly lie from the common level, in log units (a factor of three either way at
# one sigma): the estimator's structure is trusted, its constants less so. Trials that say otherwise move a term as
# far as they need (the CPU backend's gloo collectives end up thousands of times NCCL's cost); a wider prior let
# three trials pull one term far enough to mispredict the layouts they did not measure (benchmarks/
# step_time_calibration.py: the held-out median error on the quickstart landscape 24 % with a factor of ten, 22 %
# with three).
PRIOR = math.log(3.0)
# Terms freed at most, for n measured trials: two trials per freed term besides the level's one, so that no fit
# passes exactly through its samples.
def MAX_FREE(n: int) -> int:  # noqa: N802
    return (n - 1) // 2


# A freed term's factor stays within six decades of the level, however the trials pull.
MAX_LOG_OFFSET = math.log(1e6)


@dataclass(frozen=True)
class StepSample:
    """One measured trial: its layout's uncalibrated step-time terms and its measured seconds per step."""

    terms: StepTerms
    measured_s: float


@dataclass(frozen=True)
class StepFit:
    """The fitted factors: ``level`` for every term, ``factors`` for the terms fitted on their own."""

    level: float = 1.0
    factors: dict[str, float] | None = None
    samples: int = 0
    error_before: float | None = None  # median |predicted - measured| / measured, uncalibrated
    error_level: float | None = None  # the same with the level only (what one factor would give)
    error_after: float | None = None  # with the fitted terms
    noise: float = NOISE  # the measurement spread the fit assumed (log units): NOISE, or the repeats' own
    spread: Spread | None = field(default=None, compare=False)  # how well the samples pin the factors (None: none)
    level_alone: float = 1.0  # the level of the fit that frees no term (``level`` where ``factors`` is empty)
    level_alone_miss: float = 0.0  # that fit's largest |log predicted - log measured| over the samples

    def factor(self, term: str) -> float:
        return term_factor(term, self.factors, self.level)

    def log_sd(self, terms: StepTerms) -> float:
        """The standard deviation of the fitted log step time of a layout with these (uncalibrated) terms: what the
        samples leave unknown of its factors (``Spread``); 0.0 without a fit."""
        return 0.0 if self.spread is None else self.spread.log_sd(terms)


@dataclass(frozen=True, eq=False)
class Spread:
    """The fit's uncertainty, linearised at its optimum (a Laplace approximation of the module docstring's model).

    Every term, freed or not, has its theta with the prior N(0, PRIOR^2); the level has none. The posterior
    precision of (level, theta) is ``J^T J / s^2 + diag(0, 1/PRIOR^2, ...)`` with J the log step time's Jacobian
    over the samples and s^2 the larger of the assumed noise and the residuals' own variance (a fit that cannot
    explain its samples is less sure of what it predicts, not more). A layout's log step time then has the variance
    ``g^T C g``, g its own Jacobian row (each term's share of its step, 1 for the level), C the posterior
    covariance; a term that no sample has keeps its whole prior: its share squared times PRIOR^2."""

    names: tuple[str, ...]
    log_level: float
    theta: tuple[float, ...]
    covariance: np.ndarray  # over (level, theta of each name)

    def log_sd(self, terms: StepTerms) -> float:
        unseen = [t for t in terms.names() if t not in self.names]
        names = [*self.names, *unseen]
        problem = _Problem([StepSample(terms, 1.0)], names)
        _, jac = problem.predict(self.log_level, np.concatenate([self.theta, np.zeros(len(unseen))]))
        known, new = jac[0, : 1 + len(self.names)], jac[0, 1 + len(self.names):]
        return math.sqrt(max(0.0, float(known @ self.covariance @ known)) + PRIOR ** 2 * float(new @ new))


def _spread(problem: _Problem, level: float, theta: np.ndarray, noise: float, free: int) -> Spread:
    """``Spread`` at the fit's optimum (``free``: the thetas it freed, which the residuals' degrees of freedom
    lose)."""
    log_pred, jac = problem.predict(level, theta)
    residual = log_pred - problem.log_measured
    dof = len(residual) - 1 - free
    variance = max(noise ** 2, float(residual @ residual) / dof if dof > 0 else 0.0)
    precision = jac.T @ jac / variance
    precision[1:, 1:] += np.eye(len(theta)) / PRIOR ** 2
    return Spread(tuple(problem.names), level, tuple(float(t) for t in theta), np.linalg.pinv(precision))


class _Problem:
    """The samples as arrays: stage terms per micro-batch, step terms, micro-batches and bubble slots."""

    def __init__(self, samples: Sequence[StepSample], names: list[str]) -> None:
        self.names = names
        index = {t: i for i, t in enumerate(names)}
        self.stage = np.zeros((len(samples), len(names)))
        self.step = np.zeros((len(samples), len(names)))
        for j, s in enumerate(samples):
            for t, v in s.terms.stage.items():
                if t in index:
                    self.stage[j, index[t]] = v
            for t, v in s.terms.step.items():
                if t in index:
                    self.step[j, index[t]] = v
        self.micro = np.array([s.terms.microbatches for s in samples], dtype=float)
        self.bubble = np.array([s.terms.bubble_slots for s in samples], dtype=float)
        self.log_measured = np.log([s.measured_s for s in samples])
        self.bubble_index = index.get(PP_BUBBLE)

    def predict(self, level: float, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """log predicted step time per sample, and its Jacobian over (level, theta)."""
        f = np.exp(level + theta)
        fb = 1.0
        if self.bubble_index is not None:
            f[self.bubble_index] = 0.0  # the bubble is no stage or step term; its factor is fb
            fb = math.exp(theta[self.bubble_index])
        per_micro = self.stage @ f
        slots = self.micro + fb * self.bubble
        once = self.step @ f
        pred = per_micro * slots + once
        grad = self.stage * f * slots[:, None] + self.step * f
        if self.bubble_index is not None:
            grad[:, self.bubble_index] = fb * self.bubble * per_micro
        # The level scales every factor but the bubble's: d pred / d level = pred.
        jac = np.column_stack([pred, grad]) / pred[:, None]
        return np.log(pred), jac


# Where a newly freed term's search starts: the best of these log offsets from the level. A term that is a
# thousandth of the step (gloo's TP collectives priced at NCCL's speed) needs a factor of thousands to show, which a
# trust-region step from 0 would crawl towards.
START_OFFSETS = np.linspace(-MAX_LOG_OFFSET, MAX_LOG_OFFSET, 29)
# least_squares' ftol, xtol and gtol. Its defaults (1e-8) stop in a flat valley: on benchmarks/
# step_time_calibration.py's fits a weakly determined factor ends 0.3 % from the optimum; at 1e-14 within 1e-5.
TOLERANCE = 1e-14


def _solve(problem: _Problem, free: list[int], level0: float, theta0: np.ndarray | None = None,
           noise: float = NOISE) -> tuple[float, np.ndarray, float]:
    """The least-squares fit of the level and the freed thetas (each within ``MAX_LOG_OFFSET``) from (level0,
    theta0); (level, theta, objective)."""
    from scipy.optimize import least_squares  # a third of a second to import: ``plan`` fits nothing

    n_terms = len(problem.names)
    level = level0
    theta = np.zeros(n_terms) if theta0 is None else theta0.copy()
    weight = (noise / PRIOR) ** 2  # the prior's weight against one sample's squared log residual

    if free and theta0 is not None:  # the newest freed term: start from the best of a coarse grid
        newest = free[-1]

        def at(offset: float) -> float:
            th = theta.copy()
            th[newest] = offset
            logp = problem.predict(level, th)[0]
            shift = float(np.mean(problem.log_measured - logp))  # the level's best answer to that offset
            r = logp + shift - problem.log_measured
            return float(r @ r + weight * th @ th)

        theta[newest] = min(START_OFFSETS, key=at)
        logp = problem.predict(level, theta)[0]
        level += float(np.mean(problem.log_measured - logp))
    cols = [0] + [1 + i for i in free]
    # The prior as residual rows: theta_t / PRIOR against each sample's log residual / NOISE.
    root_weight = noise / PRIOR
    prior_jac = np.hstack([np.zeros((len(free), 1)), root_weight * np.eye(len(free))])
    last: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}  # least_squares asks for the Jacobian where it just was

    def unpack(x: np.ndarray) -> tuple[float, np.ndarray]:
        th = theta.copy()
        th[free] = x[1:]
        return float(x[0]), th

    def predicted(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = x.tobytes()
        if key not in last:
            last.clear()
            last[key] = problem.predict(*unpack(x))
        return last[key]

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.concatenate([predicted(x)[0] - problem.log_measured, root_weight * x[1:]])

    def jacobian(x: np.ndarray) -> np.ndarray:
        return np.vstack([predicted(x)[1][:, cols], prior_jac])

    bound = np.full(len(free), MAX_LOG_OFFSET)
    result = least_squares(residuals, np.concatenate([[level], theta[free]]), jac=jacobian, x_scale="jac",
                           bounds=(np.concatenate([[-np.inf], -bound]), np.concatenate([[np.inf], bound])),
                           ftol=TOLERANCE, xtol=TOLERANCE, gtol=TOLERANCE)
    level, theta = unpack(result.x)
    r = result.fun[: len(problem.log_measured)]
    return level, theta, float(r @ r + weight * theta @ theta)


def _median_error(log_pred: np.ndarray, log_measured: np.ndarray) -> float:
    return float(np.median(np.abs(np.exp(log_pred - log_measured) - 1.0)))


def repeat_noise(samples: Sequence[StepSample], layouts: Sequence[object]) -> float | None:
    """The spread of the measured step time between runs of the same layout (``layouts[i]`` is sample i's): the
    pooled standard deviation of its log, None with fewer than MIN_REPEAT_DOF degrees of freedom."""
    groups: dict[object, list[float]] = {}
    for sample, layout in zip(samples, layouts, strict=True):
        if sample.measured_s > 0:
            groups.setdefault(layout, []).append(math.log(sample.measured_s))
    repeated = [g for g in groups.values() if len(g) > 1]
    dof = sum(len(g) - 1 for g in repeated)
    if dof < MIN_REPEAT_DOF:
        return None
    squares = sum(float(np.sum((np.array(g) - np.mean(g)) ** 2)) for g in repeated)
    return min(MAX_NOISE, max(MIN_NOISE, math.sqrt(squares / dof)))


def fit_step(samples: Sequence[StepSample], noise: float = NOISE) -> StepFit:
    """The level and the freed terms' factors that best explain ``samples`` (see the module's docstring), with
    ``noise`` the spread of a measurement in log units (NOISE, or the repeats' own: ``repeat_noise``)."""
    samples = [s for s in samples if s.measured_s > 0 and s.terms.seconds() > 0]
    if not samples:
        return StepFit()
    names = sorted({t for s in samples for t in s.terms.names()})
    problem = _Problem(samples, names)
    n = len(samples)
    zero = np.zeros(len(names))
    raw_log = problem.predict(0.0, zero)[0]
    level0 = float(np.median(problem.log_measured - raw_log))
    level, theta, value = _solve(problem, [], level0, noise=noise)
    level_alone = math.exp(level)
    level_alone_miss = float(np.max(np.abs(problem.predict(level, theta)[0] - problem.log_measured)))

    def bic(objective: float, free: int) -> float:
        return objective / noise ** 2 + (1 + free) * math.log(n)

    free: list[int] = []
    best_score = bic(value, 0)
    best = (level, theta)
    # Only terms whose share of the step differs between the samples can be told apart from the level.
    shares = np.array([[s.terms.per_step().get(t, 0.0) / s.terms.seconds() for t in names] for s in samples])
    candidates = [i for i in range(len(names)) if np.ptp(shares[:, i]) > 1e-3]
    while len(free) < MAX_FREE(n) and candidates:
        scored = []
        for i in candidates:
            lv, th, val = _solve(problem, [*free, i], best[0], best[1], noise=noise)
            scored.append((bic(val, len(free) + 1), i, lv, th))
        score, i, lv, th = min(scored, key=lambda x: x[0])
        if score >= best_score:
            break
        best_score, best = score, (lv, th)
        free.append(i)
        candidates.remove(i)
    level, theta = best
    factors = {}
    for i in free:
        name = names[i]
        factors[name] = math.exp(theta[i]) if name == PP_BUBBLE else math.exp(level + theta[i])
    return StepFit(
        level=math.exp(level), factors=factors, samples=n,
        error_before=_median_error(raw_log, problem.log_measured),
        error_level=_median_error(raw_log + level0, problem.log_measured),
        error_after=_median_error(problem.predict(level, theta)[0], problem.log_measured), noise=noise,
        spread=_spread(problem, level, theta, noise, len(free)), level_alone=level_alone,
        level_alone_miss=level_alone_miss,
    )


class StepModel:
    """One sweep's step-time samples against an estimator's terms, and the fit they give (refit per sample).

    ``start``: the factors stored by earlier sweeps on the same cluster. Until a trial is measured they are the
    prediction; after, the shape they learnt (each term's factor relative to their level) stays as the estimator's
    weights the new fit is pulled towards, and the new trials fit the level and whatever still differs.

    A proposal is ranked by the freed terms only once they have earned it (``ranking_factor``): each trial measured
    after the fit freed a term is first predicted by the fit and by the stored shape at the fit's level alone, and
    the freed terms rank once their squared log errors sum lower, or at once where the level alone misses a measured
    trial beyond the prior's factor of three (``beyond_prior``). Freed by a few trials to explain a cost the
    estimator has no term for, they can move the layouts the estimator ranked right below ones it ranked wrong."""

    def __init__(self, estimator: Estimator, start: StepFit | None = None) -> None:
        self.estimator = estimator
        self.samples: list[StepSample] = []
        self.layouts: list[Layout] = []  # the layout of each sample (repeats give the measurement noise)
        self.start = start or StepFit()
        self.base = {t: f if t == PP_BUBBLE else f / self.start.level for t, f in (self.start.factors or {}).items()}
        self.fit = self.start
        self._terms: dict[Layout, StepTerms] = {}
        # Each measured trial's squared log error as predicted before it was fitted, by the refit and by the start's
        # shape at the level alone, summed over the trials where the two differed (the refit had freed a term).
        self.held_out = {"refit": 0.0, "level": 0.0}
        # Each layout's step time as a proposal ranks it under the current fit: a ranked proposal asks it of every
        # untried layout (thousands on a 1,024-GPU space), several times between two samples (issue 54)
        self._step_s: dict[Layout, float] = {}

    def terms(self, layout: Layout) -> StepTerms:
        """The layout's uncalibrated step-time terms (kept: a sweep asks for the same layouts again)."""
        terms = self._terms.get(layout)
        if terms is None:
            terms = self.estimator(layout).step_terms
            assert terms is not None, "the estimator prices every valid layout's step"
            self._terms[layout] = terms
        return terms

    def add(self, layout: Layout, measured_step_s: float) -> StepFit:
        """One more measured trial: refit and return the new fit (relative to the stored shape)."""
        if self.samples and self.fit.factors and measured_step_s > 0:
            terms = self.terms(layout)
            for name, factor in (("refit", self.factor), ("level", self._level_alone)):
                self.held_out[name] += math.log(terms.seconds(factor) / measured_step_s) ** 2
        self.samples.append(StepSample(self.terms(layout).weighted(self._base), measured_step_s))
        self.layouts.append(layout)
        self.fit = fit_step(self.samples, repeat_noise(self.samples, self.layouts) or NOISE)
        self._step_s = {}
        return self.fit

    def factor(self, term: str) -> float:
        """A term's calibrated factor: the stored one until a trial is measured, then the stored shape times the
        refit."""
        if not self.samples:
            return self.start.factor(term)
        return self._base(term) * self.fit.factor(term)

    def factors(self) -> dict[str, float]:
        """The factors of the terms that differ from the level (the stored shape's and the refit's own)."""
        return {t: self.factor(t) for t in {*self.base, *(self.fit.factors or {})}}

    @property
    def level(self) -> float:
        return self.fit.level

    def step_time_s(self, layout: Layout) -> float:
        """The layout's step time as the current calibration predicts it."""
        return self.terms(layout).seconds(self.factor)

    @property
    def beyond_prior(self) -> bool:
        """Whether the fit freed a term and the level alone misses a measured trial by more than the prior lets a term
        lie from the level (``refit_leads``)."""
        return bool(self.fit.factors) and self.fit.level_alone_miss > PRIOR

    @property
    def refit_leads(self) -> bool:
        """Whether a proposal ranks by the refit's freed terms: once they have predicted the trials they had not seen
        better than the start's shape at the level alone (``held_out``), or at once where the level alone misses a
        measured trial by more than the prior lets a term lie from the level (``beyond_prior``: a factor of three;
        a pipelined layout measured 20x slower than predicted says the estimator's order is wrong, a BF16 layout
        twice as slow on the CPU as its FP32 twin does not). Until then a proposal ranks by that shape
        (``ranking_factor``)."""
        return self.beyond_prior or self.held_out["refit"] < self.held_out["level"]

    def ranking_factor(self, term: str) -> float:
        """The factor a proposal is priced with: the refit's where it leads (``refit_leads``), else the start's
        shape at the refit's level alone, which ranks the layouts as the start did."""
        return self.factor(term) if not self.samples or self.refit_leads else self._level_alone(term)

    def ranking_step_s(self, layout: Layout) -> float:
        """The layout's step time as a proposal is ranked by (``ranking_factor``), kept until the next sample."""
        seconds = self._step_s.get(layout)
        if seconds is None:
            seconds = self._step_s[layout] = self.terms(layout).seconds(self.ranking_factor)
        return seconds

    def refit_seconds(self, terms: StepTerms) -> float:
        """Uncalibrated terms priced with what the measured trials changed of each factor a proposal is ranked by:
        that factor over the one the model started from (all 1.0 before a trial is measured; the level's ratio on
        every term after a fit of the level alone)."""
        if not self.samples:
            return terms.seconds()
        return terms.seconds(lambda t: self.ranking_factor(t) / self.start.factor(t))

    def _level_alone(self, term: str) -> float:
        return self._base(term) * term_factor(term, None, self.fit.level_alone)

    def raw_seconds(self, sample: StepSample) -> float:
        """A sample's uncalibrated step time (the stored shape taken out again)."""
        return sample.terms.weighted(lambda t: 1.0 / self._base(t)).seconds()

    def log_sd(self, layout: Layout) -> float:
        """The standard deviation of the layout's predicted log step time: what the measured trials leave unknown
        of its terms' factors (``Spread``); 0.0 before a trial is measured."""
        if not self.samples:
            return 0.0
        return self.fit.log_sd(self.terms(layout).weighted(self._base))

    def calibrated_seconds(self, sample: StepSample) -> float:
        return sample.terms.seconds(self.fit.factor)

    def _base(self, term: str) -> float:
        return self.base.get(term, 1.0)
