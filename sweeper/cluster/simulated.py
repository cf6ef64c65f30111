"""A simulated multi-node Ray cluster on this machine: one raylet per "node", each with virtual GPUs.

This is how sweeper runs without GPUs (laptops, CI): ``ray.cluster_utils.Cluster`` starts a head raylet that
offers no CPUs or GPUs (so nothing of a trial lands on it) and N worker raylets, each advertising
``gpus_per_node`` logical GPUs and a few logical CPUs. Every worker node carries the Ray node label
``sweeper.node = sim-<i>`` so results name nodes stably (``sim-0``, ``sim-1``, ...) even after nodes are removed
and added for fault injection.

Every process of it listens and talks on 127.0.0.1 (``LOOPBACK``). Ray's processes pick their node address by
asking the OS for the route out of the machine (so on Linux they bind the interface's address), except where Ray
expects a one-machine cluster (its default on macOS and Windows, switched by ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``):
there every process uses the loopback address. ``start`` turns that switch on for the processes Ray starts (the
environment variable, which they inherit) and for this driver (the constant Ray read from it at import, which
``ray.init`` consults), names 127.0.0.1 as every node's address, and ``shutdown`` puts both back, so that a
driver joining a real cluster later in the same process is not held to loopback. Ray's usage statistics are off
for the processes of a simulated cluster (``RAY_USAGE_STATS_ENABLED=0``), so its dashboard sends no usage reports.
What Ray still does, and sweeper cannot switch off without patching it: the dashboard's usage module asks the
cloud metadata address (169.254.169.254) which cloud it runs on before it reads that switch, and sends one "usage
stats disabled" notice for a cluster not started by ``ray.init`` (ray/dashboard/modules/usage_stats/
usage_stats_head.py ``run``); both fail harmlessly on a machine without that address or the internet.

Reservations are deliberately tiny (80 MiB object store per node, logical CPUs only) so a 2 x 8 = 16-rank
cluster fits on 2 cores / 24 GB; the real limit is the ranks' own memory.

Ray's test cluster writes its address into the file ``ray start`` keeps on this machine (``ray.init(address="auto")``
reads it) and deletes it on shutdown; a simulated cluster puts back what was there, so it neither hides a user's
running cluster from ``address: auto`` nor leaves a pointer to itself behind.

A crashed driver leaves its raylets behind. Every cluster writes a record (pids with their start times, session
dir, the driver's pid) to ``record_dir``; :func:`cleanup_stale_clusters` kills the process trees of records whose
driver is gone, by pid and start time only, never by process name.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import ray._private.ray_constants as ray_constants  # private: the one-machine switch ray.init consults
from ray.cluster_utils import Cluster

from sweeper.config.files import write_atomic

NODE_LABEL_KEY = "sweeper.node"  # Ray node label carrying the stable simulated node name
LOOPBACK = "127.0.0.1"
ONE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": every Ray process takes 127.0.0.1 as its address
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"  # "0": Ray's usage reports off
_HELD_ENV = {ONE_MACHINE_ENV: "0", USAGE_STATS_ENV: "0"}
DEFAULT_RECORD_DIR = Path(tempfile.gettempdir()) / "sweeper-clusters"
_MIB = 1024 * 1024


@dataclass
class SimNode:
    """One simulated node: its stable name, Ray node id and the raylet handle Ray's test cluster gave us."""

    label: str
    node_id: str
    gpus: int
    raylet: Any  # ray._private.node.Node (private type; kept opaque)


