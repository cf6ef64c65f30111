"""The one interface between the trial runner (Ray actors) and a training backend: a request in, a report out.

Both are typed, picklable values (the model, the layout and the run settings travel as their own types). The
runner sets the torch.distributed rendezvous environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)
before calling the backend in the rank's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sweeper.config.run_settings import RunSettings
from sweeper.models.spec import ModelSpec
from sweeper.record.schema import TrialChecks
from sweeper.space.layout import Layout

# "swap_shards" (equivalence gate tests): after the reference is loaded, every tensor-parallel group rotates its
# shards of the first decoder layer's fc1 weight (collective, so inject_rank is ignored): a wrong layout.
# "bug" (tests of failure classification): sweeper's own build path raises a TypeError, as a sweeper bug would.
# "drift" (trajectory check tests): inject_rank's gradient scaled from a later step on (smoke.DRIFT_FROM_STEP).
Inject = Literal["nan", "hang", "crash", "swap_shards", "bug", "drift"]


@dataclass(frozen=True)
class SmokeRequest:
    model: ModelSpec
    layout: Layout
    seq_length: int
    steps: int
    warmup_steps: int
    checkpoint: bool
    checkpoint_every: int | None
    trial_dir: str  # every rank writes its log and the torch_dist checkpoint under here (shared by ranks of a node)
    seed: int = 1234
    timeout_s: float = 900.0  # torch.distributed process-group timeout
    # CPU only: the simulated GPU's memory; a rank whose resident memory exceeds it stops with failure kind oom.
    memory_limit_gib: float | None = None
    # The node's host memory a checkpoint save is held against; None: the node's own (psutil), reported per rank.
    host_memory_gib: float | None = None
    reference_checkpoint: str | None = None  # equivalence gate: load this checkpoint, compare loss on a fixed batch
    # True: instead of loading reference_checkpoint, create it (initial weights + reference.json with the loss and
    # gradient norm on the fixed batch); see sweeper/backends/megatron/equivalence.py for the protocol.
    make_reference: bool = False
    run: RunSettings = field(default_factory=RunSettings)  # grad dtype, optimizer, FP8 weights
    # The cluster's declared compute capability (cluster.compute_capability): the GPU ranks' Megatron environment
    # is the export's for it (sweeper.space.environment).
    compute_capability: str = "9.0"
    # Wall-clock time (time.time()) at which a rank still running dumps every thread's stack into
    # <trial_dir>/stacks/ (trial/stacks.py), shortly before the runner's wall-time limit; None: no dump.
    stack_dump_at: float | None = None
    # Routing stress (MoE with EP > 1, confirmations): after the checkpoint, this many steps per stress mode with
    # the router forced onto hot experts (backends/megatron/routing.py); 0: none.
    routing_stress_steps: int = 0
    # False: after the last save's bitwise reload (a barrier: every rank has read it back) rank 0 deletes the
    # trial's checkpoint folder (training.keep_checkpoints none, issue 43). True keeps it (keep_checkpoints winner
    # or all, `migrate`'s runs); the default, so a caller that does not decide keeps it.
    keep_checkpoint: bool = True
    inject: Inject | None = None  # fault injection for tests (simulated clusters only)
    inject_rank: int = 0


@dataclass
class RankReport:
    rank: int
    node_id: str
    backend: str  # "megatron-core-cpu" | "megatron-core-gpu"
    ok: bool
    failure_kind: str | None = None  # one of sweeper.record.schema.FAILURE_KINDS
    error: str | None = None  # one line: the root cause in the user's terms
    checks: TrialChecks = field(default_factory=TrialChecks)  # what this rank proved (False / None: not proven)
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    flops_per_step: float = 0.0  # Megatron's formula, whole model, one global batch
    peak_memory_bytes: int = 0  # through the steps (the checkpoint phase's is checkpoint_peak_memory_bytes)
    # The peak before the steps (build, reference load, equivalence gate), measured as peak_memory_bytes is; the
    # steps' figure starts from a reset, so this one is apart. None: the rank failed before the steps.
    pre_steps_peak_memory_bytes: int | None = None
    memory_kind: Literal["device", "host"] = "host"
    # GPU only: device memory outside torch's allocator (CUDA context, NCCL buffers, cuBLAS workspaces), measured
    # after the steps as the device's used memory less what torch has reserved.
    non_torch_memory_bytes: int | None = None
    checkpoint_peak_memory_bytes: int | None = None  # the saves and reloads, measured as peak_memory_bytes is
    moe_hot_rank_factor: float | None = None  # busiest EP rank's routed tokens over the mean (routing.py)
    checkpoint_dir: str | None = None
    # Rank 0 (issue 43): the bytes the trial's checkpoint folder held after the last reload (every save of the
    # trial), and whether it deleted the folder then (keep_checkpoint False); None / False on other ranks.
    checkpoint_bytes: int | None = None
    checkpoint_deleted: bool = False
    # The last save and reload of the trial's checkpoint: seconds each, and this rank's peak resident host memory
    # while saving (a node's ranks save at once, so the node holds their sum); and the node's host memory.
    checkpoint_save_s: float | None = None
    checkpoint_load_s: float | None = None
    checkpoint_save_rss_bytes: int | None = None
    host_memory_bytes: int | None = None
    equivalence: dict[str, float] | None = None  # {"loss": ..., "grad_norm": ...} on the reference batch
    # The reference checkpoint's load into this layout: {"layout": the writer's Layout.to_dict(), "tensors": keys
    # this rank loaded, "resharded": those whose shard is not a stored chunk, "load_s": seconds}
    reference_load: dict[str, Any] | None = None
    # Routing stress: mode -> {"peak_memory_bytes": this rank's peak during the mode's steps, "hot_rank_factor":
    # the busiest EP rank's tokens over the mean it produced, "finite": loss and gradient norm stayed finite}
    routing_stress: dict[str, dict[str, Any]] | None = None
    notes: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)  # import, init, build, equivalence, steps, checkpoint_*
    # Proof of placement: group kind (tp, pp, cp, dp, ep, etp, edp) -> the global ranks of this rank's group, as
    # megatron-core built it; and the GPU it ran on, as its node numbers it.
    groups: dict[str, list[int]] = field(default_factory=dict)
    gpu: str | None = None
    # GPU only: this rank's device's compute capability ("9.0"); a rank whose device differs from the declared
    # cluster.compute_capability fails the trial (infra) before anything else.
    compute_capability: str | None = None


# The running rank's checks, shared by the backend as it proves them (the object is updated in place), so the
# runner can still learn what a rank had proven when the rank is stopped before it reports (a peer failed first,
# the trial timed out). One rank per process.
_live_checks = TrialChecks()


def share_checks(checks: TrialChecks) -> None:
    """Called by a backend with its RankReport's ``checks`` at the start of a rank's run."""
    global _live_checks
    _live_checks = checks


def shared_checks() -> TrialChecks:
    """A copy of what the running (or last) rank of this process has proven so far."""
    return replace(_live_checks)

