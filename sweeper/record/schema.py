"""What a sweep records, as types: ``TrialResult`` (the ``trial --json`` contract), ``TrialRecord`` (one line of
``trials.jsonl``) and ``SweepMeta`` (``sweep.json``), in the shapes docs/ARCHITECTURE.md gives.

The sweep writes them and the selection, the progress line and the report read them only through these types
(``record.sweepdir`` does the file work). Reading is tolerant: a newer writer's extra keys are dropped from the
result and kept in ``sweep.json``; a value of the wrong type in ``sweep.json`` (a hand edit) reads as unknown.
Plain dataclasses for results, so Ray ships them without pydantic; ``docs/schemas/`` holds the JSON Schemas,
generated from these types (``python -m sweeper.record.schema``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, TypeAdapter

from sweeper.config.schema import SweepConfig, memory_limit_gib

Status = Literal["passed", "failed", "pruned"]
# replica_divergence: copies of a replicated parameter (across DP/CP, EDP, TP/ETP or the tied embedding) differ
# after the steps, i.e. a gradient reduction ran over the wrong group. internal: sweeper's own code raised (a
# sweeper bug, the error names file:line); like infra it says nothing about the layout. checkpoint_host_oom: the
# checkpoint save held more host memory on a node (its ranks' resident sets, summed) than the node has (issue 17).
FailureKind = Literal[
    "invalid_layout", "oom", "nan", "timeout", "comm_error", "checkpoint_error", "equivalence", "replica_divergence",
    "infra", "internal", "unsupported", "checkpoint_host_oom", "crash",
]
FAILURE_KINDS: tuple[str, ...] = get_args(FailureKind)
# A trial's note (the backend's) when the equivalence gate could not run on its layout; the reason follows.
GATE_SKIPPED = "equivalence gate skipped"


@dataclass
class TrialMetrics:
    tokens_per_s: float | None = None
    # The mean of the timed steps (warm-up excluded): a production run's time is the sum of its steps, stalls
    # included, so throughput is tokens over the mean step (issue 53); the median, the 90th percentile and the slowest
    # step beside it say how the steps spread.
    step_time_s: float | None = None
    step_time_median_s: float | None = None
    step_time_p90_s: float | None = None
    step_time_max_s: float | None = None
    tflops_per_gpu: float | None = None
    # Max over ranks, through the training steps; device reserved on GPU, host RSS on CPU (see memory_kind).
    peak_memory_gib: float | None = None
    # GPU only: the most device memory outside torch's allocator on one rank (CUDA context, NCCL buffers; measured
    # after the steps): peak_memory_gib + this is what the GPU must hold (search.decide.candidates.is_stable).
    non_torch_memory_gib: float | None = None
    # The checkpoint phase's peak (saves and reloads), measured as peak_memory_gib is; kept apart from it.
    checkpoint_peak_memory_gib: float | None = None
    # The peak before the training steps (build, reference load, equivalence gate), max over ranks, measured as
    # peak_memory_gib is; the steps' peak starts from a reset when the steps start (issue 44).
    pre_steps_peak_memory_gib: float | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    # MoE with EP > 1: the busiest EP rank's routed tokens over the mean, worst over layers and forwards (issue 13)
    moe_hot_rank_factor: float | None = None
    # The trial's last checkpoint (issue 17): save and reload seconds (slowest rank), and the most host memory one
    # node held during the save (its ranks' peak resident sets, summed; GiB)
    checkpoint_save_s: float | None = None
    checkpoint_load_s: float | None = None
    checkpoint_save_host_gib: float | None = None
    # Routing stress (issue 17; MoE confirmations with EP > 1): the highest peak memory (max over ranks and stress
    # modes, measured as peak_memory_gib is) while the router was forced onto hot experts; None: not stressed
    stress_peak_memory_gib: float | None = None


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
    # Each step's gradient norm (Megatron's, the same on every rank): with ``losses`` the trajectory a confirmation
    # is held against (search/decide/verdicts.py ``diverged``).
    grad_norms: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trial_dir: str | None = None
    # Seconds per phase of the smoke run (init, build, equivalence, steps, checkpoint_save, checkpoint_load): the
    # slowest rank's time for each phase, where a trial's overhead goes.
    timings_s: dict[str, float] = field(default_factory=dict)
    # Each step's time (the slowest rank's; warm-up steps included) and each rank's peak memory in GiB (rank order;
    # None for a rank that reported none): the series behind step_time_s and peak_memory_gib.
    step_times_s: list[float] = field(default_factory=list)
    rank_peak_memory_gib: list[float | None] = field(default_factory=list)
    # Proof of placement (issue 17): group kind -> every group of that kind -> its ranks, each {"rank", "node",
    # "gpu"}, from the process groups megatron-core built; and one line per TP or ETP group that spans nodes.
    placement: dict[str, list[list[dict[str, Any]]]] = field(default_factory=dict)
    placement_warnings: list[str] = field(default_factory=list)
    # The equivalence reference's checkpoint as this layout loaded it (issue 17, layout migration): the layout that
    # wrote it, the tensors loaded, those resharded (a shard asked for is not a chunk the writer stored) and each
    # rank's load seconds (rank order); None when no reference was loaded.
    reference_load: dict[str, Any] | None = None
    # Routing stress (issue 17): mode ("hot_expert", "hot_rank") -> {"peak_memory_gib": max over ranks,
    # "hot_rank_factor": the busiest EP rank's tokens over the mean under that forcing, "finite": bool}; None when
    # the trial ran no stress (explorations, dense models, EP 1).
    routing_stress: dict[str, dict[str, Any]] | None = None
    # The trial's checkpoint on disk (issue 43): the bytes its folder held after the last reload (every save of the
    # trial; None: none was saved and reloaded), and whether the trial deleted it then (training.keep_checkpoints
    # none; ``checkpoint`` still names where it was). A sweep's end may delete it later (sweep.json checkpoints).
    checkpoint_bytes: int | None = None
    checkpoint_deleted: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialResult:
        """The result a JSON object describes; keys this version does not know (a newer writer's) are dropped."""
        data = _known(cls, data)
        data["metrics"] = TrialMetrics(**_known(TrialMetrics, data.get("metrics")))
        data["checks"] = TrialChecks(**_known(TrialChecks, data.get("checks")))
        return cls(**data)

    @classmethod
    def pruned(cls, reason: str, kind: FailureKind | None = "invalid_layout") -> TrialResult:
        return cls(status="pruned", failure_kind=kind, error=reason)


def _known(cls: type, data: Any) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in dict(data or {}).items() if k in names}


