"""The search YAML's schema: every section, its defaults and its cross-field checks (pydantic, strict).

Keys and meanings follow docs/ARCHITECTURE.md exactly; unknown keys are errors (a typo must not silently fall back
to a default on a 16-GPU reservation). ``config.load.load_config`` reads a file into a ``SweepConfig``; the
``--layout`` / ``search.seeds`` strings are resolved against it by ``layout_from_string``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    create_model,
    field_validator,
    model_validator,
)

from sweeper.config.address import check_address
from sweeper.config.estimator import EstimatorConstants
from sweeper.config.run_settings import RunSettings
from sweeper.errors import LayoutError, UsageError
from sweeper.models.spec import ModelSpec
from sweeper.space.axes import PRECISIONS, SEARCHED, Axis
from sweeper.space.layout import Layout, canonical_cuda_graph, canonical_recompute, parse_assignments, resolve_sp
from sweeper.space.pipeline import with_pipeline_split


def memory_limit_gib(gpu_memory_gib: float, headroom: float) -> float:
    """The stability limit: a stable layout peaks at most at (1 - memory_headroom) of one GPU's memory."""
    return (1.0 - headroom) * gpu_memory_gib


# gt=0.0 (a float) tells the error formatter to say "greater than 0" rather than "a positive integer".
PositiveFloat = Annotated[float, Field(gt=0.0)]


class _Strict(BaseModel):
    # strict: a YAML `true` is not the integer 1, `2.0` is not the integer 2, "8" is not a number;
    # allow_inf_nan: .inf / .nan are not sizes, bandwidths or timeouts.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ClusterConfig(_Strict):
    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 8
    gpu_memory_gib: PositiveFloat = 80.0
    compute_capability: str = "9.0"
    gpu_kind: str | None = None  # e.g. h100, h200, b200, rtx-pro-6000; None = inferred from compute capability
    address: str = "auto"  # auto | local | HOST:PORT | ray://HOST:PORT
    simulate: Literal["auto"] | bool = "auto"
    # How long a Ray address gets to answer (TCP connect, then the GCS's reply) before connecting gives up.
    connect_timeout_s: PositiveFloat = 10.0
    intra_node_bandwidth_gbs: PositiveFloat = 50.0  # GB/s per GPU inside a node (PCIe 5 x16 ~ 50; NVLink 4 ~ 450)
    inter_node_bandwidth_gbs: PositiveFloat = 25.0  # GB/s per GPU between nodes (a 200 Gb/s NIC ~ 25)
    # GB/s per GPU between its memory and the host's, what activation offload copies over (PCIe 5 x16: ~50 raw per
    # direction, ~25 with the NICs and the other GPUs of a PCIe switch sharing it; GH200's NVLink-C2C ~450)
    host_link_gbs: PositiveFloat = 25.0
    # Keep one rank process per GPU for the whole sweep, megatron imported once, each trial's rank a fresh fork
    # of it (sweeper/trial/pool.py); false: new rank actors in a placement group of each trial's own.
    warm_ranks: bool = True
    # Each node's host (CPU) memory, which a checkpoint save is held against (issue 17); None: what the node
    # reports (a simulated cluster's nodes share this machine, so each gets its share).
    host_memory_gib: PositiveFloat | None = None

    @field_validator("compute_capability", mode="before")
    @classmethod
    def _cc(cls, value: Any) -> str:
        text = str(value)
        if not re.fullmatch(r"\d{1,2}\.\d", text):
            raise ValueError(f"must look like '9.0' or '12.0', got {value!r}")
        return text

    @field_validator("address", mode="after")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)

    @model_validator(mode="after")
    def _simulate_or_address(self) -> ClusterConfig:
        if self.simulate is True and self.address != "auto":
            raise FieldError(("cluster", "simulate"), f"true cannot be combined with cluster.address "
                              f"{self.address!r} (a simulated cluster is started on this machine)")
        return self

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capability(self) -> tuple[int, int]:
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


class TrainingConfig(_Strict):
    seq_length: PositiveInt = 4096
    global_batch_size: PositiveInt = 64
    steps: PositiveInt = 20
    checkpoint: bool = True
    checkpoint_every: PositiveInt | None = None  # None = one save at the last step
    trial_timeout_s: PositiveFloat = 900.0
    warmup_steps: int = Field(2, ge=0)  # step times of these first steps are excluded from throughput
    data_paths: list[str] = []  # files every node must see (doctor checks them); trials use synthetic tokens
    tokenizer_path: str | None = None

    @model_validator(mode="after")
    def _warmup(self) -> TrainingConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})")
        return self


