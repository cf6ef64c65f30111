"""run_trial: one smoke trial of one layout, as one Ray actor per rank on one placement group.

Top to bottom: reserve the GPUs (one placement group, TP groups inside a node) → start one RankActor per rank in
its bundle → ask rank 0 for a rendezvous address and port → every rank runs the backend → gather reports with
``ray.wait`` until all are in, one fails, one dies, or the trial's wall-time limit passes → kill every rank at
once and remove the placement group → fold the outcomes into a TrialResult and write ``<trial_dir>/result.json``.

Why kill everything on the first failure: a surviving rank would otherwise sit in a collective until the
process-group timeout, holding the trial's GPUs. Why a short grace period after a *collateral* failure (comm
error, dead rank): the rank that really failed often reports a moment later, and the result must name it.

Trial directories: every rank writes its log and its checkpoint shards under ``trial_dir``. On the simulated
cluster all nodes share this machine's filesystem. On a real cluster each node writes its own ranks' files under
the same absolute path on its local disk (a shared filesystem makes it one directory); only the driver writes
``result.json``.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayError, RayTaskError

from sweeper.backends.base import SmokeRequest
from sweeper.cluster import (
    CPUS_PER_RANK,
    ClusterHandle,
    PlacementError,
    PlacementPlan,
    PlacementTimeout,
    TrialPlacement,
    plan_placement,
    trial_placement,
)
from sweeper.cluster.ray_errors import cause_line
from sweeper.config.files import write_atomic
from sweeper.config.schema import SweepConfig
from sweeper.config.units import GIB
from sweeper.record.schema import TrialResult
from sweeper.space.environment import EnvVar, megatron_environment
from sweeper.space.layout import Layout
from sweeper.trial import stacks
from sweeper.trial.actor import CPU_RANK_ENV, RankActor, RankSlot
from sweeper.trial.aggregate import NODE_LOST, RankOutcome, aggregate, is_collateral
from sweeper.trial.forked import RankDied
from sweeper.trial.pool import STOP_CONFIRM_S, RankPool, Warm

DEFAULT_BACKEND = "sweeper.backends.megatron:run_rank"
BACKEND_INJECTS = ("nan", "hang", "crash", "swap_shards", "drift")  # done inside a rank by the backend
RUNNER_INJECTS = ("node-loss",)  # done by the runner (simulated clusters only)
COLLATERAL_GRACE_S = 5.0  # after a comm error or a dead rank, how long to wait for the rank that caused it
# A rank killed by Ray's memory monitor: its node's host memory ran out (the ranks' sum, not one GPU's share). The
# trial is infra, and its result carries this note: on a simulated cluster the same layout would hit the same wall.
HOST_OUT_OF_MEMORY = "host out of memory"
# Notes of an infra result whose cause passes: the cluster had no room in time, the driver stopped the trial, or a
# node the trial ran on was lost (the layout runs again, elsewhere or later).
PLACEMENT_TIMEOUT = "placement_timeout"
CANCELLED = "cancelled"
CHECKS_PROBE_S = 5.0  # how long unreported ranks get to say what they had proven before they are stopped


@dataclass(frozen=True)
class RunningTrial:
    """Passed to ``on_running`` once every rank is running: which node hosts each rank."""

    trial_id: str
    rank_nodes: list[str]  # node label per rank
    rank_node_ids: list[str]  # Ray node id per rank


def run_trial(
    cfg: SweepConfig,
    layout: Layout,
    handle: ClusterHandle,
    trial_dir: Path,
    *,
    backend: str = DEFAULT_BACKEND,
    inject: str | None = None,
    inject_rank: int = 0,
    timeout_s: float | None = None,
    on_running: Callable[[RunningTrial], None] | None = None,
    cancel: threading.Event | None = None,
    nodes: list[str] | None = None,
    reference_checkpoint: str | None = None,
    make_reference: bool = False,
    pool: RankPool | None = None,
    routing_stress: bool = False,
) -> TrialResult:
    """Run one smoke trial; never raises for a trial failure (the TrialResult says what failed and why).

    ``timeout_s`` bounds the whole trial, placement included (default ``cfg.training.trial_timeout_s``).
    ``inject``: ``nan`` / ``hang`` / ``crash`` / ``drift`` (done by the backend in ``inject_rank``), ``swap_shards``
    (a wrong layout: every TP group rotates its shards after the reference is loaded) or ``node-loss`` (the
    runner kills the simulated node hosting ``inject_rank`` once all ranks run). ``cancel``: set it from another
    thread to stop the trial (Ctrl-C of a sweep); the ranks are killed and the result is ``infra``/cancelled.
    ``nodes``: Ray node ids, one per placement bundle, chosen by the sweep's scheduler (None: Ray chooses).
    ``reference_checkpoint`` / ``make_reference``: the equivalence gate (load, or create, the sweep's reference).
    ``routing_stress``: end with ``search.routing_stress_steps`` steps per routing-stress mode (MoE, EP > 1).
    ``pool``: run on the sweep's warm ranks (``trial.pool``; needs ``nodes``) instead of new rank actors in a
    placement group of the trial's own.
    KeyboardInterrupt in this thread also kills the ranks and removes the group before propagating.
    """
    if inject is not None and inject not in BACKEND_INJECTS + RUNNER_INJECTS:
        raise ValueError(f"inject must be one of {', '.join(BACKEND_INJECTS + RUNNER_INJECTS)}, got {inject!r}")
    if inject in RUNNER_INJECTS and not handle.is_simulated:
        raise ValueError(f"inject {inject!r} is only possible on a simulated cluster")
    limit = float(timeout_s if timeout_s is not None else cfg.training.trial_timeout_s)
    deadline = time.monotonic() + limit
    trial_dir = Path(trial_dir).resolve()
    trial_dir.mkdir(parents=True, exist_ok=True)
    trial_id = f"{trial_dir.name}-{uuid.uuid4().hex[:6]}"
    backend_inject = inject if inject in BACKEND_INJECTS else None
    request = _request(cfg, layout, handle, trial_dir, limit, backend_inject, inject_rank)
    if reference_checkpoint is not None:
        # The ranks' working folder is their Ray worker's, not the driver's, on a cluster started by `ray start`
        # (issue 51: a relative --out put the reference there, and the driver found none).
        reference_checkpoint = str(Path(reference_checkpoint).resolve())
    request = replace(request, reference_checkpoint=reference_checkpoint, make_reference=make_reference,
                      stack_dump_at=stacks.dump_time(limit),
                      routing_stress_steps=cfg.search.routing_stress_steps if routing_stress else 0)
    node_loss_rank = inject_rank if inject == "node-loss" else None

    try:
        if pool is not None and nodes is not None:
            plan = plan_placement(layout.world_size, cfg.cluster.gpus_per_node, cpus_per_rank=CPUS_PER_RANK,
                                  keep_together=keep_together(layout, cfg.cluster.gpus_per_node))
            result = _run_pooled(pool, nodes, plan, request, handle, trial_id, backend, deadline, limit,
                                 node_loss_rank, on_running, cancel)
        else:
            with trial_placement(
                handle,
                layout.world_size,
                cfg.cluster.gpus_per_node,
                timeout_s=limit,
                keep_together=keep_together(layout, cfg.cluster.gpus_per_node),
                cpus_per_rank=CPUS_PER_RANK,
                name=f"sweeper-{trial_id}",
                nodes=nodes,
            ) as placement:
                result = _run_fresh(request, placement, handle, trial_id, backend, deadline, limit,
                                    node_loss_rank, on_running, cancel)
    except PlacementTimeout as exc:
        result = TrialResult(status="failed", failure_kind="infra", error=str(exc), notes=[PLACEMENT_TIMEOUT])
    except PlacementError as exc:
        result = TrialResult(status="failed", failure_kind="invalid_layout", error=f"placement: {exc}")
    result.trial_dir = str(trial_dir)
    _write_json(trial_dir / "result.json", result.to_json())
    return result


def keep_together(layout: Layout, gpus_per_node: int) -> int:
    # TP groups must share a node; CP groups too when they fit (Megatron orders ranks tp, cp, dp, pp).
    return layout.tp * layout.cp if layout.tp * layout.cp <= gpus_per_node else layout.tp


def _request(
    cfg: SweepConfig, layout: Layout, handle: ClusterHandle, trial_dir: Path, limit: float,
    inject: str | None, inject_rank: int,
) -> SmokeRequest:
    t = cfg.training
    return SmokeRequest(
        model=cfg.model,
        layout=layout,
        seq_length=t.seq_length,
        steps=t.steps,
        warmup_steps=t.warmup_steps,
        checkpoint=t.checkpoint,
        checkpoint_every=t.checkpoint_every,
        keep_checkpoint=t.keep_checkpoints != "none",  # deleted after its bitwise reload otherwise (issue 43)
        trial_dir=str(trial_dir),
        # The runner's wall-time limit is what stops a hung trial, so the process-group timeout never fires first
        # and turns a hang into a misleading comm error.
        timeout_s=limit,
        memory_limit_gib=float(cfg.cluster.gpu_memory_gib) if handle.is_simulated else None,
        host_memory_gib=_host_memory_gib(cfg, handle),
        run=cfg.run,
        compute_capability=cfg.cluster.compute_capability,
        inject=inject,  # type: ignore[arg-type]
        inject_rank=inject_rank,
    )


def _host_memory_gib(cfg: SweepConfig, handle: ClusterHandle) -> float | None:
    """The host memory a node's checkpoint save is held against: the YAML's, else on a simulated cluster this
    machine's memory shared by its simulated nodes, else None (each node reports its own)."""
    if cfg.cluster.host_memory_gib is not None:
        return float(cfg.cluster.host_memory_gib)
    if handle.simulated is not None:
        return psutil.virtual_memory().total / GIB / max(1, len(handle.simulated.nodes))
    return None


def _run_fresh(
    request: SmokeRequest, placement: TrialPlacement, handle: ClusterHandle, trial_id: str, backend: str,
    deadline: float, limit: float, node_loss_rank: int | None,
    on_running: Callable[[RunningTrial], None] | None, cancel: threading.Event | None,
) -> TrialResult:
    """One new RankActor per rank in the trial's placement group, all killed when it ends."""
    world_size = request.layout.world_size
    actors = [
        RankActor.options(  # type: ignore[attr-defined]  # added by @ray.remote
            num_gpus=1,
            num_cpus=CPUS_PER_RANK,
            scheduling_strategy=placement.strategy(rank),
            name=f"sweeper-{trial_id}-rank{rank}",
        ).remote(rank, world_size)
        for rank in range(world_size)
    ]
    note = (f"placement {placement.plan.num_bundles}x{placement.plan.ranks_per_bundle} GPUs "
            f"{placement.plan.strategy}, reserved in {placement.wait_s:.1f}s")
    try:
        result, _ = _run_ranks(request, actors, note, handle, trial_id, backend, deadline, limit,
                               node_loss_rank=node_loss_rank, on_running=on_running, cancel=cancel)
        return result
    finally:
        # Every rank at once; removing the placement group (by the caller's context manager) follows and
        # would kill them too, but an explicit kill does not depend on that.
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _run_pooled(
    pool: RankPool, nodes: list[str], plan: PlacementPlan, request: SmokeRequest, handle: ClusterHandle,
    trial_id: str, backend: str, deadline: float, limit: float, node_loss_rank: int | None,
    on_running: Callable[[RunningTrial], None] | None, cancel: threading.Event | None,
) -> TrialResult:
    """The trial on warm ranks leased from the sweep's pool (each rank a fresh child of a warm process); ranks
    whose child did not end cleanly are stopped, and warm ranks that are lost or will not stop are retired."""
    plan.check_nodes(nodes)
    lease = pool.lease(nodes, plan.ranks_per_bundle, request.layout.world_size,
                       timeout_s=max(deadline - time.monotonic(), 0.001))
    note = (f"placement {plan.num_bundles}x{plan.ranks_per_bundle} GPUs {plan.strategy} on warm ranks "
            f"({len(lease.ranks) - lease.fresh} reused, {lease.fresh} started), reserved in {lease.wait_s:.1f}s")
    retire = list(lease.ranks)
    try:
        result, outcomes = _run_ranks(
            request, lease.actors, note, handle, trial_id, backend, deadline, limit,
            node_loss_rank=node_loss_rank, on_running=on_running, cancel=cancel,
        )
        retire = _stop_children(lease.ranks, outcomes)
        return result
    finally:
        pool.give_back(lease.ranks, retire)


def _stop_children(ranks: list[Warm], outcomes: list[RankOutcome]) -> list[Warm]:
    """Stop the children of ranks that had not reported; the warm ranks to retire (actor lost, or it did not
    confirm its child is gone)."""
    retire = [ranks[o.rank] for o in outcomes if o.actor_lost]
    stopping = {ranks[o.rank].actor.stop.remote(): ranks[o.rank] for o in outcomes
                if o.report is None and o.died is None}
    if stopping:
        ready, _ = ray.wait(list(stopping), num_returns=len(stopping), timeout=STOP_CONFIRM_S)
        for ref, warm in stopping.items():
            try:
                stopped = ref in ready and ray.get(ref)
            except RayError:
                stopped = False
            if not stopped:
                retire.append(warm)
    return retire


def _run_ranks(
    request: SmokeRequest,
    actors: list,
    placement_note: str,
    handle: ClusterHandle,
    trial_id: str,
    backend: str,
    deadline: float,
    limit: float,
    *,
    node_loss_rank: int | None,
    on_running: Callable[[RunningTrial], None] | None,
    cancel: threading.Event | None,
) -> tuple[TrialResult, list[RankOutcome]]:
    world_size = request.layout.world_size
    outcomes = [RankOutcome(rank=r, node="?") for r in range(world_size)]
    timeout_error: str | None = None
    abort_error: tuple[str, str] | None = None
    notes = [placement_note]
    try:
        slots = _describe(actors, deadline)
        if isinstance(slots, str):
            kind = "timeout" if slots.startswith("timeout") else "infra"
            abort_error = (kind, slots)
            for outcome in outcomes:
                outcome.actor_lost = kind == "infra"
        else:
            slots = [replace(slot, rank=rank) for rank, slot in enumerate(slots)]  # warm ranks learn theirs here
            labels = {nid: handle.label_of(nid) for nid in {s.node_id for s in slots}}
            for slot, outcome in zip(slots, outcomes):
                outcome.node = labels[slot.node_id]
            envs = _rank_envs(slots, labels, trial_id,
                              megatron_environment(request.layout, request.compute_capability),
                              gpu=not handle.is_simulated)
            sys_path = [os.getcwd()] + [p for p in sys.path if p]
            pending = {actors[r].run.remote(backend, request, envs[r], sys_path): r for r in range(world_size)}
            running = RunningTrial(trial_id, [o.node for o in outcomes], [s.node_id for s in slots])
            if on_running is not None:
                on_running(running)
            if node_loss_rank is not None and handle.simulated is not None:
                handle.simulated.remove_node(slots[node_loss_rank].node_id)
                notes.append(f"injected: node-loss of {outcomes[node_loss_rank].node} (rank {node_loss_rank})")
            stop = _gather(pending, outcomes, deadline, cancel)
            if _name_lost_nodes(outcomes, slots, handle):
                notes.append(NODE_LOST)
            if stop == "timeout":
                still = sorted(r for r in range(world_size) if outcomes[r].report is None and outcomes[r].died is None)
                timeout_error = (f"timeout: trial still running after {limit:.0f}s (training.trial_timeout_s); "
                                 f"ranks {still} had not finished")
                forensics = stacks.blocked_in(request.trial_dir)
                if forensics:
                    timeout_error += f"; {forensics}"
            elif stop == "cancelled":
                abort_error = ("infra", "cancelled: the trial was stopped before it finished")
                notes.append(CANCELLED)
    finally:
        _ask_unreported_checks(actors, outcomes)
    if any(o.died and o.died.startswith(HOST_OUT_OF_MEMORY) for o in outcomes):
        notes.append(HOST_OUT_OF_MEMORY)
    result = aggregate(
        outcomes,
        world_size=world_size,
        warmup_steps=request.warmup_steps,
        trial_dir=request.trial_dir,
        timeout_error=timeout_error,
        abort_error=abort_error,
        notes=notes,
    )
    return result, outcomes


def _ask_unreported_checks(actors: list, outcomes: list[RankOutcome]) -> None:
    """Before stopping ranks that have not reported (a peer failed, the trial timed out, it was cancelled), ask
    each what it had proven: the result's checks are then what every rank proved, failed trial or not."""
    waiting = {actors[o.rank].checks.remote(): o for o in outcomes if o.report is None and o.died is None}
    if not waiting:
        return
    ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=CHECKS_PROBE_S)
    for ref in ready:
        try:
            waiting[ref].proven = ray.get(ref)
        except RayError:  # the rank died meanwhile: nothing known of it
            pass


