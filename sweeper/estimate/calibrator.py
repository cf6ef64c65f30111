"""Feeding measured trials back into the estimator while a sweep runs (estimator issue, item 6; issue 33).

Memory: only device measurements calibrate: on the CPU backend the measured peak is host RSS of a gloo process,
which says nothing about GPU memory, so a simulated sweep keeps the uncalibrated memory model and says so.

Step time: every passed trial's measured step time refits one efficiency factor per step-time term
(``estimate.step_fit``) on the backend it ran on, so a simulated sweep learns its CPU ranks (whose terms are priced
with the host's cores shared among them) and a GPU sweep its GPUs. A GPU sweep's factors become the cluster's
calibrated step time (``Calibration.step_term_factors``); a simulated sweep's rank its own layouts only, never
stand in for GPU predictions.

Fitted factors are stored in the user's cache (``$SWEEPER_CACHE`` or ``~/.cache/sweeper/calibration.json``) under
``"<cluster>/<model>"`` (a simulated sweep's cluster key names the host's CPU instead), and copied into the sweep
folder, so the next sweep on the same cluster starts calibrated. The cluster's part of the step-time factors (its
links and kernel-launch overhead, ``step_time.CLUSTER_TERMS``) is also stored under ``"<cluster>/*"``: a sweep or
``plan`` of another model on the same cluster starts with those (``stored``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sweeper.config.schema import SweepConfig
from sweeper.estimate import Estimator
from sweeper.estimate.calibration import Calibration, FitReport, Sample, calibration_key, fit, load, save
from sweeper.estimate.step_fit import StepFit, StepModel, repeat_noise
from sweeper.estimate.step_time import CLUSTER_TERMS
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout


def cache_path() -> Path:
    root = os.environ.get("SWEEPER_CACHE") or Path.home() / ".cache" / "sweeper"
    return Path(root) / "calibration.json"


def cluster_key(cfg: SweepConfig, host_cores: int | None = None) -> str:
    """The cluster part of a calibration key: its size and GPU kind, or the host's CPU for a simulated one, and the
    estimator's constants (a digest): the factors are corrections to the predictions those constants make, so a
    calibration learnt under other constants (the YAML's ``estimate:``, or the defaults before they were fitted on
    published runs, issue 46) would price this sweep's layouts that much off."""
    c = cfg.cluster
    constants = hashlib.sha256(cfg.estimate.model_dump_json().encode()).hexdigest()[:8]
    if host_cores:
        return f"cpu-{host_cores}cores-{c.nodes}x{c.gpus_per_node}-est{constants}"
    return f"{c.nodes}x{c.gpus_per_node}-{c.gpu_kind or 'cc' + c.compute_capability}-est{constants}"


def model_key(cfg: SweepConfig) -> str:
    """The model part of a calibration key: the model and everything else that moves what a trial measures on the
    same cluster (issue 43): the sequence length, the attention backend and whether Transformer Engine is installed,
    the megatron-core release, and the run settings (a digest: grad dtype, optimizer, FP8 recipe, overlaps)."""
    try:
        mcore = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        mcore = "none"
    te = "te" if importlib.util.find_spec("transformer_engine") is not None else "local"
    run = hashlib.sha256(cfg.run.model_dump_json().encode()).hexdigest()[:8]
    return (f"{cfg.model.name}@seq{cfg.training.seq_length}-{cfg.estimate.attention_backend}-{te}-mcore{mcore}"
            f"-run{run}")


def key(cfg: SweepConfig, host_cores: int | None = None) -> str:
    return calibration_key(cluster_key(cfg, host_cores), model_key(cfg))


def stored(cfg: SweepConfig, host_cores: int | None = None) -> tuple[Calibration | None, str | None]:
    """The stored calibration a sweep or ``plan`` of ``cfg`` starts from, and one line saying where it came from:
    this cluster and model's own, else the cluster's links and launch overhead learnt on another model."""
    path = cache_path()
    own = load(path, key(cfg, host_cores))
    if own is not None:
        return own, (f"calibrated from {own.samples} measured trial(s) of {cfg.model.name} on this cluster: step "
                     f"time x{own.step_time_factor:.3g}{_terms(own)}, activations x{own.activation_factor:.3g}, "
                     f"model state x{own.state_factor:.3g} ({path})")
    shared = load(path, calibration_key(cluster_key(cfg, host_cores), "*"))
    if shared is not None and shared.step_term_factors:
        return shared, (f"step time partly calibrated: this cluster's link and launch factors learnt on another "
                        f"model, relative to its compute{_terms(shared)} ({path})")
    return None, None


def _terms(calibration: Calibration) -> str:
    """The step-time terms fitted on their own, for a one-line summary."""
    factors = calibration.step_term_factors
    return f" ({', '.join(f'{t} x{f:.3g}' for t, f in sorted(factors.items()))})" if factors else ""


@dataclass(frozen=True)
class CalibrationUpdate:
    """What one trial changed: the refit memory/step factors (None: not a device measurement), the refit step-time
    terms (None: no step time measured), and whether the estimator's predictions moved at all (a refit, or a
    measured routing imbalance raising the hot-rank factor)."""

    fit: FitReport | None = None
    step: StepFit | None = None
    changed: bool = False