class SimulatedCluster:
    """A head plus ``nodes`` worker raylets with ``gpus_per_node`` virtual GPUs each; a context manager.

    ``start()`` brings the raylets up (the driver connects separately, see ``sweeper.cluster.connect``);
    ``add_node()`` / ``remove_node()`` change the cluster while it runs (node join / node loss);
    ``shutdown()`` stops every process it started and deletes its record.
    """

    def __init__(
        self,
        nodes: int,
        gpus_per_node: int,
        *,
        cpus_per_node: int | None = None,
        object_store_mib: int = 80,
        record_dir: Path | None = DEFAULT_RECORD_DIR,
    ) -> None:
        if nodes < 1 or gpus_per_node < 1:
            raise ValueError(
                f"a simulated cluster needs nodes >= 1 and gpus_per_node >= 1, got {nodes} x {gpus_per_node}")
        self.initial_nodes = nodes
        self.gpus_per_node = gpus_per_node
        # Logical CPUs only: each rank actor reserves one, and a spare lets node-pinned probe tasks run beside it.
        self.cpus_per_node = cpus_per_node if cpus_per_node is not None else gpus_per_node + 1
        self.object_store_bytes = object_store_mib * _MIB
        self.record_dir = record_dir
        self._cluster: Cluster | None = None
        self._nodes: list[SimNode] = []
        self._next_index = 0
        self._removed_pids: list[tuple[int, float]] = []
        self._ray_start_address: str | None = None  # what `ray start`'s address file held before this cluster
        self._outside: tuple[dict[str, str | None], bool] | None = None  # _HELD_ENV and Ray's constant before start

    # -- lifetime ------------------------------------------------------------------------------------------------
    def start(self) -> SimulatedCluster:
        if self._cluster is not None:
            return self
        self._ray_start_address = _read_text(ray_start_address_file())
        self._hold_to_loopback()
        # shutdown_at_exit: Ray's own atexit hook and reaper stop the raylets if this driver exits normally.
        try:
            self._cluster = Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": 0, "num_gpus": 0, "object_store_memory": self.object_store_bytes,
                                "node_ip_address": LOOPBACK},
                shutdown_at_exit=True,
            )
        except BaseException:
            self._release_loopback()
            raise
        self._put_back_ray_start_address()
        self._write_record()
        try:
            for _ in range(self.initial_nodes):
                self.add_node()
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        """Stop every raylet this cluster started (workers first, then the head) and delete the record."""
        if self._cluster is None:
            return
        cluster, self._cluster = self._cluster, None
        try:
            # Ray's Cluster.shutdown kills worker raylets and the head, waiting for each (no zombies).
            cluster.shutdown()
        finally:
            self._put_back_ray_start_address()
            self._release_loopback()
            self._nodes.clear()
            self._kill_leftovers()
            self._delete_record()

    def __enter__(self) -> SimulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- membership ----------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("simulated cluster not started")
        return self._cluster.address

    @property
    def nodes(self) -> list[SimNode]:
        """Worker nodes currently part of the cluster (the head holds no GPUs and is not listed)."""
        return list(self._nodes)

    def add_node(self) -> SimNode:
        """Start one more node with ``gpus_per_node`` virtual GPUs; returns once Ray lists it."""
        if self._cluster is None:
            raise RuntimeError("simulated cluster not started")
        label = f"sim-{self._next_index}"
        self._next_index += 1
        raylet = self._cluster.add_node(
            wait=True,
            num_cpus=self.cpus_per_node,
            num_gpus=self.gpus_per_node,
            node_ip_address=LOOPBACK,
            object_store_memory=self.object_store_bytes,
            labels={NODE_LABEL_KEY: label},
        )
        node = SimNode(label=label, node_id=raylet.node_id, gpus=self.gpus_per_node, raylet=raylet)
        self._nodes.append(node)
        self._write_record()
        return node

    def remove_node(self, node: SimNode | str, *, graceful: bool = False) -> None:
        """Kill one node's raylet and everything under it (its rank processes included): a node loss.

        ``node`` is a SimNode, its label (``sim-1``) or its Ray node id.
        """
        if self._cluster is None:
            raise RuntimeError("simulated cluster not started")
        target = self._find(node)
        self._removed_pids += _tree(_node_pids(target.raylet))
        self._cluster.remove_node(target.raylet, allow_graceful=graceful)
        self._nodes.remove(target)
        self._write_record()

    def node_for(self, node_id: str) -> SimNode | None:
        return next((n for n in self._nodes if n.node_id == node_id), None)

    def _find(self, node: SimNode | str) -> SimNode:
        key = node.node_id if isinstance(node, SimNode) else node
        for candidate in self._nodes:
            if key in (candidate.label, candidate.node_id):
                return candidate
        raise KeyError(f"no simulated node {key!r} (nodes: {', '.join(n.label for n in self._nodes) or 'none'})")

    # -- record and cleanup ----------------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Pids of the Ray daemons this cluster started (head services and raylets); workers are their children."""
        if self._cluster is None:
            return []
        return [pid for raylet in self._cluster.list_all_nodes() for pid in _node_pids(raylet)]

    @property
    def session_dir(self) -> str | None:
        if self._cluster is None or self._cluster.head_node is None:
            return None
        return self._cluster.head_node.get_session_dir_path()

    @property
    def record_path(self) -> Path | None:
        if self.record_dir is None:
            return None
        return self.record_dir / f"cluster-{os.getpid()}-{id(self):x}.json"

    def _write_record(self) -> None:
        path = self.record_path
        if path is None or self._cluster is None:
            return
        record = {
            "driver_pid": os.getpid(),
            "driver_create_time": psutil.Process().create_time(),
            "address": self.address,
            "session_dir": self.session_dir,
            "nodes": [{"label": n.label, "node_id": n.node_id} for n in self._nodes],
            "processes": [[pid, created] for pid, created in _with_create_time(self.pids())],
        }
        write_atomic(path, json.dumps(record, indent=1))

    def _delete_record(self) -> None:
        path = self.record_path
        if path is not None:
            path.unlink(missing_ok=True)

    def _put_back_ray_start_address(self) -> None:
        path = ray_start_address_file()
        current = _read_text(path)
        ours = self._cluster.address if self._cluster is not None else None
        if current is not None and current != ours:
            return  # somebody ran `ray start` since: theirs stays
        try:
            if self._ray_start_address is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(self._ray_start_address)
        except OSError:
            pass

    def _hold_to_loopback(self) -> None:
        """Ray's one-machine mode on and its usage stats off (see the module docstring), remembering what was."""
        self._outside = ({name: os.environ.get(name) for name in _HELD_ENV}, ray_constants.ENABLE_RAY_CLUSTER)
        os.environ.update(_HELD_ENV)
        ray_constants.ENABLE_RAY_CLUSTER = False

    def _release_loopback(self) -> None:
        if self._outside is None:
            return
        env, constant = self._outside
        self._outside = None
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ray_constants.ENABLE_RAY_CLUSTER = constant

    def _kill_leftovers(self) -> None:
        # Rank processes of a removed node are normally gone with their raylet; make sure, by pid + start time.
        _kill_exact(self._removed_pids)
        self._removed_pids.clear()