class _SpaceBase(_Strict):
    """The ``space:`` section: for every searched axis of ``space.axes``, the values to try."""

    def values(self, axis: str) -> list[Any]:
        """The values listed for ``axis`` (``gpus``: empty when the section leaves it to the cluster)."""
        return list(getattr(self, axis)) if getattr(self, axis) is not None else []

    @field_validator("*", mode="after")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must list at least one value")
        return value

    @field_validator("recompute", mode="after", check_fields=False)
    @classmethod
    def _recompute(cls, value: list[str]) -> list[str]:
        try:  # the canonical spelling (a Layout holds the same), duplicates dropped
            return list(dict.fromkeys(canonical_recompute(str(v)) for v in value))
        except LayoutError as exc:
            raise ValueError(str(exc).removeprefix("recompute: ")) from None


    @field_validator("cuda_graph", mode="after", check_fields=False)
    @classmethod
    def _cuda_graph(cls, value: list[str]) -> list[str]:
        try:
            return list(dict.fromkeys(canonical_cuda_graph(str(v)) for v in value))
        except LayoutError as exc:
            raise ValueError(str(exc).removeprefix("cuda_graph: ")) from None


_VALUE_TYPES: dict[str, Any] = {
    "int": PositiveInt,
    "int0": NonNegativeInt,
    "bool": bool,
    "precision": Literal[PRECISIONS],
    "recompute": str,
    "text": str,
}


def _space_field(axis: Axis) -> tuple[Any, Any]:
    if axis.kind == "choice":  # None (the axis left unset) is its default, never listed by a user
        value: Any = Literal[axis.choices] | None
    else:
        value = _VALUE_TYPES[axis.kind]
    if axis.name == "sp":
        value = Literal["auto"] | bool
    if axis.space_default is None:  # gpus: every GPU of the cluster
        return list[value] | None, Field(None, description=axis.doc)
    return list[value], Field(list(axis.space_default), description=axis.doc)


if TYPE_CHECKING:
    SpaceConfig = _SpaceBase
else:
    SpaceConfig = create_model("SpaceConfig", __base__=_SpaceBase, **{a.name: _space_field(a) for a in SEARCHED})


class SearchConfig(_Strict):
    max_trials: PositiveInt = 40
    parallel: Literal["auto"] | PositiveInt = "auto"
    objective: Literal["tokens_per_s", "tflops_per_gpu"] = "tokens_per_s"
    memory_headroom: float = Field(0.10, ge=0.0, lt=1.0)
    sampler: Literal["auto", "grid", "tpe", "random"] = "auto"
    seed: int = 0
    seeds: list[str] = []  # layouts to run first, in --layout syntax (e.g. a Megatron-Bridge recipe's)
    confirm_top: int = Field(3, ge=0)  # re-run the best candidates; the winner must pass every confirmation
    confirm_steps: PositiveInt | None = None  # None = 2 x training.steps
    # A confirmation run whose steps slow down (its last quarter's median step time over its first quarter's, after
    # warm-up) by more than this factor does not confirm the layout: time that grows with the steps (memory
    # fragmentation, a leak, throttling) is what a longer run would hit.
    confirm_max_step_time_drift: float = Field(1.5, gt=1.0)
    # Routing stress of MoE finalists (issue 17): a confirmation of a layout with EP > 1 ends with this many steps
    # with the router forced onto one expert, then this many onto one EP rank's experts; its peak memory under
    # stress must keep the headroom too. 0: no stress.
    routing_stress_steps: int = Field(2, ge=0)
    wall_time_s: PositiveFloat | None = None
    gpu_hours: PositiveFloat | None = None
    # Stop exploring after this many ended trials without a better stable layout (None: spend the budget).
    patience: PositiveInt | None = None
    # A trial whose TP or ETP group ran across nodes (its placement says so) is not "stable" unless this is true.
    allow_cross_node_tp: bool = False


class BudgetConfig(_Strict):
    """What the production run must train, for the decision section of the report (issue 18): its time and cost on
    the winner and the runners-up."""

    tokens: PositiveFloat  # tokens to train, e.g. 1.0e12
    gpu_hour_usd: PositiveFloat | None = None  # price of one GPU-hour; None: no cost, only time and GPU-hours
    # GPUs of the production run: copies of the trial's layout side by side (data parallel, assumed to scale
    # linearly); None: the trial's own GPU count.
    gpus: PositiveInt | None = None


