"""Pre-flight node check: is every node ready to run this sweep's trials, and do they agree?

Multi-node failures that otherwise surface as hangs or missing-file crashes minutes into a run (a worker with
another torch, a dataset copied to one node only, a full disk) are found before any trial: a small task pinned to
each alive GPU node reports its Python / torch / megatron-core / Transformer Engine versions, GPUs (and their
compute capability, against the declared ``cluster.compute_capability``), which optional GPU kernel packages it
has (Transformer Engine, mamba_ssm, causal-conv1d, DeepEP) and whether each present one imports, free disk where
trials write, and whether the configured data and tokenizer paths exist there. On a real cluster (issue 51) it also
asks torch on each node how many CUDA devices it sees: a node with GPUs that Ray schedules while its torch is a CPU
build, or sees fewer devices than Ray schedules there, would run its ranks on the CPU or not at all (a problem); a
node with no GPU behind Ray's (logical GPUs) runs them on the CPU, and one with fewer CPUs for Ray than GPUs holds
only as many ranks as CPUs, each reserving one (warnings: what runs, but not as a user may think). Versions come
from package metadata; the kernel packages and torch are asked in a new interpreter, so nothing heavy stays in the
node's Ray worker.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sweeper.cluster.connection import ClusterHandle
from sweeper.cluster.node_kernels import import_failure, torch_cuda
from sweeper.cluster.placement import CPUS_PER_RANK, rank_slots
from sweeper.config.capability import capability_mismatch
from sweeper.config.kernels import Kernels
from sweeper.config.schema import SweepConfig
from sweeper.config.units import GIB

ABSENT = "absent"
_VERSION_KEYS = ("python", "torch", "megatron_core", "transformer_engine")


@dataclass
class NodeCheck:
    label: str
    node_id: str
    python: str = ABSENT
    torch: str = ABSENT
    megatron_core: str = ABSENT
    transformer_engine: str = ABSENT
    gpu_kind: str = "unknown"
    gpu_count: int = 0  # GPUs Ray schedules on this node
    cpus: float | None = None  # CPUs Ray schedules on this node (None: not known)
    gpu_memory_gib: float = 0.0
    compute_capability: str | None = None  # what the node's GPUs report (None: could not tell)
    gpu_source: str = "unknown"  # simulated | nvidia-smi | torch | unknown
    torch_cuda: str | None = None  # the CUDA version the node's torch was built for; None: a CPU build, or not asked
    cuda_devices: int | None = None  # CUDA devices the node's torch sees (None: not asked: a simulated cluster)
    cuda_error: str | None = None  # torch could not say
    kernels: Kernels | None = None  # the optional GPU kernel packages this node has (None: not probed)
    import_failures: dict[str, str] = field(default_factory=dict)  # a kernel package present but not importing
    free_disk_gib: float | None = None
    disk_path: str = ""
    paths: dict[str, bool] = field(default_factory=dict)  # configured path -> exists on this node
    # Sees the file the driver wrote where trials will write, and the driver sees this node's (None: not probed).
    shared: bool | None = None
    error: str | None = None  # the probe itself failed on this node


@dataclass
class DoctorReport:
    nodes: list[NodeCheck]
    problems: list[str]  # each one line; empty means every node agrees and every path exists everywhere
    expected_nodes: int
    # Each one line: what runs, but not as a user may think (a node's logical GPUs run its ranks on the CPU).
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def rows(self) -> list[dict[str, str]]:
        """One row per node for a table; a version that differs from the majority is marked with '!'."""
        majority = {key: _majority([getattr(n, key) for n in self.nodes]) for key in _VERSION_KEYS + ("gpu_kind",)}
        out = []
        for node in self.nodes:
            row = {"node": node.label}
            for key in _VERSION_KEYS + ("gpu_kind",):
                value = str(getattr(node, key))
                row[key] = value if value == majority[key] else f"{value} !"
            memory = "?" if node.gpu_source == "unknown" else f"{node.gpu_memory_gib:g}"  # no nvidia-smi, no CUDA
            row["gpus"] = f"{node.gpu_count} x {memory} GiB" + (
                " (simulated)" if node.gpu_source == "simulated" else "")
            row["compute_capability"] = node.compute_capability or "?"
            row["cuda"] = _cuda_cell(node)
            row["kernels"] = "?" if node.kernels is None else (", ".join(node.kernels.present()) or "none")
            row["free_disk"] = "?" if node.free_disk_gib is None else f"{node.free_disk_gib:.0f} GiB"
            row["shared_trial_folder"] = {True: "yes", False: "NO", None: "?"}[node.shared]
            missing = [p for p, exists in node.paths.items() if not exists]
            row["paths"] = "ok" if not missing else "missing: " + ", ".join(missing)
            if node.error:
                row["paths"] = f"probe failed: {node.error}"
            out.append(row)
        return out


def doctor(
    cfg: SweepConfig, handle: ClusterHandle, trial_root: Path | None = None, timeout_s: float = 120.0
) -> DoctorReport:
    """Check every alive GPU node; ``trial_root`` is where trials will write (default: the current directory).

    The shared-filesystem check: the driver writes a token file into the nearest existing folder of
    ``trial_root``, every node reads it back and writes one of its own beside it, and the driver looks for
    those: every rank writes its log and checkpoint shards into the trial folder, and ranks read each other's
    shards when the checkpoint is loaded, so that folder must be the same on every node. The files are removed."""
    root = str(Path(trial_root or Path.cwd()).resolve())
    paths = list(cfg.training.data_paths) + ([cfg.training.tokenizer_path] if cfg.training.tokenizer_path else [])
    nodes = handle.nodes()
    gpu_info = handle.gpu_info()
    token = f".sweeper-doctor-{uuid.uuid4().hex}"
    probe_dir = _existing(Path(root))
    driver_file = probe_dir / token
    driver_file.write_text(token)
    try:
        refs = [
            _probe_node.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n.node_id, soft=False)
            ).remote(root, paths, str(driver_file), n.node_id, not handle.is_simulated)
            for n in nodes
        ]
        checks: list[NodeCheck] = []
        for node, ref in zip(nodes, refs):
            check = NodeCheck(label=node.label, node_id=node.node_id, gpu_count=node.gpus, cpus=node.cpus)
            try:
                facts = ray.get(ref, timeout=timeout_s)
                for key, value in facts.items():
                    setattr(check, key, value)
                check.shared = check.shared and (probe_dir / f"{token}-{node.node_id}").is_file()
            except Exception as exc:  # noqa: BLE001 - a node that cannot run the probe is itself a finding
                check.error = " ".join(str(exc).split())[:200]
            info = gpu_info.get(node.label)
            if info is not None:
                check.gpu_kind, check.gpu_memory_gib, check.gpu_source = info.kind, info.memory_gib, info.source
                check.compute_capability = info.compute_capability
            checks.append(check)
    finally:
        for leftover in probe_dir.glob(f"{token}*"):
            leftover.unlink(missing_ok=True)
    return DoctorReport(nodes=checks, problems=_problems(checks, cfg, root), expected_nodes=cfg.cluster.nodes,
                        warnings=[line for node in checks if not node.error
                                  for line in _logical_gpus(node) + _short_of_cpus(node)])


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (trials create the folder; the check needs nothing created)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@ray.remote(num_cpus=0, max_retries=0)
def _probe_node(disk_path: str, paths: list[str], driver_file: str, node_id: str, cuda: bool) -> dict:
    """Runs on one node: versions from package metadata, free disk, which configured paths exist, whether the
    driver's file is visible here (then it leaves one of its own beside it), and with ``cuda`` what torch sees."""
    facts: dict = {"python": platform.python_version()}
    for key, dists in (
        ("torch", ("torch",)),
        ("megatron_core", ("megatron-core", "megatron_core")),
        ("transformer_engine", ("transformer-engine", "transformer_engine", "transformer-engine-cu12")),
    ):
        facts[key] = ABSENT
        for dist in dists:
            try:
                facts[key] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    # Present is not enough: an extension built against another torch (TE's, under pip's build isolation) is
    # found and fails to import. Imported in a new interpreter, so this worker stays light.
    facts["kernels"] = Kernels.here()
    facts["import_failures"] = {name: error for name in facts["kernels"].present()
                                if (error := import_failure(name)) is not None}
    if cuda:
        facts["torch_cuda"], facts["cuda_devices"], facts["cuda_error"] = torch_cuda()
    facts["disk_path"] = disk_path
    facts["free_disk_gib"] = round(shutil.disk_usage(_existing(Path(disk_path))).free / GIB, 1)
    facts["paths"] = {p: Path(p).exists() for p in paths}
    seen = Path(driver_file)
    facts["shared"] = seen.is_file() and seen.read_text() == seen.name
    if facts["shared"]:
        Path(f"{driver_file}-{node_id}").write_text(node_id)
    return facts


