"""Feeding measured trials back into the estimator while a sweep runs (estimator issue, item 6).

Only device measurements calibrate: on the CPU backend the measured peak is host RSS of a gloo process, which
says nothing about GPU memory, so a simulated sweep keeps the uncalibrated estimator and says so. Fitted factors
are stored per cluster+model in the user's cache (``$SWEEPER_CACHE`` or ``~/.cache/sweeper/calibration.json``)
and copied into the sweep folder, so the next sweep on the same cluster starts calibrated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from sweeper.config.schema import SweepConfig
from sweeper.estimate import Estimator
from sweeper.estimate.calibration import Calibration, FitReport, Sample, calibration_key, fit, load, save
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout


def cache_path() -> Path:
    root = os.environ.get("SWEEPER_CACHE") or Path.home() / ".cache" / "sweeper"
    return Path(root) / "calibration.json"


def key(cfg: SweepConfig) -> str:
    c = cfg.cluster
    return calibration_key(f"{c.nodes}x{c.gpus_per_node}-{c.gpu_kind or 'cc' + c.compute_capability}", cfg.model.name)


@dataclass(frozen=True)
class CalibrationUpdate:
    """What one trial changed: the refit memory/step factors (None: not a device measurement), and whether the
    estimator's predictions moved at all (a refit, or a measured routing imbalance raising the hot-rank factor)."""

    fit: FitReport | None = None
    changed: bool = False


class Calibrator:
    def __init__(self, cfg: SweepConfig, sweep_dir: Path) -> None:
        self.cfg = cfg
        self.sweep_file = sweep_dir / "calibration.json"
        self.samples: list[Sample] = []
        self.current: Calibration | None = load(cache_path(), key(cfg))
        self.report: FitReport | None = None
        self._raw = Estimator.for_config(cfg)  # the uncalibrated predictions the samples are fitted against

    def add(self, layout: Layout, result: TrialResult) -> CalibrationUpdate:
        """Refit with one more measured trial (only a passed trial's device memory calibrates memory). A MoE
        trial's measured routing imbalance raises the hot-rank factor on any backend (the router is the same
        megatron-core code on CPU and GPU)."""
        factor = result.metrics.moe_hot_rank_factor
        raised = factor is not None and factor > ((self.current and self.current.moe_hot_rank_factor) or 1.0)
        if raised:
            self.current = replace(self.current or Calibration(), moe_hot_rank_factor=factor)
        if not result.passed or result.memory_kind != "device" or result.metrics.peak_memory_gib is None:
            return CalibrationUpdate(changed=raised)
        raw = self._raw(layout)
        self.samples.append(Sample(
            breakdown=raw.breakdown, fragmentation=self.cfg.estimate.allocator_fragmentation,
            predicted_step_s=raw.step_time_s, measured_peak_gib=result.metrics.peak_memory_gib,
            measured_step_s=result.metrics.step_time_s,
        ))
        self.report = fit(self.samples)
        hot = self.current.moe_hot_rank_factor if self.current else None
        self.current = replace(self.report.calibration, moe_hot_rank_factor=hot)
        save(cache_path(), key(self.cfg), self.current)
        save(self.sweep_file, key(self.cfg), self.current)
        return CalibrationUpdate(fit=self.report, changed=True)
