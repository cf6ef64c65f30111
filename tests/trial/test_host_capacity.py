"""The GPU ledger's reads of the cluster: one read of Ray's node table answers a whole fill (issue 43), and GPUs
another Ray job holds are not this sweep's to reserve (issue 46).

``CountingHandle`` is a STAND-IN for a Ray cluster handle (it counts the node-table reads a real one makes with
ray.nodes()); the ledger, TrialHost, is the real one. The other-jobs test runs a real simulated Ray cluster and a
second real Ray job (its own driver process) that holds GPUs on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sweeper.cluster.connection import NodeInfo
from sweeper.config.load import load_config
from sweeper.space.layout import Layout
from sweeper.trial import host as host_module
from sweeper.trial.host import TrialHost

ROOT = Path(__file__).resolve().parents[2]


class CountingHandle:
    """Two 8-GPU nodes of a GPU cluster (stand-in): counts how often the node table is read."""

    is_simulated = False
    simulated = None

    def __init__(self) -> None:
        self.reads = 0

    def nodes(self) -> list[NodeInfo]:
        self.reads += 1
        return [NodeInfo(f"n{i}", f"10.0.0.{i}", f"10.0.0.{i}", 8, 64.0, i == 0) for i in range(2)]

    def available(self) -> dict[str, tuple[float, float]]:
        return {f"n{i}": (8.0, 64.0) for i in range(2)}  # no other job on this stand-in cluster


def test_a_fill_of_many_capacity_questions_reads_the_node_table_once(monkeypatch) -> None:
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    handle = CountingHandle()
    host = TrialHost(cfg, handle)  # type: ignore[arg-type]
    layouts = [Layout(world_size=8, ep=8, gbs=64), Layout(world_size=16, ep=8, gbs=64)] * 50
    assert all(host.fits(lo) for lo in layouts)
    assert host.reserve(layouts[1]) is not None and not host.fits(layouts[0])  # the ledger still counts
    assert handle.reads == 1  # was one ray.nodes() per question: 102 here
    monkeypatch.setattr(host_module, "CAPACITY_SNAPSHOT_S", 0.0)  # the snapshot expired: read again
    host.fits(layouts[0])
    assert handle.reads == 2


# The second job: its own Ray driver on the sweep's cluster, holding GPUS GPUs of one node in a placement group
# until its standard input closes. It prints the node it got.
_OTHER_JOB = r"""
import sys, ray
from ray.util.placement_group import placement_group, placement_group_table
ray.init(address=sys.argv[1], log_to_driver=False)
group = placement_group([{"GPU": float(sys.argv[2]), "CPU": 0.01}], strategy="STRICT_PACK")
ray.get(group.ready(), timeout=120)
print(placement_group_table(group)["bundles_to_node_id"][0], flush=True)
sys.stdin.read()
"""


@pytest.mark.e2e
def test_gpus_another_ray_job_holds_are_not_reserved_and_are_said(tmp_path: Path) -> None:
    import ray

    from sweeper.search.progress import Progress
    from sweeper.trial.host import open_host

    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")  # a simulated 2 x 2 cluster
    cfg = cfg.model_copy(update=dict(cluster=cfg.cluster.model_copy(update=dict(warm_ranks=False))))
    with open_host(cfg) as host:
        assert host.held_by_others() == 0 and host.fits(Layout(world_size=4, gbs=4))
        address = ray.get_runtime_context().gcs_address
        job = subprocess.Popen([sys.executable, "-c", _OTHER_JOB, address, "2"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        try:
            taken = job.stdout.readline().strip()  # the node the other job holds both GPUs of
            assert taken, "the second job got no placement group"
            deadline = time.monotonic() + 20
            while host.held_by_others() != 2 and time.monotonic() < deadline:  # raylets report with a lag
                time.sleep(0.5)
            assert host.held_by_others() == 2
            assert not host.fits(Layout(world_size=4, gbs=4))  # was: reserved, then a placement timeout (infra)
            slot = host.reserve(Layout(world_size=2, gbs=2))
            assert slot is not None and slot.node_ids == [next(n.node_id for n in host.handle.nodes()
                                                               if n.node_id != taken)]
            assert not host.fits(Layout(world_size=2, gbs=2))  # the sweep's own reservation and the other job's
            host.release(slot)
            line = Progress(4, "tokens/s", time.monotonic()).line([], 0, 0, None, others=host.held_by_others(),
                                                                   waiting=True)
            assert line.endswith("waiting for 2 GPUs held by other jobs")
        finally:
            job.stdin.close()
            job.wait(timeout=60)
        deadline = time.monotonic() + 20
        while host.held_by_others() and time.monotonic() < deadline:  # the job's group goes with its driver
            time.sleep(0.5)
        assert host.held_by_others() == 0 and host.fits(Layout(world_size=4, gbs=4))


def test_a_trial_reserved_alone_has_its_nodes_to_itself_until_released() -> None:
    """search.confirm_alone (issue 46): a confirmation's nodes carry no other trial of the sweep while it runs."""
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    host = TrialHost(cfg, CountingHandle())  # type: ignore[arg-type]
    one_node = Layout(world_size=8, ep=8, gbs=64)
    half = Layout(world_size=4, ep=4, gbs=64)
    explore = host.reserve(half)  # half of one node
    assert explore is not None
    alone = host.reserve(one_node, alone=True)
    assert alone is not None and alone.alone and set(alone.node_ids).isdisjoint(explore.node_ids)
    assert host.reserve(one_node, alone=True) is None  # the other node is shared with the exploration
    assert host.reserve(half) is not None  # beside the exploration: fine
    assert not host.fits(half)  # both nodes full now
    host.release(alone)
    assert host.reserve(half) is not None  # the confirmation's node takes an exploration again


