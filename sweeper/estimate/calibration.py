"""Calibration: fit the estimator's uncertain parts to measured trials and persist the factors.

The model-state bytes (weights, grads, optimizer) are exact; what the analytic model cannot know is how much
activation memory the kernels really keep (fused paths, saved-for-backward choices) and the fixed overheads
(allocator slack, NCCL, workspaces). So a measured peak is modelled as

    measured_reserved = state + fragmentation * a * dynamic + c

with ``dynamic`` = activations + transients + logits of the predicted worst rank, ``a`` = activation_factor and
``c`` = overhead_gib. The state is not multiplied by the fragmentation: Megatron allocates it as a few large
tensors at start-up (DDP's param and grad buffers, the optimizer's shards), which the caching allocator holds
without slack; the estimator's ``StageMemory.reserved_gib`` uses the same model. ``a`` and ``c`` are fitted by
least squares (``a`` alone, ratio-style, with fewer than 3 samples). Step time gets one multiplicative factor (the
median ratio, robust to one slow outlier). Factors are stored as JSON under ``"<cluster>/<model>"`` keys in a file
the caller chooses, so a later sweep on the same cluster starts calibrated.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# A fitted activation factor outside this range means the samples disagree with the model's structure (wrong
# recompute setting, a different optimizer); clamping keeps one bad sample from wrecking every prediction.
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0
# With fewer samples than this, only the activation factor is fitted (two unknowns need spread in the data).
MIN_SAMPLES_FOR_OFFSET = 3
# Components of ``Estimate.breakdown`` that are exact (not scaled by calibration) and the scaled ones.
STATE_KEYS = ("weights", "grads", "optimizer", "fp8_weights")
DYNAMIC_KEYS = ("activations", "transient", "logits")


@dataclass(frozen=True)
class Calibration:
    """Multiplicative / additive corrections applied by ``estimate(..., calibration=...)``."""

    activation_factor: float = 1.0  # scales activations, transients and logits
    overhead_gib: float = 0.0  # added to the non-torch overhead (and to fits)
    step_time_factor: float = 1.0  # scales the predicted step time
    samples: int = 0


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
        return sum(self.breakdown.get(k, 0.0) for k in DYNAMIC_KEYS)

    def predicted_memory(self, cal: Calibration) -> float:
        return self.state() + self.fragmentation * cal.activation_factor * self.dynamic() + cal.overhead_gib


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
            f"calibration from {c.samples} trial(s): activations x{c.activation_factor:.3f}, "
            f"overhead {c.overhead_gib:+.2f} GiB, step time x{c.step_time_factor:.3f}",
            f"memory median abs error: {pct(self.memory_error_before)} -> {pct(self.memory_error_after)}",
            f"step time median abs error: {pct(self.step_error_before)} -> {pct(self.step_error_after)}",
        ]


def _median_rel_error(pairs: Sequence[tuple[float, float]]) -> float | None:
    errors = [abs(p - m) / m for p, m in pairs if m > 0]
    return statistics.median(errors) if errors else None


def _clamp(x: float) -> float:
    return min(MAX_FACTOR, max(MIN_FACTOR, x))


def fit(samples: Sequence[Sample]) -> FitReport:
    """Fit a Calibration to measured samples and report the median error before and after."""
    mem = [s for s in samples if s.measured_peak_gib and s.dynamic() > 0]
    a, c = 1.0, 0.0
    if mem:
        # y = measured - state = frag * dynamic * a + c
        xs = [s.fragmentation * s.dynamic() for s in mem]
        ys = [float(s.measured_peak_gib or 0.0) - s.state() for s in mem]
        if len(mem) >= MIN_SAMPLES_FOR_OFFSET and statistics.pvariance(xs) > 0:
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            a = _clamp(a)
            c = my - a * mx
        else:
            a = _clamp(sum(xs[i] * ys[i] for i in range(len(xs))) / sum(x * x for x in xs))
    timed = [s for s in samples if s.measured_step_s and s.predicted_step_s]
    t = statistics.median(float(s.measured_step_s or 0) / float(s.predicted_step_s or 1) for s in timed) if timed else 1.0
    cal = Calibration(activation_factor=a, overhead_gib=c, step_time_factor=t, samples=len(samples))
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


def save(path: Path, key: str, calibration: Calibration) -> None:
    """Store (or replace) one cluster+model's factors in the JSON file at ``path``."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = asdict(calibration)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load(path: Path, key: str) -> Calibration | None:
    """The stored factors for ``key``, or None when the file or the key is absent."""
    path = Path(path)
    if not path.is_file():
        return None
    entry = json.loads(path.read_text()).get(key)
    if entry is None:
        return None
    return Calibration(**{k: entry[k] for k in ("activation_factor", "overhead_gib", "step_time_factor", "samples")
                          if k in entry})
