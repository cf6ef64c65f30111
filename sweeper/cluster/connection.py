"""Connecting the driver to Ray, and what the cluster holds: nodes, GPUs per node, GPU kind and memory.

``connect(cluster_cfg, address_override)`` is the one way in. Which cluster it uses is decided first, in
``sweeper.cluster.discovery`` (a simulated one, a new local instance, the Ray cluster already running, or the
address given), within a bounded time and without starting anything; ``connect`` prints that decision as one line
on stderr (``cluster: ...``), then starts or joins it:

- simulated: a :class:`SimulatedCluster` of ``nodes x gpus_per_node`` virtual GPUs on this machine;
- local: a fresh single-node Ray instance on this machine;
- existing / remote: the running cluster found from ``RAY_ADDRESS`` or ``ray start``'s address file, or the address
  given (``HOST:PORT``, ``ray://HOST:PORT``), which has answered the probe.

The handle it yields lists nodes with short stable labels (``sim-0`` on the simulated cluster, the node's IP on
real ones, ``IP:port`` when several raylets share an IP) which trial results use as ``rank_nodes``. GPU kind and
memory come from the nodes themselves on real clusters (a tiny task per node running ``nvidia-smi``, falling back
to torch) and from the configuration on the simulated one, labelled ``simulated``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sweeper.cluster.discovery import Kind, Mode, Target, choose_mode, cuda_visible, resolve_target
from sweeper.cluster.simulated import DEFAULT_RECORD_DIR, NODE_LABEL_KEY, SimulatedCluster, cleanup_stale_clusters
from sweeper.config.schema import ClusterConfig
from sweeper.config.units import GIB
from sweeper.errors import ClusterError

__all__ = ["ClusterError", "ClusterHandle", "GpuInfo", "Mode", "NodeInfo", "Target", "choose_mode", "connect",
           "cuda_visible", "resolve_target"]


@dataclass(frozen=True)
class GpuInfo:
    kind: str  # e.g. "NVIDIA H100 80GB HBM3", or "simulated h100"
    memory_gib: float
    compute_capability: str | None
    source: Literal["simulated", "nvidia-smi", "torch", "unknown"]


@dataclass(frozen=True)
class NodeInfo:
    node_id: str  # Ray's hex node id
    label: str  # short and stable: sim-0 | 10.0.0.5 | 10.0.0.5:41234
    ip: str
    gpus: int  # total GPUs Ray schedules on this node
    cpus: float
    is_head: bool


@dataclass
class ClusterHandle:
    """A connected Ray cluster. Everything sweeper asks Ray about the cluster goes through here."""

    mode: Kind
    address: str
    cluster_cfg: ClusterConfig
    simulated: SimulatedCluster | None = None
    description: str = ""  # which cluster this is and why it was chosen (the line connect printed)
    _gpu_cache: dict[str, GpuInfo] = field(default_factory=dict, repr=False)

    @property
    def is_simulated(self) -> bool:
        return self.simulated is not None

    def nodes(self, *, gpu_only: bool = True) -> list[NodeInfo]:
        """Alive nodes (only those offering GPUs unless ``gpu_only=False``), in a stable order (by label)."""
        raw = [n for n in ray.nodes() if n.get("Alive")]
        ips = [n["NodeManagerAddress"] for n in raw]
        out = []
        for n in raw:
            resources = n.get("Resources", {})
            if gpu_only and resources.get("GPU", 0) <= 0:
                continue
            out.append(
                NodeInfo(
                    node_id=n["NodeID"],
                    label=_label(n, shared_ip=ips.count(n["NodeManagerAddress"]) > 1),
                    ip=n["NodeManagerAddress"],
                    gpus=int(resources.get("GPU", 0)),
                    cpus=float(resources.get("CPU", 0)),
                    is_head="node:__internal_head__" in resources,
                )
            )
        return sorted(out, key=lambda node: _natural(node.label))

    def label_of(self, node_id: str) -> str:
        """The short label of a node id (dead nodes included, so a failed trial still names where it ran)."""
        raw = ray.nodes()
        ips = [n["NodeManagerAddress"] for n in raw if n.get("Alive")]
        for n in raw:
            if n["NodeID"] == node_id:
                return _label(n, shared_ip=ips.count(n["NodeManagerAddress"]) > 1)
        return node_id[:8]

    def node_alive(self, node_id: str) -> bool:
        """Whether a node is still part of the cluster. On the simulated cluster the answer is immediate; Ray's
        own view of a killed node turns dead only after its health checks time out."""
        if self.simulated is not None and self.simulated.node_for(node_id) is None:
            return False
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())

    def gpus_per_node(self) -> dict[str, int]:
        return {node.label: node.gpus for node in self.nodes()}

    def free_per_node(self) -> dict[str, tuple[int, float]]:
        """GPUs and CPUs not reserved by any placement group or actor right now, per node label."""
        available = self.available()
        free = {node.label: available.get(node.node_id, (0.0, 0.0)) for node in self.nodes()}
        return {label: (int(gpus), cpus) for label, (gpus, cpus) in free.items()}

    def free_gpus_per_node(self) -> dict[str, int]:
        return {label: gpus for label, (gpus, _) in self.free_per_node().items()}

    def available(self) -> dict[str, tuple[float, float]]:
        """(GPUs, CPUs) no placement group or actor of any job holds right now, per node id (this sweep's own
        included): a rank needs both."""
        # Ray has no public per-node "available" view; the GCS accessor behind ray.available_resources() does.
        available = ray._private.state.available_resources_per_node()  # noqa: SLF001
        return {node_id: (float(resources.get("GPU", 0.0)), float(resources.get("CPU", 0.0)))
                for node_id, resources in available.items()}

    def gpu_info(self) -> dict[str, GpuInfo]:
        """GPU kind and memory per node label: from the config on a simulated cluster, from the node otherwise."""
        nodes = self.nodes()
        if self.is_simulated:
            cfg = self.cluster_cfg
            kind = f"simulated {cfg.gpu_kind or 'gpu'} (cc {cfg.compute_capability})"
            return {
                n.label: GpuInfo(kind, float(cfg.gpu_memory_gib), cfg.compute_capability, "simulated") for n in nodes
            }
        missing = [n for n in nodes if n.node_id not in self._gpu_cache]
        if missing:
            refs = [_probe_gpu.options(scheduling_strategy=_pin(n.node_id)).remote() for n in missing]
            for node, info in zip(missing, ray.get(refs, timeout=120)):
                self._gpu_cache[node.node_id] = info
        return {n.label: self._gpu_cache[n.node_id] for n in nodes}


@contextlib.contextmanager
def connect(
    cluster_cfg: ClusterConfig,
    address_override: str | None = None,
    *,
    record_dir: Path | None = DEFAULT_RECORD_DIR,
) -> Iterator[ClusterHandle]:
    """Connect (or start a cluster) per the config; on exit disconnect and stop whatever was started here.

    On a user's own cluster nothing but the driver's connection is closed on exit. Raises UsageError on a bad
    ``--address``, ClusterError when the cluster asked for does not answer within ``cluster.connect_timeout_s``.
    """
    mode = choose_mode(cluster_cfg, address_override)
    _no_auto_init()
    if ray.is_initialized():
        raise ClusterError("this process is already connected to Ray; connect() owns the connection")
    if mode in ("simulated", "auto") and record_dir is not None:
        cleanup_stale_clusters(record_dir)  # a SIGKILLed sweep's cluster is neither leaked nor taken for a running one
    target = resolve_target(cluster_cfg, address_override)
    print(f"cluster: {target.why}", file=sys.stderr, flush=True)
    logging.getLogger("sweeper.cluster").info("cluster: %s", target.why)  # a sweep's sweep.log keeps it too
    simulated: SimulatedCluster | None = None
    try:
        if target.kind == "simulated":
            simulated = SimulatedCluster(cluster_cfg.nodes, cluster_cfg.gpus_per_node, record_dir=record_dir).start()
            address = simulated.address
            _join(address)
        elif target.kind == "local":
            address = "local"
            _join("local")
        else:
            address = str(target.address)
            try:
                _join(address)
            except (ConnectionError, RuntimeError, ValueError) as exc:  # e.g. a Ray version mismatch
                raise ClusterError(f"cannot join the Ray cluster at {address}: {_first_line(exc)}") from None
        yield ClusterHandle(mode=target.kind, address=address, cluster_cfg=cluster_cfg, simulated=simulated,
                            description=target.why)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if simulated is not None:
            simulated.shutdown()


# The console is sweeper's own, on every kind of cluster: what rank actors, warm ranks and probe tasks print stays in
# the trial's rank_<r>.log (their logging) and in Ray's worker logs on their node, and Ray's autoscaler events
# ("No available node types can fulfill resource request", every ~35 s while a placement group waits) go with them,
# since Ray forwards both over the one log channel that log_to_driver switches. A failure reaches the console as
# sweeper's own line, from the trial's result.
def _join(address: str) -> None:
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)


def _no_auto_init() -> None:
    """Ray starts a new local instance when any of its calls finds no connection (RAY_ENABLE_AUTO_CONNECT, on by
    default). The driver connects only here: a trial's thread still winding down after the cluster was shut down
    (a sweep interrupted) would otherwise start a stray Ray instance on this machine, with its agents left behind
    and a ~/.ray/auth_token written (seen after a SIGINT). Its calls fail instead."""
    from ray._private import auto_init_hook  # the flag RAY_ENABLE_AUTO_CONNECT=0 sets; read at each call

    auto_init_hook.enable_auto_connect = False


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# -- node-level probes (run as Ray tasks pinned to one node) ---------------------------------------------------------
def _pin(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


@ray.remote(num_cpus=0, max_retries=0)
def _probe_gpu() -> GpuInfo:
    """GPU kind/memory/capability of the node it runs on. Reserves no GPU, so nvidia-smi sees all of them."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30,
            )
            first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            if first:
                name, mem_mib, cap = (part.strip() for part in first.split(","))
                return GpuInfo(name, round(float(mem_mib) / 1024, 1), cap, "nvidia-smi")
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return GpuInfo(props.name, round(props.total_memory / GIB, 1), f"{props.major}.{props.minor}", "torch")
    except Exception:  # noqa: BLE001 - a probe reports what it can
        pass
    return GpuInfo("unknown", 0.0, None, "unknown")


def _label(node: dict, *, shared_ip: bool) -> str:
    labels = node.get("Labels") or {}
    if NODE_LABEL_KEY in labels:
        return labels[NODE_LABEL_KEY]
    ip = node["NodeManagerAddress"]
    return f"{ip}:{node['NodeManagerPort']}" if shared_ip else ip


def _natural(label: str) -> tuple:
    # sim-2 before sim-10; IPs in numeric order.
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", label))