def ray_start_address_file() -> Path:
    """The file where ``ray start`` records the cluster's address for ``ray.init(address="auto")``."""
    try:
        from ray._common.utils import get_ray_address_file

        return Path(get_ray_address_file(None))
    except (ImportError, AttributeError):  # Ray keeps it in its temp folder: RAY_TMPDIR, else TMPDIR, else /tmp
        root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        return Path(root) / "ray" / "ray_current_cluster"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cleanup_stale_clusters(record_dir: Path = DEFAULT_RECORD_DIR) -> list[int]:
    """Kill simulated clusters whose driver died (a SIGKILLed sweep); returns the pids it killed.

    Only processes named in a record, with the same start time as recorded, and their children are touched.
    """
    killed: list[int] = []
    if not record_dir.is_dir():
        return killed
    for path in sorted(record_dir.glob("cluster-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(record["driver_pid"], record.get("driver_create_time")):
            continue  # its driver still owns it
        recorded = [(int(pid), float(created)) for pid, created in record.get("processes", [])]
        killed += _kill_exact(_tree(recorded))
        path.unlink(missing_ok=True)
    return killed


# -- process helpers -------------------------------------------------------------------------------------------------
def _node_pids(raylet: Any) -> list[int]:
    return [info.process.pid for infos in raylet.all_processes.values() for info in infos if info.process is not None]


def _with_create_time(pids: list[int]) -> list[tuple[int, float]]:
    out = []
    for pid in pids:
        try:
            out.append((pid, psutil.Process(pid).create_time()))
        except psutil.Error:
            continue
    return out


def _tree(recorded: list[tuple[int, float]] | list[int]) -> list[tuple[int, float]]:
    """The recorded processes that still are what was recorded, plus all their descendants (workers, agents)."""
    out: list[tuple[int, float]] = []
    for item in recorded:
        pid, created = item if isinstance(item, tuple) else (item, None)
        try:
            proc = psutil.Process(pid)
            if created is not None and abs(proc.create_time() - created) > 1.0:
                continue  # the pid was reused by an unrelated process
            family = [proc] + proc.children(recursive=True)
        except psutil.Error:
            continue
        for member in family:
            try:
                out.append((member.pid, member.create_time()))
            except psutil.Error:
                continue
    return out


def _alive(pid: int, created: float | None) -> bool:
    try:
        proc = psutil.Process(pid)
        return created is None or abs(proc.create_time() - created) <= 1.0
    except psutil.Error:
        return False


def _kill_exact(recorded: list[tuple[int, float]]) -> list[int]:
    procs = []
    for pid, created in recorded:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) <= 1.0 and pid != os.getpid():
                proc.kill()
                procs.append(proc)
        except psutil.Error:
            continue
    psutil.wait_procs(procs, timeout=5)
    return [p.pid for p in procs]


def wait_for_node_count(expected: int, timeout_s: float = 30.0) -> None:
    """Block until Ray reports ``expected`` alive GPU nodes (node joins and losses take a moment to propagate)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]
        if len(alive) == expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray reports {len(alive)} alive GPU nodes, expected {expected} after {timeout_s:.0f}s")
        time.sleep(0.2)
