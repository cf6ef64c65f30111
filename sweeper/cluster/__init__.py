"""Ray-facing cluster layer: connect to (or simulate) a multi-node cluster, list its GPUs, reserve trial placements.

Only ``sweeper.cluster`` and ``sweeper.trial`` import Ray; everything else works on the plain values exported here.
"""

from sweeper.cluster.connection import ClusterHandle, GpuInfo, NodeInfo, connect
from sweeper.cluster.discovery import Probe, Target, choose_mode, probe, resolve_target
from sweeper.cluster.placement import (
    CPUS_PER_RANK,
    PlacementError,
    PlacementPlan,
    PlacementTimeout,
    TrialPlacement,
    plan_placement,
    rank_slots,
    trial_placement,
)
from sweeper.cluster.simulated import SimNode, SimulatedCluster, cleanup_stale_clusters
from sweeper.errors import ClusterError

__all__ = [
    "CPUS_PER_RANK",
    "ClusterError",
    "ClusterHandle",
    "GpuInfo",
    "NodeInfo",
    "PlacementError",
    "PlacementPlan",
    "PlacementTimeout",
    "Probe",
    "SimNode",
    "SimulatedCluster",
    "Target",
    "TrialPlacement",
    "choose_mode",
    "cleanup_stale_clusters",
    "connect",
    "plan_placement",
    "probe",
    "rank_slots",
    "resolve_target",
    "trial_placement",
]
