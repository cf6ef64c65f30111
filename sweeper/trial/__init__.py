"""Trials on Ray: one actor per rank on one placement group, failure root cause, result aggregation, node checks.

``run_trial`` runs one layout and returns a TrialResult (the ``trial --json`` contract); ``doctor`` checks every
node before a sweep. Only ``sweeper.cluster`` and ``sweeper.trial`` import Ray.
"""

from sweeper.cluster.doctor import DoctorReport, NodeCheck, doctor
from sweeper.trial.runner import DEFAULT_BACKEND, RunningTrial, run_trial

__all__ = ["DEFAULT_BACKEND", "DoctorReport", "NodeCheck", "RunningTrial", "doctor", "run_trial"]
