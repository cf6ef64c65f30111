"""Trials on Ray: one actor per rank on one placement group, failure root cause, result aggregation, node checks.

``run_trial`` runs one layout and returns a TrialResult (the ``trial --json`` contract); ``doctor`` checks every
node before a sweep. Only ``sweeper.cluster`` and ``sweeper.trial`` import Ray.

The names below are imported on first use (PEP 562): a module of this package that needs no Ray (the record
aggregation, the reference's trajectory, which ``sweeper replan`` reads) is imported without Ray's 0.5 s.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sweeper.cluster.doctor import DoctorReport, NodeCheck, doctor
    from sweeper.trial.runner import DEFAULT_BACKEND, RunningTrial, run_trial

_MODULE_OF = {"DoctorReport": "sweeper.cluster.doctor", "NodeCheck": "sweeper.cluster.doctor",
              "doctor": "sweeper.cluster.doctor", "DEFAULT_BACKEND": "sweeper.trial.runner",
              "RunningTrial": "sweeper.trial.runner", "run_trial": "sweeper.trial.runner"}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["DEFAULT_BACKEND", "DoctorReport", "NodeCheck", "RunningTrial", "doctor", "run_trial"]