Phase = Literal["explore", "confirm"]


@dataclass
class TrialRecord:
    """One line of ``trials.jsonl``: one attempt of one trial (or a layout refused without launching, attempt 0)."""

    number: int
    layout: dict[str, Any]  # the contract's layout object (``Layout.to_dict``)
    result: TrialResult
    attempt: int = 1
    phase: Phase = "explore"
    predicted: dict[str, Any] | None = None  # the estimate it was launched with (``Estimate.to_json``)
    started_at: str | None = None
    ended_at: str | None = None
    mlflow_run_id: str | None = None
    # Trials of the sweep ("number.attempt") that ran on one of its nodes while it ran, and the GPUs other jobs
    # held there when it started: whether its measurement shared the nodes (issue 46).
    neighbours: list[str] = field(default_factory=list)
    other_jobs_gpus: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number, "layout": self.layout, "result": self.result.to_json(),
            "predicted": self.predicted, "started_at": self.started_at, "ended_at": self.ended_at,
            "attempt": self.attempt, "mlflow_run_id": self.mlflow_run_id, "phase": self.phase,
            "neighbours": self.neighbours, "other_jobs_gpus": self.other_jobs_gpus,
        }

    @property
    def alone(self) -> bool:
        """Whether it ran with no other trial and no other job's GPUs on its nodes."""
        return not self.neighbours and not self.other_jobs_gpus

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialRecord:
        """Raises KeyError, TypeError or ValueError for a line that is not a record."""
        predicted, attempt = data.get("predicted"), data.get("attempt")
        return cls(
            number=int(data["number"]),
            layout=dict(data.get("layout") or {}),
            result=TrialResult.from_json(data["result"]),
            attempt=1 if attempt is None else int(attempt),
            phase="confirm" if data.get("phase") == "confirm" else "explore",
            predicted=dict(predicted) if isinstance(predicted, dict) else None,
            started_at=data.get("started_at"),
            ended_at=data.get("ended_at"),
            mlflow_run_id=data.get("mlflow_run_id"),
            neighbours=[str(n) for n in data.get("neighbours") or []],
            other_jobs_gpus=int(data.get("other_jobs_gpus") or 0),
        )

    @property
    def predicted_memory_gib(self) -> float | None:
        return (self.predicted or {}).get("memory_gib")


# What every output of a rehearsal (``search --rehearse``, trial/rehearsal.py) says of its figures: the decision's
# throughput basis, the report's banner, best_layout.yaml and the exports' headers (issue 54).
MODELLED = "modelled"
REHEARSAL_BACKEND = "rehearsal (modelled trials)"  # a rehearsal's trials' TrialResult.backend
REHEARSAL_NOTE = ("a rehearsal (sweeper search --rehearse): every trial was modelled from the estimator with its "
                  "error drawn, on a virtual clock; nothing was measured")


