"""One placement group per trial, shaped so Megatron's rank order keeps TP groups inside a node.

Megatron orders ranks tp-fastest, then cp, then dp, then pp. If consecutive blocks of ranks share a node, every
TP group (and, when the block is big enough, every CP group) is node-local and pipeline stages span nodes,
which is where their light point-to-point traffic belongs. So a trial of W ranks gets equal bundles of
``ranks_per_node`` GPUs, one bundle per node (STRICT_SPREAD), rank r in bundle ``r // ranks_per_node``; a trial
that fits one node gets one bundle (STRICT_PACK).

``trial_placement`` owns the group's lifetime: it creates the group, waits for it once with a timeout (the
``ready()`` ref is created once; an unsatisfiable group is reported as :class:`PlacementTimeout`, not waited on),
and removes it on exit whatever happened. Removing a group also kills every actor scheduled into it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import ray
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sweeper.cluster.connection import ClusterHandle
from sweeper.errors import ClusterError

# What one rank reserves besides its GPU: a logical CPU, so a node runs at most as many ranks as it has CPUs for Ray.
CPUS_PER_RANK = 1.0


def rank_slots(gpus: float, cpus: float, cpus_per_rank: float = CPUS_PER_RANK) -> int:
    """How many ranks a node's ``gpus`` and ``cpus`` hold: a rank needs one of each kind it reserves."""
    return int(min(gpus, cpus // cpus_per_rank if cpus_per_rank > 0 else gpus))


class PlacementError(ClusterError):
    """No bundle shape can place this trial on nodes of this size."""


class PlacementTimeout(ClusterError):
    """The cluster could not reserve the trial's GPUs within the timeout (busy, too small, or nodes lost)."""


@dataclass(frozen=True)
class PlacementPlan:
    world_size: int
    ranks_per_bundle: int
    cpus_per_rank: float
    strategy: str  # STRICT_PACK (one node) | STRICT_SPREAD (one bundle per node)

    @property
    def num_bundles(self) -> int:
        return self.world_size // self.ranks_per_bundle

    @property
    def bundles(self) -> list[dict[str, float]]:
        bundle = {"GPU": float(self.ranks_per_bundle), "CPU": self.cpus_per_rank * self.ranks_per_bundle}
        return [dict(bundle) for _ in range(self.num_bundles)]

    def bundle_of(self, rank: int) -> int:
        return rank // self.ranks_per_bundle

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_bundle

    def check_nodes(self, nodes: list[str]) -> None:
        """Nodes chosen for the bundles (one each), or PlacementError."""
        if len(nodes) != self.num_bundles:
            raise PlacementError(f"{len(nodes)} nodes given for {self.num_bundles} bundles")


def plan_placement(
    world_size: int, gpus_per_node: int, *, keep_together: int = 1, cpus_per_rank: float = CPUS_PER_RANK
) -> PlacementPlan:
    """Bundle shape for ``world_size`` ranks on nodes of ``gpus_per_node`` GPUs.

    ``keep_together``: size of the innermost rank blocks that must not straddle nodes (TP, or TP*CP). Uses the
    fewest nodes possible; each node gets the same number of ranks, a multiple of ``keep_together``.
    """
    if world_size < 1 or gpus_per_node < 1 or keep_together < 1:
        raise PlacementError(f"world_size, gpus_per_node and keep_together must be >= 1, got "
                             f"{world_size}, {gpus_per_node}, {keep_together}")
    if keep_together > gpus_per_node:
        raise PlacementError(f"a group of {keep_together} ranks cannot stay inside a node of {gpus_per_node} GPUs")
    if world_size <= gpus_per_node:
        return PlacementPlan(world_size, world_size, cpus_per_rank, "STRICT_PACK")
    for nodes in range(-(-world_size // gpus_per_node), world_size + 1):
        per_node = world_size // nodes
        if world_size % nodes == 0 and per_node <= gpus_per_node and per_node % keep_together == 0:
            return PlacementPlan(world_size, per_node, cpus_per_rank, "STRICT_SPREAD")
    raise PlacementError(
        f"{world_size} ranks cannot be split evenly over nodes of {gpus_per_node} GPUs "
        f"in blocks of {keep_together}"
    )


@dataclass
class TrialPlacement:
    """A ready placement group and its plan; hands out the scheduling strategy for each rank."""

    group: PlacementGroup
    plan: PlacementPlan
    name: str
    wait_s: float  # how long the reservation took

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.plan.bundle_of(rank),
            placement_group_capture_child_tasks=True,  # anything a rank spawns stays inside the trial's reservation
        )


@contextlib.contextmanager
def trial_placement(
    handle: ClusterHandle,
    world_size: int,
    gpus_per_node: int,
    timeout_s: float,
    *,
    keep_together: int = 1,
    cpus_per_rank: float = CPUS_PER_RANK,
    name: str | None = None,
    nodes: list[str] | None = None,
) -> Iterator[TrialPlacement]:
    """Reserve the trial's GPUs as one placement group; always removed on exit.

    ``nodes``: Ray node ids, one per bundle, when the caller (the sweep's scheduler, which owns the cluster's
    capacity) has already chosen where the trial goes; each bundle is pinned with Ray's node-id label.

    Raises PlacementError (no bundle shape fits) or PlacementTimeout (not reserved within ``timeout_s``;
    the message names the bundles asked for and the free GPUs and CPUs per node).
    """
    plan = plan_placement(world_size, gpus_per_node, keep_together=keep_together, cpus_per_rank=cpus_per_rank)
    name = name or f"sweeper-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    if nodes is not None:
        plan.check_nodes(nodes)
    selector = [{NODE_ID_LABEL_KEY: node} for node in nodes] if nodes is not None else None
    group = placement_group(plan.bundles, strategy=plan.strategy, name=name, bundle_label_selector=selector)
    try:
        ready_ref = group.ready()  # created once: each ready() call schedules another probe task
        done, _ = ray.wait([ready_ref], timeout=max(timeout_s, 0.0))
        if not done:
            raise PlacementTimeout(
                f"placement: {plan.num_bundles} x {plan.bundles[0]} ({plan.strategy}) not reserved within "
                f"{timeout_s:.0f}s; free per node: {_free(handle)}"
            )
        ray.get(ready_ref)
        yield TrialPlacement(group=group, plan=plan, name=name, wait_s=time.monotonic() - started)
    finally:
        remove_placement_group(group)


def _free(handle: ClusterHandle) -> str:
    """What each node has free now, GPUs and CPUs: a bundle needs both, and a node short of CPUs (a container's
    CPU limit under many GPUs) is as full as one short of GPUs."""
    try:
        free = handle.free_per_node()
    except Exception as exc:  # noqa: BLE001 - diagnostics must not mask the timeout itself
        return f"unknown ({exc})"
    nodes = [f"{label}: {gpus} GPUs and {cpus:g} CPUs" for label, (gpus, cpus) in free.items()]
    return "; ".join(nodes) or "no GPU nodes"