def test_a_node_held_alone_takes_no_other_trial_even_with_free_gpus() -> None:
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    host = TrialHost(cfg, CountingHandle())  # type: ignore[arg-type]
    half = Layout(world_size=4, ep=4, gbs=64)
    alone = host.reserve(half, alone=True)  # four of a node's eight GPUs
    assert alone is not None
    first = host.reserve(half)
    assert first is not None and set(first.node_ids).isdisjoint(alone.node_ids)
    second = host.reserve(half)
    assert second is not None and set(second.node_ids).isdisjoint(alone.node_ids)
    assert host.reserve(half) is None  # four GPUs are free on the confirmation's node, and stay its own


class OneNodeHandle:
    """One node of ``gpus`` GPUs and ``cpus`` CPUs (stand-in for a Ray cluster handle); ``taken`` is what Ray says
    is held there now, GPUs and CPUs, whoever holds it."""

    is_simulated = False
    simulated = None

    def __init__(self, gpus: int, cpus: float) -> None:
        self.gpus, self.cpus = gpus, cpus
        self.taken = (0.0, 0.0)

    def nodes(self) -> list[NodeInfo]:
        return [NodeInfo("n0", "10.0.0.1", "10.0.0.1", self.gpus, self.cpus, True)]

    def available(self) -> dict[str, tuple[float, float]]:
        return {"n0": (self.gpus - self.taken[0], self.cpus - self.taken[1])}


def _one_node(gpus: int) -> Any:
    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    return cfg.model_copy(update=dict(cluster=cfg.cluster.model_copy(update=dict(nodes=1, gpus_per_node=gpus))))


def test_a_node_with_fewer_cpus_than_gpus_holds_as_many_ranks_as_cpus_and_says_what_it_lacks() -> None:
    """Issue 51: a container's CPU limit of 2 under 4 GPUs; each rank reserves a CPU, so 4 ranks never place there."""
    host = TrialHost(_one_node(4), OneNodeHandle(4, 2.0))  # type: ignore[arg-type]
    four, two = Layout(world_size=4, gbs=8), Layout(world_size=2, gbs=8)
    assert host.capacity_total() == 2
    assert not host.fits(four) and host.fits(two)
    assert host.lacks(four) == ("TP1-PP1-DP4-MBS1-bf16 needs 1 node(s) with 4 GPUs and 4 CPUs each (a rank reserves "
                                "1 GPU and 1 CPU); 10.0.0.1 has 4 GPUs and 2 CPUs")
    assert host.lacks(two) is None
    assert host.held_by_others() == 0  # nobody holds anything: the CPUs are missing, not taken


def test_cpus_another_job_holds_are_rank_slots_it_holds() -> None:
    handle = OneNodeHandle(4, 8.0)
    handle.taken = (0.0, 6.0)  # another job's CPU-only work: 4 GPUs free, 2 CPUs
    host = TrialHost(_one_node(4), handle)  # type: ignore[arg-type]
    assert host.held_by_others() == 2 and not host.fits(Layout(world_size=4, gbs=8))


def test_a_trial_that_just_ended_is_not_read_as_another_jobs(monkeypatch) -> None:
    """Issue 51: Ray frees a removed placement group a moment later; until then its GPUs read as taken. They stay
    this sweep's for RELEASE_GRACE_S after release, and only then count as another job's."""
    monkeypatch.setattr(host_module, "CAPACITY_SNAPSHOT_S", 0.0)  # every ask reads Ray again
    handle = OneNodeHandle(4, 8.0)
    host = TrialHost(_one_node(4), handle)  # type: ignore[arg-type]
    two = Layout(world_size=2, gbs=8)
    slot = host.reserve(two)
    assert slot is not None
    handle.taken = (2.0, 2.0)  # its placement group is made
    assert host.held_by_others() == 0
    host.release(slot)  # the trial ended; Ray has not freed the group yet
    assert host.held_by_others() == 0  # not said to be another job's
    assert not host.fits(Layout(world_size=4, gbs=8))  # but not reserved either until Ray says it is free
    handle.taken = (0.0, 0.0)  # Ray freed it
    assert host.held_by_others() == 0 and host.fits(Layout(world_size=4, gbs=8))
    handle.taken = (2.0, 2.0)
    monkeypatch.setattr(host_module, "RELEASE_GRACE_S", 0.0)  # still taken after the grace: another job's now
    assert host.held_by_others() == 2


def test_a_trial_that_just_ended_and_was_freed_is_not_counted_twice(monkeypatch) -> None:
    """Seen on a ray start node: the reference ended, Ray freed its GPU at once, another job held 3 of the 4; counting
    the ended trial as the sweep's as well made 2 GPUs look free, and a 2-GPU placement timed out after 240 s."""
    monkeypatch.setattr(host_module, "CAPACITY_SNAPSHOT_S", 0.0)
    handle = OneNodeHandle(4, 8.0)
    host = TrialHost(_one_node(4), handle)  # type: ignore[arg-type]
    slot = host.reserve(Layout(world_size=1, gbs=8))
    assert slot is not None
    handle.taken = (4.0, 4.0)  # its group and another job's 3 GPUs
    host.release(slot)
    handle.taken = (3.0, 3.0)  # Ray freed the ended trial's GPU at once
    assert not host.fits(Layout(world_size=2, gbs=8))  # one GPU is free, not two
    assert host.fits(Layout(world_size=1, gbs=8))