def _problems(checks: list[NodeCheck], cfg: SweepConfig, trial_root: str) -> list[str]:
    problems: list[str] = []
    if not checks:
        return ["no alive node offers GPUs"]
    for node in checks:
        if node.error:
            problems.append(f"{node.label}: probe failed: {node.error}")
    probed = [n for n in checks if not n.error]
    for key in _VERSION_KEYS + ("gpu_kind",):
        values = {getattr(n, key) for n in probed}
        if len(values) > 1:
            per_node = ", ".join(f"{n.label}={getattr(n, key)}" for n in probed)
            problems.append(f"{key} differs between nodes: {per_node}")
    for name in Kernels().names():
        has = {n.label: getattr(n.kernels, name) for n in probed if n.kernels is not None}
        if len(set(has.values())) > 1:
            per_node = ", ".join(f"{label}={'yes' if v else 'no'}" for label, v in has.items())
            problems.append(f"{name} is on some GPU nodes only ({per_node}): the sweep runs only what every node "
                            "has")
    for node in probed:
        for name, error in node.import_failures.items():
            hint = (" (built against another torch? docs/gpu-cluster.md: pip install --no-build-isolation)"
                    if name == "transformer_engine" else "")
            problems.append(f"{node.label}: {name} is installed but does not import: {error}{hint}")
        for path, exists in node.paths.items():
            if not exists:
                problems.append(f"{node.label}: {path} does not exist")
        if node.gpu_count < cfg.cluster.gpus_per_node:
            problems.append(f"{node.label}: {node.gpu_count} GPUs, "
                            f"cluster.gpus_per_node says {cfg.cluster.gpus_per_node}")
        # The trial picks its FP8 recipe from the device; the environment, estimate and exports use the YAML's.
        mismatch = capability_mismatch(cfg.cluster.compute_capability, node.compute_capability,
                                       f"{node.label}'s GPUs ({node.gpu_kind})")
        if mismatch:
            problems.append(f"{node.label}: {mismatch}")
        problems.extend(_cuda_problems(node))
        if node.megatron_core == ABSENT:
            problems.append(f"{node.label}: megatron-core is not installed")
        if node.shared is False:
            problems.append(f"{node.label}: does not share {trial_root} with the driver (trial folders must be on a "
                            "filesystem every node mounts at the same path: each rank writes its log and checkpoint "
                            "shards there)")
    if len(checks) < cfg.cluster.nodes:
        problems.append(f"{len(checks)} GPU node(s) alive, cluster.nodes says {cfg.cluster.nodes}")
    return problems