class SweepMeta(BaseModel):
    """``sweep.json``: what the sweep was run on, how it ended, and what it decided without a trial. Keys this
    version does not know are kept as they are (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    model: dict[str, Any] | None = None  # the resolved ModelSpec
    cluster: dict[str, Any] | None = None  # the cluster: section
    memory_headroom: float | None = None
    objective: str | None = None
    status: str | None = None  # running | finished | interrupted | budget | ...
    # True: a rehearsal's folder (every record modelled, REHEARSAL_NOTE); False: trials that ran. Written when the
    # folder is made; a resume of the other kind is refused, so its records are never a mix (issue 54).
    rehearsal: bool | None = None
    started_at: str | None = None
    ended_at: str | None = None
    memory_kind: Literal["device", "host"] | None = None
    mlflow: dict[str, Any] | None = None  # tracking_uri, experiment, parent_run_id
    best: dict[str, Any] | None = None  # number, layout (short name), the objective's median
    reference: dict[str, Any] | None = None  # the equivalence gate's reference checkpoint
    # The per-layout lists are written with the sweep's progress at most every SAVE_EVERY_S and when it ends
    memory_pruned: list[dict[str, Any]] | None = None  # layouts never launched on memory grounds (issue 13)
    dominated: list[dict[str, Any]] | None = None  # layouts a measured trial made not worth running (issue 15)
    # valid layouts the cluster's backend cannot run ({layout, reason}: "... unsupported on this backend (...)")
    unsupported: list[dict[str, Any]] | None = None
    stopped_early: str | None = None  # why exploring stopped before the budget (search.patience)
    scheduling_efficiency: float | None = None  # GPU-seconds busy over GPU-seconds held
    calibration: list[str] | None = None  # the estimator's fit, one line per factor
    # The step-time terms' fit (issue 33): backend, level, each freed term's factor, the median errors before and
    # after, and per measured trial its step time next to the uncalibrated and the calibrated prediction
    step_time_fit: dict[str, Any] | None = None
    # The winner and runners-up: throughput basis and band, the budget's projected time and cost, and why
    # (sweeper/search/decide/decision.py; issue 18)
    decision: dict[str, Any] | None = None
    # The trials' checkpoints at the sweep's end (issue 43, training.keep_checkpoints): {"keep", "kept": the
    # folders left, "deleted": the folders deleted then, "freed_bytes", "failed": one line per folder that stayed}
    # (sweeper/search/decide/checkpoints.py)
    checkpoints: dict[str, Any] | None = None
    # What the sweep's earlier driver runs spent of its budget (issue 51): {"wall_s", "gpu_s", "waited_s"}, written
    # with a recorded attempt at most every SAVE_EVERY_S (search/run/state.py) and when the sweep ends, so a
    # --resume (a preempted or requeued driver) continues the budget, not restarts it.
    spent: dict[str, float] | None = None

    @property
    def memory_limit_gib(self) -> float | None:
        """The stability limit: (1 - memory_headroom) of one GPU's memory, when both were recorded."""
        gpu = (self.cluster or {}).get("gpu_memory_gib")
        if not isinstance(gpu, (int, float)) or isinstance(gpu, bool) or self.memory_headroom is None:
            return None
        return memory_limit_gib(float(gpu), self.memory_headroom)

    @classmethod
    def from_json(cls, data: Any) -> SweepMeta:
        """Tolerant: a field holding the wrong type (a hand-edited or older file) reads as unknown (None)."""
        if not isinstance(data, dict):
            return cls()
        if isinstance(data.get("model"), str):  # an older writer's preset name
            data = {**data, "model": {"name": data["model"]}}
        if not isinstance(data.get("memory_headroom"), bool):
            try:  # a file as sweeper writes it: validated once, not field by field and then again (issue 54)
                return cls.model_validate(data)
            except ValueError:
                pass  # some field holds the wrong type: each one on its own
        kept: dict[str, Any] = {}
        for key, value in data.items():
            if key not in cls.model_fields:
                kept[key] = value
                continue
            try:
                cls.__pydantic_validator__.validate_assignment(cls.model_construct(), key, value)
            except ValueError:
                continue
            if key == "memory_headroom" and isinstance(value, bool):
                continue
            kept[key] = value
        return cls.model_validate(kept)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)  # what was written, nulls included


def is_rehearsal(meta: SweepMeta, records: Iterable[TrialRecord]) -> bool | None:
    """Whether a sweep folder holds a rehearsal: sweep.json says so; a folder written before sweep.json recorded it
    (issue 54) is one when its launched trials were modelled (their backend). None: nothing says yet."""
    if meta.rehearsal is not None:
        return meta.rehearsal
    launched = {record.result.backend for record in records if record.result.status != "pruned"}
    return (REHEARSAL_BACKEND in launched) if launched else None


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas of what sweeper reads (the search YAML) and records, from their types (docs/schemas/)."""
    search_yaml = SweepConfig.model_json_schema()
    search_yaml["properties"].pop("source", None)  # set by load_config, never read from the YAML
    return {
        "search_yaml.schema.json": search_yaml,
        "trial_result.schema.json": TypeAdapter(TrialResult).json_schema(),
        "trial_record.schema.json": TypeAdapter(TrialRecord).json_schema(),
        "sweep_meta.schema.json": SweepMeta.model_json_schema(),
    }


if __name__ == "__main__":  # python -m sweeper.record.schema [DIR]: (re)write the schemas
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas")
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (out / name).write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
