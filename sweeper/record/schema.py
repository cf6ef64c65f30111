"""TrialResult: what one smoke trial proved, in the shape of the `trial --json` contract (ARCHITECTURE.md).

Plain dataclasses so the sweep, the tracker and the report can use results without importing Ray or torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["passed", "failed", "pruned"]
# replica_divergence: copies of a replicated parameter (across DP/CP, EDP, TP/ETP or the tied embedding) differ
# after the steps, i.e. a gradient reduction ran over the wrong group. internal: sweeper's own code raised (a
# sweeper bug, the error names file:line); like infra it says nothing about the layout.
FailureKind = Literal[
    "invalid_layout", "oom", "nan", "timeout", "comm_error", "checkpoint_error", "equivalence", "replica_divergence",
    "infra", "internal", "unsupported",
]
FAILURE_KINDS: tuple[str, ...] = (
    "invalid_layout", "oom", "nan", "timeout", "comm_error", "checkpoint_error", "equivalence", "replica_divergence",
    "infra", "internal", "unsupported",
)


@dataclass
class TrialMetrics:
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    tflops_per_gpu: float | None = None
    peak_memory_gib: float | None = None  # max over ranks; device reserved on GPU, host RSS on CPU (see memory_kind)
    loss_first: float | None = None
    loss_last: float | None = None
    # MoE with EP > 1: the busiest EP rank's routed tokens over the mean, worst over layers and forwards (issue 13)
    moe_hot_rank_factor: float | None = None


@dataclass
class TrialChecks:
    process_group: bool = False
    model_built: bool = False
    forward_backward: bool = False
    finite: bool = False
    checkpoint_saved: bool = False
    checkpoint_reloaded: bool | None = None
    equivalence_rel_err: float | None = None
    # Every replicated parameter bit-identical across its copies after the steps; None when nothing is replicated.
    replicas_consistent: bool | None = None


@dataclass
class TrialResult:
    status: Status
    failure_kind: FailureKind | None = None
    error: str | None = None
    metrics: TrialMetrics = field(default_factory=TrialMetrics)
    checks: TrialChecks = field(default_factory=TrialChecks)
    checkpoint: str | None = None
    rank_nodes: list[str] = field(default_factory=list)
    backend: str = "none"
    # Beyond the contract's required keys: what the memory figure measures, per-step losses, notes such as
    # "Mamba fast path missing", and the trial folder holding every rank's log.
    memory_kind: Literal["device", "host"] | None = None
    losses: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trial_dir: str | None = None
    # Seconds per phase of the smoke run (init, build, equivalence, steps, checkpoint_save, checkpoint_load): the
    # slowest rank's time for each phase, where a trial's overhead goes.
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialResult:
        data = dict(data)
        data["metrics"] = TrialMetrics(**data.get("metrics") or {})
        data["checks"] = TrialChecks(**data.get("checks") or {})
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def pruned(cls, reason: str, kind: FailureKind | None = "invalid_layout") -> TrialResult:
        return cls(status="pruned", failure_kind=kind, error=reason)