def _torch_asked(node: NodeCheck) -> bool:
    """Whether the node's torch was asked (not on a simulated cluster, whose GPUs are logical by design)."""
    return node.gpu_count > 0 and (node.cuda_devices is not None or node.cuda_error is not None)


def _logical(node: NodeCheck) -> bool:
    """Ray schedules GPUs on a node where neither nvidia-smi nor torch finds one: ``ray start --num-gpus N`` on a
    machine without GPUs (a test cluster on one machine), whose ranks run on the CPU as on a simulated cluster."""
    return node.gpu_source == "unknown" and node.cuda_error is None and not node.cuda_devices


def _logical_gpus(node: NodeCheck) -> list[str]:
    if not _torch_asked(node) or not _logical(node):
        return []
    torch = "is a CPU build" if node.torch_cuda is None else f"(CUDA {node.torch_cuda}) sees no CUDA device"
    return [f"{node.label}: Ray schedules {node.gpu_count} GPUs here but the node shows none (no GPU from "
            f"nvidia-smi; its torch {node.torch} {torch}): logical GPUs, whose ranks run on the CPU and measure it, "
            "as on a simulated cluster. On a GPU node: install the NVIDIA driver and a CUDA build of torch; "
            "otherwise start Ray there with --num-gpus 0"]


def _short_of_cpus(node: NodeCheck) -> list[str]:
    """A node with fewer CPUs for Ray than GPUs (a container's CPU limit): the sweep runs there only as many ranks as
    it has CPUs, and a layout needing more per node waits for a node that has them."""
    if node.cpus is None or rank_slots(node.gpu_count, node.cpus) >= node.gpu_count:
        return []
    return [f"{node.label}: {node.gpu_count} GPUs but {node.cpus:g} CPUs for Ray: a rank reserves {CPUS_PER_RANK:g} "
            f"CPU, so at most {rank_slots(node.gpu_count, node.cpus)} ranks run here and layouts needing more per "
            f"node do not (start Ray there with --num-cpus {node.gpu_count * CPUS_PER_RANK:g} or more)"]


def _cuda_problems(node: NodeCheck) -> list[str]:
    """A node with GPUs (nvidia-smi lists them) that Ray schedules but its torch cannot use."""
    if not _torch_asked(node) or _logical(node):
        return []
    schedules = f"{node.label}: Ray schedules {node.gpu_count} GPUs here but"

    def fix(gpus: int) -> str:
        return f"or start Ray there with --num-gpus {gpus} (docs/gpu-cluster.md)"

    if node.cuda_error is not None:
        return [f"{schedules} torch could not say how many CUDA devices it sees: {node.cuda_error}"]
    if node.torch_cuda is None:
        return [f"{schedules} its torch {node.torch} is a CPU build: its ranks would run on the CPU. Install a CUDA "
                f"build of torch there, " + fix(0)]
    if node.cuda_devices == 0:
        return [f"{schedules} torch {node.torch} (CUDA {node.torch_cuda}) sees no CUDA device: check the driver "
                f"(nvidia-smi) and CUDA_VISIBLE_DEVICES there, " + fix(0)]
    if node.cuda_devices is not None and node.cuda_devices < node.gpu_count:
        return [f"{schedules} torch sees {node.cuda_devices} CUDA devices: ranks beyond them would fail. Check "
                f"CUDA_VISIBLE_DEVICES there, " + fix(node.cuda_devices)]
    return []


def _cuda_cell(node: NodeCheck) -> str:
    if node.cuda_error is not None:
        return "?"
    if node.cuda_devices is None:
        return "simulated" if node.gpu_source == "simulated" else "?"
    if node.torch_cuda is None:
        return "CPU build"
    return f"{node.cuda_devices} devices (CUDA {node.torch_cuda})"


def _majority(values: list) -> object:
    return max(set(values), key=values.count) if values else None
