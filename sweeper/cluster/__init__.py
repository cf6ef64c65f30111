"""Ray-facing cluster layer: connect to (or simulate) a multi-node cluster, list its GPUs, reserve trial placements.

Only ``sweeper.cluster`` and ``sweeper.trial`` import Ray; everything else works on the plain values exported here.
"""

from sweeper.cluster.connection import ClusterError, ClusterHandle, GpuInfo, NodeInfo, choose_mode, connect
from sweeper.cluster.placement import (
    PlacementError,
    PlacementPlan,
    PlacementTimeout,
    TrialPlacement,
    plan_placement,
    trial_placement,
)
from sweeper.cluster.simulated import SimNode, SimulatedCluster, cleanup_stale_clusters

__all__ = [
    "ClusterError",
    "ClusterHandle",
    "GpuInfo",
    "NodeInfo",
    "PlacementError",
    "PlacementPlan",
    "PlacementTimeout",
    "SimNode",
    "SimulatedCluster",
    "TrialPlacement",
    "choose_mode",
    "cleanup_stale_clusters",
    "connect",
    "plan_placement",
    "trial_placement",
]
