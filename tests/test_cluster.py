"""sweeper.cluster: placement planning and mode choice (pure), then a real simulated 2-node x 2-GPU Ray cluster:
inventory, placement groups that keep TP pairs inside a node, unsatisfiable placements, node join and loss.

Every Ray test checks afterwards that no placement group and no sweeper actor is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sweeper.cluster import (
    ClusterError,
    PlacementError,
    PlacementTimeout,
    choose_mode,
    cleanup_stale_clusters,
    connect,
    plan_placement,
    trial_placement,
)
from sweeper.config import ClusterConfig


# -- pure: placement plans ---------------------------------------------------------------------------------------
def test_plan_one_node_is_one_packed_bundle() -> None:
    plan = plan_placement(2, 2)
    assert (plan.strategy, plan.num_bundles, plan.ranks_per_bundle) == ("STRICT_PACK", 1, 2)
    assert plan.bundles == [{"GPU": 2.0, "CPU": 2.0}]


def test_plan_spreads_equal_blocks_over_nodes() -> None:
    plan = plan_placement(4, 2, keep_together=2)
    assert (plan.strategy, plan.num_bundles) == ("STRICT_SPREAD", 2)
    assert [plan.bundle_of(r) for r in range(4)] == [0, 0, 1, 1]
    sixteen = plan_placement(16, 8, keep_together=2)
    assert (sixteen.num_bundles, sixteen.ranks_per_bundle) == (2, 8)


def test_plan_keeps_tp_blocks_whole_even_if_it_needs_more_nodes() -> None:
    # 6 ranks, TP=2, 4-GPU nodes: 2 nodes x 3 would split a TP pair; 3 nodes x 2 keeps pairs whole.
    plan = plan_placement(6, 4, keep_together=2)
    assert (plan.num_bundles, plan.ranks_per_bundle) == (3, 2)


def test_plan_rejects_a_group_larger_than_a_node() -> None:
    with pytest.raises(PlacementError, match="cannot stay inside a node of 2 GPUs"):
        plan_placement(4, 2, keep_together=4)


# -- pure: which cluster connect() picks ---------------------------------------------------------------------------
def test_mode_choice() -> None:
    assert choose_mode(ClusterConfig(simulate=True)) == "simulated"
    assert choose_mode(ClusterConfig(simulate=False, address="local")) == "local"
    assert choose_mode(ClusterConfig(simulate=False)) == "auto"
    assert choose_mode(ClusterConfig(simulate="auto", address="10.0.0.1:6379")) == "remote"
    assert choose_mode(ClusterConfig(simulate="auto"), address_override="10.0.0.1:6379") == "remote"
    with pytest.raises(ClusterError, match="simulate"):
        choose_mode(ClusterConfig(simulate=True, address="10.0.0.1:6379"))


def test_stale_cluster_cleanup_kills_only_recorded_processes_of_dead_drivers(tmp_path: Path) -> None:
    import json

    import psutil

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead_driver = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_driver.wait()
    try:
        record = {
            "driver_pid": dead_driver.pid,
            "driver_create_time": 0.0,
            "processes": [[victim.pid, psutil.Process(victim.pid).create_time()]],
        }
        (tmp_path / "cluster-1-a.json").write_text(json.dumps(record))
        assert cleanup_stale_clusters(tmp_path) == [victim.pid]
        assert victim.wait(timeout=5) is not None
        assert bystander.poll() is None
        assert not list(tmp_path.glob("cluster-*.json"))
    finally:
        for proc in (victim, bystander):
            proc.kill()
            proc.wait()


# -- e2e: a simulated cluster ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    cfg = ClusterConfig(nodes=2, gpus_per_node=2, gpu_memory_gib=4, simulate=True)
    record_dir = tmp_path_factory.mktemp("records")
    with connect(cfg, record_dir=record_dir) as handle:
        yield handle
    assert not list(record_dir.glob("cluster-*.json")), "shutdown must delete the cluster record"


def assert_nothing_left(timeout_s: float = 15.0) -> None:
    """No placement group still reserved and no sweeper actor alive (kills and removals are asynchronous)."""
    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        actors = [a for a in list_actors(filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)
                  if (a.name or "").startswith("sweeper-") or a.class_name in ("RankActor", "_Probe")]
        if not groups and not actors:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: groups={groups} actors={actors}")
        time.sleep(0.3)


@pytest.mark.e2e
def test_inventory_of_the_simulated_cluster(sim) -> None:
    nodes = sim.nodes()
    assert [n.label for n in nodes] == ["sim-0", "sim-1"]
    assert all(n.gpus == 2 and not n.is_head for n in nodes)
    assert sim.free_gpus_per_node() == {"sim-0": 2, "sim-1": 2}
    gpus = sim.gpu_info()
    assert gpus["sim-0"].source == "simulated" and gpus["sim-0"].memory_gib == 4
    assert sim.simulated is not None and len(sim.simulated.pids()) >= 3
    assert sim.simulated.record_path is not None and sim.simulated.record_path.exists()


@pytest.mark.e2e
def test_placement_keeps_tp_pairs_on_one_node_and_is_removed(sim) -> None:
    import ray

    @ray.remote(num_gpus=1, num_cpus=1)
    class _Probe:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    with trial_placement(sim, 4, 2, timeout_s=30, keep_together=2, name="sweeper-test-tp") as placement:
        assert placement.plan.strategy == "STRICT_SPREAD"
        actors = [_Probe.options(scheduling_strategy=placement.strategy(r)).remote() for r in range(4)]
        nodes = ray.get([a.node.remote() for a in actors])
        assert sim.free_gpus_per_node() == {"sim-0": 0, "sim-1": 0}
    labels = [sim.label_of(n) for n in nodes]
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[0] != labels[2]
    assert_nothing_left()  # removing the group killed its actors too
    assert sim.free_gpus_per_node() == {"sim-0": 2, "sim-1": 2}


@pytest.mark.e2e
def test_unsatisfiable_placement_times_out_and_is_removed(sim) -> None:
    started = time.monotonic()
    with pytest.raises(PlacementTimeout, match=r"not reserved within 2s; free GPUs per node: sim-0=2, sim-1=2"):
        with trial_placement(sim, 6, 2, timeout_s=2, name="sweeper-test-too-big"):
            pytest.fail("a 3-node placement cannot be ready on 2 nodes")
    assert time.monotonic() - started < 10
    assert_nothing_left()


@pytest.mark.e2e
def test_group_is_removed_when_the_body_raises(sim) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with trial_placement(sim, 2, 2, timeout_s=30, name="sweeper-test-raise"):
            raise RuntimeError("boom")
    assert_nothing_left()


@pytest.mark.e2e
def test_node_join_and_loss(sim) -> None:
    from sweeper.cluster.simulated import wait_for_node_count

    cluster = sim.simulated
    joined = cluster.add_node()
    wait_for_node_count(3)
    assert joined.label == "sim-2"
    assert [n.label for n in sim.nodes()] == ["sim-0", "sim-1", "sim-2"]
    assert sim.free_gpus_per_node()["sim-2"] == 2
    raylet_pid = next(p for p in cluster.pids() if p not in _pids_without(cluster, joined))
    cluster.remove_node(joined)
    wait_for_node_count(2)
    assert [n.label for n in sim.nodes()] == ["sim-0", "sim-1"]
    assert not _pid_alive(raylet_pid)
    assert_nothing_left()


def _pids_without(cluster, node) -> set[int]:
    from sweeper.cluster.simulated import _node_pids

    return {p for n in cluster.nodes if n is not node for p in _node_pids(n.raylet)} | set(
        _node_pids(cluster._cluster.head_node)  # noqa: SLF001 - test introspection
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
