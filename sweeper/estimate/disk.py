"""What a sweep writes to the shared filesystem (issue 43): each trial's checkpoint and the sweep's peak.

A smoke trial saves the model's weights (torch_dist, each tensor once whatever the layout: replicas are not written
twice), no optimizer state, so its checkpoint is the model's parameters in the layout's weight precision, whatever
its parallelism. The equivalence reference is one more such checkpoint and is never deleted. With
``training.keep_checkpoints: none`` a trial deletes its checkpoint after the bitwise reload, so at most the trials
running at once hold one; with ``winner`` every checkpoint stays until the sweep ends (then all but the winner's runs'
go), with ``all`` for good.
"""

from __future__ import annotations

from dataclasses import dataclass

from sweeper.config.schema import SweepConfig
from sweeper.estimate.memory import weight_bytes_per_param
from sweeper.models.params import total_params


def checkpoint_bytes(cfg: SweepConfig, precision: str) -> int:
    """One trial's checkpoint: the model's weights in ``precision``'s weight dtype."""
    return total_params(cfg.model) * weight_bytes_per_param(precision)


@dataclass(frozen=True)
class DiskPlan:
    per_trial_bytes: int  # the largest of the space's precisions
    reference_bytes: int
    trials_at_once: int  # how many trials may hold a checkpoint at the same time
    peak_bytes: int

    def line(self, keep: str) -> str:
        gib = 2**30
        held = ("trials running at once" if keep == "none" else "every trial until the sweep ends" if keep == "winner"
                else "every trial, kept")
        return (f"checkpoints: {self.per_trial_bytes / gib:,.1f} GiB per trial (weights), the reference "
                f"{self.reference_bytes / gib:,.1f} GiB; peak disk {self.peak_bytes / gib:,.1f} GiB "
                f"(training.keep_checkpoints: {keep}: {self.trials_at_once} x a trial's, {held}, plus the reference)")


def disk_plan(cfg: SweepConfig, reference_precision: str, smallest_world_size: int) -> DiskPlan:
    """The sweep's disk footprint: the reference, plus a checkpoint per trial that holds one at the peak (the
    trials running at once under ``none``; every exploration and confirmation trial otherwise)."""
    per_trial = max(checkpoint_bytes(cfg, p) for p in cfg.space.values("precision"))
    reference = checkpoint_bytes(cfg, reference_precision)
    if not cfg.training.checkpoint:
        at_once = 0
    elif cfg.training.keep_checkpoints == "none":
        at_once = cfg.cluster.total_gpus // max(1, smallest_world_size)
        if cfg.search.parallel != "auto":
            at_once = min(at_once, cfg.search.parallel)
    else:
        at_once = cfg.search.max_trials + cfg.search.confirm_top
    return DiskPlan(per_trial, reference, at_once, reference + at_once * per_trial)
