"""The GPU ledger's reads of the cluster (issue 43): one read of Ray's node table answers a whole fill.

The handle below is a STAND-IN for a Ray cluster handle (it counts the node-table reads a real one makes with
ray.nodes()); the ledger, TrialHost, is the real one.
"""

from __future__ import annotations

from pathlib import Path

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