def _describe(actors: list, deadline: float) -> list[RankSlot] | str:
    """Where each rank landed, or a one-line reason why the ranks could not start."""
    refs = [actor.describe.remote(rank == 0) for rank, actor in enumerate(actors)]
    try:
        return ray.get(refs, timeout=max(deadline - time.monotonic(), 0.001))
    except GetTimeoutError:
        return "timeout: rank actors did not start before the trial's wall-time limit"
    except RayError as exc:  # an actor that died starting (e.g. sweeper not importable on that node)
        return f"rank actor failed to start: {cause_line(exc)}"


@functools.cache
def loopback_interface() -> str:
    """The loopback interface's name: ``lo`` on Linux, ``lo0`` on macOS and the BSDs."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in names if name in ("lo", "lo0")), "lo")


def _rank_envs(slots: list[RankSlot], labels: dict[str, str], trial_id: str,
               gpu_env: Sequence[EnvVar] = (), *, gpu: bool) -> list[dict[str, str]]:
    """torch.distributed rendezvous variables per rank, plus a node-wide CUDA_VISIBLE_DEVICES and, on GPU ranks,
    ``gpu_env`` (the layout's Megatron environment, exactly what launch_megatron_lm.sh exports). ``gpu`` False (a
    simulated cluster): CPU ranks, every GPU hidden (``CPU_RANK_ENV``), whatever ids Ray gave them.

    Ray gives each actor only its own GPU; like torchrun, every rank of a node sees all the trial's GPUs on that
    node (NCCL's intra-node peer-to-peer needs it) and LOCAL_RANK indexes its own one among them.
    """
    master = slots[0]
    assert master.port is not None
    node_gpus: dict[str, list[str]] = {}
    node_ranks: dict[str, list[int]] = {}
    for slot in slots:
        node_gpus.setdefault(slot.node_id, []).extend(slot.gpu_ids)
        node_ranks.setdefault(slot.node_id, []).append(slot.rank)
    envs = []
    for slot in slots:
        gpus = sorted(set(node_gpus[slot.node_id]), key=lambda g: (len(g), g))
        ranks = node_ranks[slot.node_id]
        local_rank = gpus.index(slot.gpu_ids[0]) if slot.gpu_ids else ranks.index(slot.rank)
        env = {
            "MASTER_ADDR": master.ip,
            "MASTER_PORT": str(master.port),
            "RANK": str(slot.rank),
            "WORLD_SIZE": str(len(slots)),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(len(ranks)),
            "SWEEPER_NODE_ID": labels[slot.node_id],
            "SWEEPER_TRIAL_ID": trial_id,
        }
        if not gpu:
            env.update(CPU_RANK_ENV)
        elif gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env.update({v.name: v.value for v in gpu_env})
        if ipaddress.ip_address(master.ip).is_loopback:
            # Every rank is on this machine (a simulated cluster): gloo's pairs on loopback too. Without it gloo
            # binds the address the host name resolves to, the machine's interface.
            env["GLOO_SOCKET_IFNAME"] = loopback_interface()
        envs.append(env)
    return envs


def _gather(
    pending: dict,
    outcomes: list[RankOutcome],
    deadline: float,
    cancel: threading.Event | None,
) -> str:
    """Collect rank outcomes until done; returns why it stopped: done | failed | timeout | cancelled."""
    first_failure: float | None = None
    while pending:
        now = time.monotonic()
        if cancel is not None and cancel.is_set():
            return "cancelled"
        if now >= deadline:
            return "timeout"
        if first_failure is not None:
            real = any(o.failed and not is_collateral(o.failure_kind) for o in outcomes)
            if real or now >= first_failure + COLLATERAL_GRACE_S:
                return "failed"
        wait_s = min(deadline - now, 0.5)
        if first_failure is not None:
            wait_s = min(wait_s, first_failure + COLLATERAL_GRACE_S - now)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(wait_s, 0.001))
        for ref in ready:
            outcome = outcomes[pending.pop(ref)]
            outcome.arrived = time.monotonic()
            try:
                value = ray.get(ref)
            except RayActorError as exc:
                outcome.died, outcome.actor_lost = f"rank process died: {cause_line(exc)}", True
            except RayTaskError as exc:  # the actor method itself raised (not the backend): a runner bug
                outcome.died, outcome.actor_lost = f"rank actor raised: {cause_line(exc)}", True
            except OutOfMemoryError as exc:  # Ray's memory monitor killed it: the node's host memory ran out
                outcome.died, outcome.actor_lost = f"{HOST_OUT_OF_MEMORY}: {cause_line(exc)}", True
            except RayError as exc:
                outcome.died, outcome.actor_lost = f"rank lost: {cause_line(exc)}", True
            else:
                if isinstance(value, RankDied):  # a warm rank's child ended without a report
                    outcome.died = f"rank process died: {value.reason}"
                else:
                    outcome.report = value
            if outcome.failed and first_failure is None:
                first_failure = outcome.arrived
    return "failed" if first_failure is not None else "done"


def _name_lost_nodes(outcomes: list[RankOutcome], slots: list[RankSlot], handle: ClusterHandle) -> bool:
    """A rank that died with its node is a node loss; say so (Ray reports both as an unreachable actor). True when
    a node was lost."""
    dead = {slot.node_id for slot, o in zip(slots, outcomes)
            if o.died is not None and not handle.node_alive(slot.node_id)}
    for slot, outcome in zip(slots, outcomes):
        if outcome.died is not None and slot.node_id in dead:
            outcome.died = f"node {outcome.node} lost while the rank ran ({outcome.died})"
    return bool(dead)


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


__all__ = ["DEFAULT_BACKEND", "RunningTrial", "run_trial"]
