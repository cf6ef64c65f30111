"""TrialHost: the sweep's view of the cluster (``trial.protocol.Host``). It owns the GPU ledger and launches
trials onto chosen nodes.

It decides where each trial goes (first fit over the alive nodes, one bundle per node, TP groups kept
inside a node) and pins the trial's placement group there, so its bookkeeping and Ray's never disagree and a
trial is only launched when it can really start. Nodes are re-read from Ray on every reservation: a lost node
stops counting at once (its trials fail as infra and are retried elsewhere), a joined node is used as soon as
Ray lists it. Fault injection for tests (node-loss, node-join) happens here and in the runner, on simulated
clusters only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil

from sweeper.backends.megatron.support import backend_name, run_unsupported_reason, unsupported_reason
from sweeper.cluster import CPUS_PER_RANK, ClusterHandle, connect, plan_placement, rank_slots
from sweeper.cluster.doctor import DoctorReport, doctor
from sweeper.cluster.node_kernels import gpu_node_kernels
from sweeper.cluster.placement import PlacementError
from sweeper.config.kernels import Kernels
from sweeper.config.schema import SweepConfig
from sweeper.config.units import GIB
from sweeper.models.proxy import is_proxy
from sweeper.models.spec import ModelSpec
from sweeper.plan.rules import Checker
from sweeper.plan.space import enumerate_layouts
from sweeper.record.schema import TrialResult
from sweeper.space.layout import Layout
from sweeper.space.pipeline import with_pipeline_split
from sweeper.trial.pool import RankPool, rank_nodes
from sweeper.trial.protocol import Reservation
from sweeper.trial.proxy_run import proxy_run_layout, proxy_run_note
from sweeper.trial.runner import DEFAULT_BACKEND, keep_together, run_trial

CAPACITY_SNAPSHOT_S = 1.0  # how long one read of Ray's node table answers the sweep's capacity questions
# How long the GPUs of a trial that ended still count as this sweep's: Ray frees a removed placement group's
# resources asynchronously (its raylet reports them back), and until then they read as taken (issue 51).
RELEASE_GRACE_S = 5.0
PRESTART_GIB_PER_RANK = 1.0  # an idle warm rank holds ~0.45 GiB (torch and megatron-core imported), a proxy rank ~0.9
# What a simulated cluster holds of this machine's memory before any rank starts (issue 54): the resident sets of
# SimulatedCluster.pids() and their children, summed 5 s after start (Ray 2.60, 2 cores): 1 node x 8 GPUs 1,916 MiB
# in 21 processes, 4 nodes 2,672 MiB in 30, so Ray's head and the first raylet ~1.7 GiB and each further node
# ~0.25 GiB (shared pages counted in each process: on the high side, as a refusal should be).
SIMULATED_HEAD_GIB = 1.7
SIMULATED_NODE_GIB = 0.25


def simulated_capacity_refusal(cfg: SweepConfig, memory_gib: float | None = None) -> str | None:
    """A simulated cluster's Ray processes and its trials' ranks all live on this machine: when the cluster and one
    rank (the least a trial runs) need more than its memory (``memory_gib``, default this machine's total), the
    one-line reason, before anything starts; a 128 x 8 cluster on a laptop would otherwise start hundreds of Ray
    processes and hang. None when it fits: whether a trial's ranks fit is the warm pool's and the trial's own
    question, asked as they start."""
    c = cfg.cluster
    have = memory_gib if memory_gib is not None else psutil.virtual_memory().total / GIB
    need = SIMULATED_HEAD_GIB + SIMULATED_NODE_GIB * (c.nodes - 1) + PRESTART_GIB_PER_RANK
    if need <= have:
        return None
    return (f"cluster.nodes: a simulated cluster of {c.nodes} nodes x {c.gpus_per_node} GPUs needs about "
            f"{need:.1f} GiB of this machine's memory before its trials run (Ray's head and first node "
            f"{SIMULATED_HEAD_GIB:g} GiB, {SIMULATED_NODE_GIB:g} GiB per further node, {PRESTART_GIB_PER_RANK:g} GiB "
            f"for one rank) and this machine has {have:.1f} GiB. To run it: --address ADDR (a Ray cluster with "
            f"GPUs), --rehearse (modelled trials, no Ray), or fewer nodes (--set cluster.nodes=N)")


def cpu_backend_refusal(cfg: SweepConfig) -> str | None:
    """On a simulated cluster every trial runs on the CPU backend: when it can run none of the space's valid
    layouts, the one-line reason (the most common one) and what would make the space run; None otherwise."""
    run_reason = run_unsupported_reason(cfg.run, cuda=False, te=False)
    if run_reason:
        return (f"no layout of this space can run on the CPU backend of a simulated cluster: {run_reason}. To run "
                f"it: --address ADDR (a Ray cluster with GPUs), or leave that run setting out")
    reasons: Counter[str] = Counter()
    checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run)
    for layout in enumerate_layouts(cfg):
        layout = with_pipeline_split(layout, cfg.model)
        if checker(layout):
            continue
        reason = unsupported_reason(cfg.model, layout, cuda=False, te=False)
        if reason is None:
            return None
        reasons[reason] += 1
    if not reasons:
        return None  # no valid layout at all: the sweep says so itself
    reason, count = reasons.most_common(1)[0]
    return (f"no layout of this space can run on the CPU backend of a simulated cluster: {reason} ({count} of "
            f"{sum(reasons.values())} valid layouts). To run it: --proxy (the model's CPU-size proxy, here) or "
            f"--address ADDR (a Ray cluster with GPUs)")


class TrialHost:
    def __init__(self, cfg: SweepConfig, handle: ClusterHandle) -> None:
        self.cfg = cfg
        self.handle = handle
        self.simulated = handle.is_simulated
        self.cuda = not self.simulated
        self._kernels: Kernels | None = None
        self.backend_name = backend_name(self.cuda)
        self._used: dict[str, int] = {}  # node id -> GPUs reserved by this sweep's running trials
        self._released: list[tuple[float, str, int]] = []  # (when, node id, GPUs) of trials ended just now
        # (when, Ray's alive nodes: node id -> (label, ranks it holds: its GPUs, fewer where it has fewer CPUs))
        self._snapshot: tuple[float, dict[str, tuple[str, int]]] | None = None
        self._others: dict[str, int] = {}  # node id -> rank slots other jobs hold there, as of the snapshot
        # the same, less the trials that ended within RELEASE_GRACE_S: what the sweep says other jobs hold
        self._others_shown: dict[str, int] = {}
        self._alone: set[str] = set()  # nodes a trial holds alone (search.confirm_alone): nobody else starts there
        # fits' answers by placement shape, while the ledger is as it was (``_changes``: reservations, releases and
        # node-table reads so far): a fill asks it for every launchable layout, a few placement shapes
        self._changes = 0
        self._fits: tuple[int, dict[tuple[int, int], bool]] = (-1, {})
        self._lock = threading.Lock()
        # Warm (forked) ranks by default on a simulated cluster only: on an H200, NCCL in a rank forked from a warm
        # Ray actor failed to start NVML ("GPU access blocked by the operating system") where fresh ranks passed.
        warm = cfg.cluster.warm_ranks if cfg.cluster.warm_ranks is not None else self.simulated
        self.pool = RankPool(DEFAULT_BACKEND, CPUS_PER_RANK, gpu=self.cuda) if warm else None

    # -- capacity ----------------------------------------------------------------------------------------------
    def _alive(self) -> dict[str, tuple[str, int]]:
        """The alive nodes, read from Ray at most once per ``CAPACITY_SNAPSHOT_S``: a sweep's fill asks whether
        each candidate fits, twice per proposal, and every ask read the whole cluster's node table (issue 43)."""
        now = time.monotonic()
        if self._snapshot is None or now - self._snapshot[0] >= CAPACITY_SNAPSHOT_S:
            nodes = {n.node_id: (n.label, rank_slots(n.gpus, n.cpus)) for n in self.handle.nodes()}
            self._others, self._others_shown = self._held_by_others(nodes)
            self._snapshot = (now, nodes)
            self._changes += 1
        sim = self.handle.simulated
        if sim is None:  # the snapshot as read (fits asks per candidate: a copy each time cost seconds per event)
            return self._snapshot[1]
        # Ray marks a killed node dead only after its health checks time out; a simulated cluster knows at once
        # (asked on every call: it is the driver's own table, and a lost node must not be reserved again).
        return {node: info for node, info in self._snapshot[1].items() if sim is None or sim.node_for(node) is not None}

    def _held_by_others(self, nodes: dict[str, tuple[str, int]]) -> tuple[dict[str, int], dict[str, int]]:
        """Rank slots another job holds on each node (issue 46), twice: what reservations go by (what Ray says is
        taken there, GPUs or the CPUs a rank needs beside its GPU, less what this sweep holds: its trials'
        reservations, its warm ranks idle or leased), and what the sweep says other jobs hold (less, too, for
        ``RELEASE_GRACE_S``, the trials that just ended, whose placement groups Ray frees a moment after their
        removal: issue 51 saw them read as another job's). A reservation whose placement group Ray has not made yet
        counts as this sweep's, so the difference never goes below zero."""
        available = self.handle.available()
        warm = self.pool.held_per_node() if self.pool is not None else {}
        now = time.monotonic()
        self._released = [(when, nid, gpus) for when, nid, gpus in self._released if now - when < RELEASE_GRACE_S]
        ending: Counter[str] = Counter()
        for _, nid, gpus in self._released:
            ending[nid] += gpus
        others, shown = {}, {}
        for nid, (_, slots) in nodes.items():
            free = rank_slots(*available.get(nid, (float(slots), slots * CPUS_PER_RANK)))
            ours = max(self._used.get(nid, 0), warm.get(nid, 0))
            others[nid] = max(0, slots - free - ours)
            shown[nid] = max(0, slots - free - max(self._used.get(nid, 0) + ending[nid], warm.get(nid, 0)))
        # Reservations go by what Ray says is free: once Ray has freed an ended trial's GPUs, counting them as the
        # sweep's too would count them twice and reserve GPUs another job holds (a placement then times out, seen
        # on a ray start node with another job holding 3 of 4 GPUs). The grace only keeps them from being *said*
        # to be another job's (``held_by_others``).
        return others, shown

    def capacity_total(self) -> int:
        """Ranks the alive nodes hold at once: their GPUs, fewer on a node with fewer CPUs for Ray than GPUs."""
        return sum(slots for _, slots in self._alive().values())

    def lacks(self, layout: Layout) -> str | None:
        """Why the alive nodes could never hold ``layout``, even with nothing else running (what a node lacks, GPUs
        or CPUs), or None when they could."""
        try:
            plan = plan_placement(layout.world_size, self.cfg.cluster.gpus_per_node,
                                  keep_together=keep_together(layout, self.cfg.cluster.gpus_per_node))
        except PlacementError as exc:
            return str(exc)
        nodes = [n for n in self.handle.nodes() if self.handle.simulated is None
                 or self.handle.simulated.node_for(n.node_id) is not None]
        big = [n for n in nodes if rank_slots(n.gpus, n.cpus) >= plan.ranks_per_bundle]
        if len(big) >= plan.num_bundles:
            return None
        per = plan.ranks_per_bundle
        need = f"{plan.num_bundles} node(s) with {per} GPUs and {per * CPUS_PER_RANK:g} CPUs each"
        short = [f"{n.label} has {n.gpus} GPUs and {n.cpus:g} CPUs" for n in nodes if n not in big]
        return f"{layout.short()} needs {need} (a rank reserves 1 GPU and {CPUS_PER_RANK:g} CPU); " + (
            "; ".join(short) if short else "no node offers GPUs")

    def held_by_others(self, node_ids: list[str] | None = None) -> int:
        """GPUs other jobs hold on ``node_ids`` (None: every alive node), as of the last look (at most a second
        old)."""
        with self._lock:
            alive = self._alive()
            return sum(self._others_shown.get(nid, 0) for nid in (alive if node_ids is None else set(node_ids)))

    def reserve(self, layout: Layout, alone: bool = False) -> Reservation | None:
        """Nodes for this layout's placement bundles, or None when they are not free right now; ``alone``: nodes
        no trial of this sweep uses, and none starts on until ``release``."""
        with self._lock:
            slot = self._choose(layout, alone)
            if slot is not None:
                self._changes += 1
                for nid in slot.node_ids:
                    self._used[nid] = self._used.get(nid, 0) + slot.gpus_per_bundle
                if alone:
                    self._alone.update(slot.node_ids)
            return slot

    def fits(self, layout: Layout) -> bool:
        """Answered once per placement shape (GPUs, the group kept on one node) until the ledger changes; on a
        simulated cluster, whose nodes may be killed between two asks, every time."""
        with self._lock:
            if self.handle.simulated is not None:
                return self._choose(layout) is not None
            alive = self._alive()  # the node table read again when due (a change)
            changes, answers = self._fits
            if changes != self._changes:
                answers = {}
                self._fits = (self._changes, answers)
            shape = (layout.world_size, keep_together(layout, self.cfg.cluster.gpus_per_node))
            if shape not in answers:
                answers[shape] = self._choose(layout, alive=alive) is not None
            return answers[shape]

    def _choose(self, layout: Layout, alone: bool = False,
                alive: dict[str, tuple[str, int]] | None = None) -> Reservation | None:
        """The nodes ``reserve`` would take now (the caller holds the lock; ``alive``: the nodes it just read)."""
        try:
            plan = plan_placement(layout.world_size, self.cfg.cluster.gpus_per_node,
                                  keep_together=keep_together(layout, self.cfg.cluster.gpus_per_node))
        except PlacementError:
            return None
        alive = self._alive() if alive is None else alive
        if self.pool is not None:
            self.pool.keep_nodes(set(alive))
        free = {nid: gpus - self._used.get(nid, 0) - self._others.get(nid, 0) for nid, (_, gpus) in alive.items()
                if nid not in self._alone and not (alone and self._used.get(nid, 0))}
        chosen = [nid for nid in sorted(free, key=lambda n: (free[n], alive[n][0]))
                  if free[nid] >= plan.ranks_per_bundle][: plan.num_bundles]  # best fit: fullest node first
        if len(chosen) < plan.num_bundles:
            return None
        return Reservation(chosen, [alive[n][0] for n in chosen], plan.ranks_per_bundle, alone)

    def reserve_within(self, layout: Layout, timeout_s: float) -> Reservation | None:
        """``reserve``, retried for up to ``timeout_s`` (a fresh cluster's nodes may still be registering)."""
        deadline = time.monotonic() + timeout_s
        while True:
            slot = self.reserve(layout)
            if slot is not None or time.monotonic() >= deadline:
                return slot
            time.sleep(1.0)

    def prestart(self, layouts: list[Layout]) -> int:
        """Start the warm ranks the largest of ``layouts`` runs on (a proxy trial's own, smaller run), on the nodes
        a reservation would give it now, while nothing runs yet: their imports overlap the reference run instead of
        delaying the first trial (issue 31: its 15 new ranks took 54 s to start on 2 cores). At most one per GiB of
        host memory available; none without a warm pool. Returns how many were started."""
        if self.pool is None or not layouts:
            return 0
        runs = [proxy_run_layout(lo) if is_proxy(self.cfg.model) else lo for lo in layouts]
        largest = max(runs, key=lambda lo: lo.world_size)
        with self._lock:
            slot = self._choose(largest)
        if slot is None:
            return 0
        nodes = rank_nodes(slot.node_ids, slot.gpus_per_bundle, largest.world_size)
        room = int(psutil.virtual_memory().available / GIB / PRESTART_GIB_PER_RANK)
        return self.pool.prestart(nodes[:room])

    def release(self, reservation: Reservation) -> None:
        with self._lock:
            self._changes += 1
            ended = time.monotonic()
            for nid in reservation.node_ids:
                self._used[nid] = max(0, self._used.get(nid, 0) - reservation.gpus_per_bundle)
                self._released.append((ended, nid, reservation.gpus_per_bundle))
            if reservation.alone:
                self._alone.difference_update(reservation.node_ids)

    @property
    def kernels(self) -> Kernels:
        """What the GPU nodes have, not the driver (a KubeRay head is a CPU pod): what every node has, since a
        trial's ranks may land on any of them. Asked once, when first needed."""
        if self._kernels is None:
            self._kernels = Kernels.on_every(gpu_node_kernels(self.handle).values()) if self.cuda else Kernels()
        return self._kernels

    @property
    def te(self) -> bool:
        return self.kernels.transformer_engine

    def unsupported(self, model: ModelSpec, layout: Layout) -> str | None:
        return unsupported_reason(model, layout, cuda=self.cuda, te=self.te, kernels=self.kernels)

    # -- running -------------------------------------------------------------------------------------------------
    def run_trial(self, cfg: SweepConfig, layout: Layout, trial_dir: Path, *, reservation: Reservation,
                  inject: str | None = None, cancel: threading.Event | None = None,
                  steps: int | None = None, reference: str | None = None,
                  make_reference: bool = False, routing_stress: bool = False) -> TrialResult:
        if steps is not None:  # a confirmation's longer run gets its time limit scaled alike
            t = cfg.training
            limit = t.trial_timeout_s * max(1.0, steps / t.steps)
            cfg = cfg.model_copy(update={"training": t.model_copy(update={"steps": steps, "trial_timeout_s": limit})})
        run, nodes, note = layout, reservation.node_ids, None
        if is_proxy(cfg.model) and not make_reference:  # the reference's batch is the gate's: never shrunk
            run, nodes, note = self._proxy_run(layout, reservation)
        result = run_trial(cfg, run, self.handle, trial_dir, inject=inject, cancel=cancel, nodes=nodes,
                           reference_checkpoint=reference, make_reference=make_reference, pool=self.pool,
                           routing_stress=routing_stress)
        if note:
            result.notes.append(note)
        return result

    def _proxy_run(self, layout: Layout, reservation: Reservation) -> tuple[Layout, list[str], str | None]:
        """A proxy trial's layout (``proxy_run``) on the first bundles of the layout's reservation, which hold it
        (its ranks fit in fewer or smaller bundles); the layout itself when they do not."""
        run = proxy_run_layout(layout)
        try:
            plan = plan_placement(run.world_size, self.cfg.cluster.gpus_per_node,
                                  keep_together=keep_together(run, self.cfg.cluster.gpus_per_node))
        except PlacementError:
            return layout, reservation.node_ids, None
        if plan.num_bundles > len(reservation.node_ids) or plan.ranks_per_bundle > reservation.gpus_per_bundle:
            return layout, reservation.node_ids, None
        return run, reservation.node_ids[: plan.num_bundles], proxy_run_note(layout)

    def add_node(self) -> str:
        """node-join fault injection: one more simulated node. Call from the main thread (Ray's node start
        installs signal handlers)."""
        if self.handle.simulated is None:
            raise RuntimeError("node-join injection needs a simulated cluster")
        self._snapshot = None  # the next ask sees the new node
        return self.handle.simulated.add_node().label

    def doctor(self, cfg: SweepConfig, trial_root: Path | None = None) -> DoctorReport:
        """``cluster.doctor`` for the folder trials will write into (the sweep folder)."""
        return doctor(cfg, self.handle, trial_root)

    def close(self) -> None:
        """Retire the warm ranks (their GPUs go back to the cluster)."""
        if self.pool is not None:
            self.pool.close()


@contextlib.contextmanager
def open_host(cfg: SweepConfig, address: str | None = None) -> Iterator[TrialHost]:
    """Connect to (or simulate) the space's cluster for the duration of the block."""
    with connect(cfg.cluster, address) as handle:
        host = TrialHost(cfg, handle)
        try:
            yield host
        finally:
            host.close()