class Calibrator:
    def __init__(self, cfg: SweepConfig, sweep_dir: Path, host_cores: int | None = None,
                 shared: bool = True) -> None:
        """``host_cores``: the trials run on a simulated cluster's CPU ranks sharing this many cores (None: GPUs).
        ``shared``: read and write the calibration cache other sweeps share (a rehearsal's modelled trials do
        neither: only its own folder's calibration.json)."""
        self.cfg, self.host_cores, self.shared = cfg, host_cores, shared
        self.sweep_file = sweep_dir / "calibration.json"
        self.samples: list[Sample] = []
        # A simulated sweep's stored factors are its CPU's: they rank its layouts, never price the GPU cluster's.
        self.current: Calibration | None = None if host_cores or not shared else stored(cfg)[0]
        start = (stored(cfg, host_cores)[0] if shared else None) if host_cores else self.current
        self.report: FitReport | None = None
        self._raw = Estimator.for_config(cfg)  # the uncalibrated predictions the samples are fitted against
        self.step = StepModel(Estimator.for_config(cfg, host_cores=host_cores), _step_fit(start))
        self.step_trials: list[tuple[int, str]] = []  # (trial number, layout) of each step-time sample

    def add(self, layout: Layout, result: TrialResult, number: int = 0) -> CalibrationUpdate:
        """Refit with one more measured trial (only a passed trial's device memory calibrates memory; any passed
        trial's step time the step-time terms). A MoE trial's measured routing imbalance raises the hot-rank factor
        on any backend (the router is the same megatron-core code on CPU and GPU)."""
        factor = result.metrics.moe_hot_rank_factor
        raised = factor is not None and factor > ((self.current and self.current.moe_hot_rank_factor) or 1.0)
        if raised:
            self.current = replace(self.current or Calibration(), moe_hot_rank_factor=factor)
        step = None
        if result.passed and result.metrics.step_time_s:
            step = self.step.add(layout, result.metrics.step_time_s)
            self.step_trials.append((number, layout.short()))
            if self.host_cores:  # the CPU's factors: kept apart from the GPU cluster's calibration
                self._save(Calibration(step_time_factor=self.step.level, step_term_factors=self.step.factors(),
                                       samples=step.samples))
        device_memory = (result.passed and result.memory_kind == "device"
                         and result.metrics.peak_memory_gib is not None)
        if device_memory:
            raw = self._raw(layout)
            self.samples.append(Sample(
                breakdown=raw.breakdown, fragmentation=self.cfg.estimate.allocator_fragmentation,
                predicted_step_s=raw.step_time_s, measured_peak_gib=result.metrics.peak_memory_gib,
                measured_step_s=result.metrics.step_time_s,
            ))
            self.report = fit(self.samples)
            hot = self.current.moe_hot_rank_factor if self.current else None
            self.current = replace(self.report.calibration, moe_hot_rank_factor=hot)
        if not self.host_cores and (device_memory or step is not None):
            if self.step.samples:  # the step-time terms' fit replaces the memory fit's single median ratio
                self.current = replace(self.current or Calibration(), step_time_factor=self.step.level,
                                       step_term_factors=self.step.factors(),
                                       samples=max(len(self.step.samples), len(self.samples)))
            assert self.current is not None
            self._save(self.current)
            return CalibrationUpdate(fit=self.report if device_memory else None, step=step, changed=True)
        return CalibrationUpdate(step=step, changed=raised)

    def step_time_fit(self) -> dict[str, Any] | None:
        """sweep.json's ``step_time_fit``: what the measured step times taught the step-time model (None before the
        first)."""
        model = self.step
        if not model.samples:
            return None
        rows: list[dict[str, Any]] = []
        for name, sample in zip(self.step_trials, model.samples, strict=True):
            rows.append({"trial": name[0], "layout": name[1], "measured_s": sample.measured_s,
                         "uncalibrated_s": model.raw_seconds(sample), "calibrated_s": model.calibrated_seconds(sample)})

        def error(key: str) -> float:
            return statistics.median(abs(r[key] / r["measured_s"] - 1) for r in rows)

        one = statistics.median(r["measured_s"] / r["uncalibrated_s"] for r in rows)
        return {
            "backend": f"CPU ranks sharing {self.host_cores} cores" if self.host_cores else "GPUs",
            "level": model.level, "factors": model.factors(), "samples": len(rows),
            # The measurement spread the fit assumed (log units): the constant until a layout ran twice, then the
            # repeats' own (step_fit.repeat_noise).
            "noise": model.fit.noise, "noise_from_repeats": repeat_noise(model.samples, model.layouts) is not None,
            "error_uncalibrated": error("uncalibrated_s"),
            "error_one_factor": statistics.median(abs(one * r["uncalibrated_s"] / r["measured_s"] - 1) for r in rows),
            "error_calibrated": error("calibrated_s"), "trials": rows,
        }

    def _save(self, calibration: Calibration) -> None:
        """Store the factors for this cluster and model, and the cluster's own step-time part for any model."""
        for path in (cache_path(), self.sweep_file) if self.shared else (self.sweep_file,):
            save(path, key(self.cfg, self.host_cores), calibration)
            # Relative to this model's level (its compute's efficiency): another model's level is its own.
            level = calibration.step_time_factor
            shared = {t: f / level for t, f in calibration.step_term_factors.items() if t in CLUSTER_TERMS}
            if shared:
                save(path, calibration_key(cluster_key(self.cfg, self.host_cores), "*"),
                     Calibration(step_term_factors=shared, samples=calibration.samples))


def _step_fit(calibration: Calibration | None) -> StepFit | None:
    """The step-time fit a stored calibration holds (its level and its terms' own factors)."""
    if calibration is None:
        return None
    return StepFit(level=calibration.step_time_factor, factors=dict(calibration.step_term_factors),
                   samples=calibration.samples)
