"""Feeding measured trials back into the estimator while a sweep runs (estimator issue, item 6; issue 33).

Memory: only device measurements calibrate: on the CPU backend the measured peak is host RSS of a gloo process,
which says nothing about GPU memory, so a simulated sweep keeps the uncalibrated memory model and says so.

Step time: every passed trial's measured step time refits one efficiency factor per step-time term
(``estimate.step_fit``) on the backend it ran on, so a simulated sweep learns its CPU ranks (whose terms are priced
with the host's cores shared among them) and a GPU sweep its GPUs. A GPU sweep's factors become the cluster's
calibrated step time (``Calibration.step_term_factors``); a simulated sweep's rank its own layouts only, never
stand in for GPU predictions.

The estimator learns from plain figures the search hands it (``Measured``), never from the trial record: the
record's schema is the search's, and ``sweeper.estimate`` does not import ``sweeper.record`` (import-linter).

Fitted factors are stored in the user's cache (``$SWEEPER_CACHE`` or ``~/.cache/sweeper/calibration.json``) under
``"<cluster>/<model>"`` (a simulated sweep's cluster key names the host's CPU instead), and copied into the sweep
folder, so the next sweep on the same cluster starts calibrated. The cluster's part of the step-time factors (its
links and kernel-launch overhead, ``step_time.CLUSTER_TERMS``) is also stored under ``"<cluster>/*"``: a sweep or
``plan`` of another model on the same cluster starts with those (``stored``). Where the cache's filesystem has no
locks (an NFS home without a lock daemon) the sweep keeps its factors in its own folder only and says so once.
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

from pydantic import BaseModel

from sweeper.config.schema import SweepConfig
from sweeper.estimate import Estimator
from sweeper.estimate.calibration import Calibration, FitReport, Sample, calibration_key, fit, load, save
from sweeper.estimate.step_fit import StepFit, StepModel, repeat_noise
from sweeper.estimate.step_time import CLUSTER_TERMS
from sweeper.space.layout import Layout


def cache_path() -> Path:
    root = os.environ.get("SWEEPER_CACHE") or Path.home() / ".cache" / "sweeper"
    return Path(root) / "calibration.json"


# Cluster fields that say how to reach and run the cluster, not what it computes with: no prediction reads them
# (tests/estimate/test_calibration_cache.py checks), so they stay out of the calibration key.
CLUSTER_FIELDS_NOT_PRICED = frozenset({"address", "simulate", "connect_timeout_s", "warm_ranks", "host_memory_gib"})
# Model fields kept for the catalog's self-check, never in the arithmetic (models/spec.py).
MODEL_FIELDS_NOT_PRICED = frozenset({"published_total_params_b", "published_active_params_b"})

# The keys below are digests of what the predictions read (issue 54). Entries stored under the keys of before (the
# model's name and the cluster's shape only) are simply not found: a sweep or plan starts uncalibrated once and
# stores its factors under the new key, and no entry is read as another model's or another fabric's.


def _digest(value: BaseModel, exclude: frozenset[str] = frozenset()) -> str:
    return hashlib.sha256(value.model_dump_json(exclude=set(exclude)).encode()).hexdigest()[:8]


def cluster_key(cfg: SweepConfig, host_cores: int | None = None) -> str:
    """The cluster part of a calibration key: its size and GPU kind, or the host's CPU for a simulated one, a digest
    of its figures (GPU memory, capability and kind, the NVLink, NIC and host-link bandwidths: two clusters of one
    shape on different fabrics price communication differently) and one of the estimator's constants: the factors
    are corrections to the predictions those constants make, so a calibration learnt under other constants (the
    YAML's ``estimate:``, or the defaults before they were fitted on published runs, issue 46) would price this
    sweep's layouts that much off."""
    c = cfg.cluster
    figures, constants = _digest(c, CLUSTER_FIELDS_NOT_PRICED), _digest(cfg.estimate)
    if host_cores:
        return f"cpu-{host_cores}cores-{c.nodes}x{c.gpus_per_node}-fig{figures}-est{constants}"
    return f"{c.nodes}x{c.gpus_per_node}-{c.gpu_kind or 'cc' + c.compute_capability}-fig{figures}-est{constants}"


def model_key(cfg: SweepConfig) -> str:
    """The model part of a calibration key: the model's name and a digest of its whole spec (a preset with a field
    overridden is another model), and everything else that moves what a trial measures on the same cluster (issue
    43): the sequence length, the attention backend and whether Transformer Engine is installed, the megatron-core
    release, and the run settings (a digest: grad dtype, optimizer, FP8 recipe, overlaps)."""
    try:
        mcore = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        mcore = "none"
    te = "te" if importlib.util.find_spec("transformer_engine") is not None else "local"
    spec, run = _digest(cfg.model, MODEL_FIELDS_NOT_PRICED), _digest(cfg.run)
    return (f"{cfg.model.name}-spec{spec}@seq{cfg.training.seq_length}-{cfg.estimate.attention_backend}-{te}"
            f"-mcore{mcore}-run{run}")


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
class Measured:
    """What one trial measured, as the search hands it to the estimator: plain figures, not the trial record."""

    passed: bool  # only a passed trial's step time and peak calibrate
    step_time_s: float | None = None  # seconds per training step
    peak_memory_gib: float | None = None  # max over ranks of the peak memory
    peak_on_device: bool = False  # the peak is GPU memory; False: a CPU rank's host RSS, which says nothing of a GPU's
    moe_hot_rank_factor: float | None = None  # the MoE router's measured imbalance, whatever the trial's outcome


@dataclass(frozen=True)
class CalibrationUpdate:
    """What one trial changed: the refit memory/step factors (None: not a device measurement), the refit step-time
    terms (None: no step time measured), whether the estimator's predictions moved at all (a refit, or a measured
    routing imbalance raising the hot-rank factor), and a warning for the console (the shared cache not written)."""

    fit: FitReport | None = None
    step: StepFit | None = None
    changed: bool = False
    warning: str | None = None


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
        self._unlocked_cache: Path | None = None  # the cache whose filesystem refused a lock: not written again

    def add(self, layout: Layout, measured: Measured, number: int = 0) -> CalibrationUpdate:
        """Refit with one more measured trial (only a passed trial's device memory calibrates memory; any passed
        trial's step time the step-time terms). A MoE trial's measured routing imbalance raises the hot-rank factor
        on any backend (the router is the same megatron-core code on CPU and GPU)."""
        factor = measured.moe_hot_rank_factor
        raised = factor is not None and factor > ((self.current and self.current.moe_hot_rank_factor) or 1.0)
        if raised:
            self.current = replace(self.current or Calibration(), moe_hot_rank_factor=factor)
        step, warning = None, None
        if measured.passed and measured.step_time_s:
            step = self.step.add(layout, measured.step_time_s)
            self.step_trials.append((number, layout.short()))
            if self.host_cores:  # the CPU's factors: kept apart from the GPU cluster's calibration
                warning = self._save(Calibration(step_time_factor=self.step.level,
                                                 step_term_factors=self.step.factors(), samples=step.samples))
        device_memory = measured.passed and measured.peak_on_device and measured.peak_memory_gib is not None
        if device_memory:
            raw = self._raw(layout)
            self.samples.append(Sample(
                breakdown=raw.breakdown, fragmentation=self.cfg.estimate.allocator_fragmentation,
                predicted_step_s=raw.step_time_s, measured_peak_gib=measured.peak_memory_gib,
                measured_step_s=measured.step_time_s,
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
            warning = self._save(self.current)
            return CalibrationUpdate(fit=self.report if device_memory else None, step=step, changed=True,
                                     warning=warning)
        return CalibrationUpdate(step=step, changed=raised, warning=warning)

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

    def _save(self, calibration: Calibration) -> str | None:
        """Store the factors for this cluster and model, and the cluster's own step-time part for any model, in the
        sweep folder and (``shared``) the cache other sweeps read. A warning the first time the cache's filesystem
        refuses its lock (``calibration.NO_LOCKS``): the sweep then keeps its factors in its own folder only."""
        # Relative to this model's level (its compute's efficiency): another model's level is its own.
        level = calibration.step_time_factor
        links = {t: f / level for t, f in calibration.step_term_factors.items() if t in CLUSTER_TERMS}
        entries = [(key(self.cfg, self.host_cores), calibration)]
        if links:
            entries.append((calibration_key(cluster_key(self.cfg, self.host_cores), "*"),
                            Calibration(step_term_factors=links, samples=calibration.samples)))
        for name, entry in entries:  # one driver per sweep folder (record.lock): its own copy needs no lock
            save(self.sweep_file, name, entry, shared=False)
        cache = cache_path()
        if not self.shared or cache == self._unlocked_cache:
            return None
        if all(save(cache, name, entry) for name, entry in entries):
            return None
        self._unlocked_cache = cache
        return (f"{cache}: its filesystem refuses a file lock (an NFS home without a lock daemon?): this sweep's "
                f"calibration stays in {self.sweep_file} and is not shared with later sweeps (set SWEEPER_CACHE to "
                "a local folder to share it)")


def _step_fit(calibration: Calibration | None) -> StepFit | None:
    """The step-time fit a stored calibration holds (its level and its terms' own factors)."""
    if calibration is None:
        return None
    return StepFit(level=calibration.step_time_factor, factors=dict(calibration.step_term_factors),
                   samples=calibration.samples)