class TrackingConfig(_Strict):
    mlflow_tracking_uri: str | None = None
    experiment: str | None = None


class SweepConfig(_Strict):
    name: str
    model: ModelSpec
    cluster: ClusterConfig = ClusterConfig()
    training: TrainingConfig = TrainingConfig()
    space: SpaceConfig = SpaceConfig()
    search: SearchConfig = SearchConfig()
    tracking: TrackingConfig = TrackingConfig()
    estimate: EstimatorConstants = EstimatorConstants()
    run: RunSettings = RunSettings()  # run settings that move memory (issue 13): estimator, smoke run, exports
    budget: BudgetConfig | None = None  # the production run's token budget (the report's decision section)
    source: Path | None = None  # the YAML this came from (set by load_config)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value):
            raise ValueError(f"must be letters, digits, '.', '_' or '-' (it names the sweep folder), got {value!r}")
        return value

    @model_validator(mode="after")
    def _fits_cluster(self) -> SweepConfig:
        for i, gpus in enumerate(self.space.values("gpus")):
            if gpus > self.cluster.total_gpus:
                raise FieldError(
                    ("space", "gpus", i),
                    f"{gpus} GPUs requested but the cluster has {self.cluster.nodes} x "
                    f"{self.cluster.gpus_per_node} = {self.cluster.total_gpus}",
                )
        return self

    @model_validator(mode="after")
    def _seeds(self) -> SweepConfig:
        for i, text in enumerate(self.search.seeds):  # a bad seed is bad input: refused before any command runs
            try:
                layout_from_string(self, text)
            except LayoutError as exc:
                raise FieldError(("search", "seeds", i), str(exc).removeprefix("--layout: ")) from None
        return self

    @property
    def world_sizes(self) -> list[int]:
        return sorted(set(self.space.values("gpus") or [self.cluster.total_gpus]))

    @property
    def memory_limit_gib(self) -> float:
        return memory_limit_gib(self.cluster.gpu_memory_gib, self.search.memory_headroom)

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name


class FieldError(ValueError):
    """A cross-field check that knows which field is at fault."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


def layout_from_string(cfg: SweepConfig, text: str) -> Layout:
    """A full Layout from a partial ``--layout`` string: unspecified axes take the space's first value, the world
    size comes from ``gpus=``, or ``dp=`` (W = TP*PP*CP*DP), or else the space's largest world size."""
    given = parse_assignments(text, what="--layout")
    axes: dict[str, Any] = {a.name: cfg.space.values(a.name)[0] for a in SEARCHED if a.name != "gpus"}
    axes["gbs"] = cfg.training.global_batch_size
    axes.update({k: v for k, v in given.items() if k not in ("gpus", "dp", "edp")})
    model_parallel = axes["tp"] * axes["pp"] * axes["cp"]
    if "gpus" in given:
        world = given["gpus"]
    elif "dp" in given:
        world = model_parallel * given["dp"]
    else:
        world = max(cfg.world_sizes)
    if "gpus" in given and "dp" in given and world != model_parallel * given["dp"]:
        raise LayoutError(f"--layout: gpus={world} but tp*pp*cp*dp = {model_parallel * given['dp']}")
    if world > cfg.cluster.total_gpus:
        raise LayoutError(f"--layout: needs {world} GPUs but the cluster has {cfg.cluster.total_gpus}")
    sp = resolve_sp(axes.pop("sp"), axes["tp"])
    layout = with_pipeline_split(Layout(world_size=world, sp=sp, **axes), cfg.model)
    if "edp" in given and given["edp"] != layout.edp:
        raise LayoutError(f"--layout: edp={given['edp']} but W/(etp*ep*pp) = {layout.edp}")
    return layout


def check_address_override(cluster: ClusterConfig, address: str | None) -> None:
    """``--address``: well formed, and not given to a cluster that ``simulate: true`` starts here (UsageError)."""
    if address is None:
        return
    try:
        check_address(address)
    except ValueError as exc:
        raise UsageError(f"--address: {exc}") from None
    if cluster.simulate is True and address != "auto":
        raise UsageError(f"--address: {address!r} cannot be combined with cluster.simulate: true "
                         "(a simulated cluster is started on this machine)")
