"""Calibration placeholder (filled in below)."""
from __future__ import annotations
from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    activation_factor: float = 1.0
    overhead_gib: float = 0.0
    step_time_factor: float = 1.0
