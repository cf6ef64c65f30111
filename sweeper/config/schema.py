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
    # use_attribute_docstrings: each field's docstring is its description (docs/search-yaml.md, docs/schemas/).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


class ClusterConfig(_Strict):
    """The cluster the sweep runs on (or simulates)."""

    nodes: PositiveInt = 1
    """Nodes of the cluster."""
    gpus_per_node: PositiveInt = 8
    """GPUs per node."""
    gpu_memory_gib: PositiveFloat = 80.0
    """Memory of one GPU in GiB, what the stability limit is a share of (search.memory_headroom)."""
    compute_capability: str = "9.0"
    """The GPUs' CUDA compute capability ("9.0" H100/H200, "10.0" B200, "12.0" RTX PRO 6000): which precisions
    and FP8 recipes the rules allow."""
    gpu_kind: str | None = None
    """The GPU model the estimator prices (h100, h200, b200, rtx-pro-6000, ...; docs/search-yaml.md lists them);
    null: inferred from the compute capability."""
    address: str = "auto"
    """The Ray cluster: auto (the one running, found as ray.init(address="auto") finds it, else a simulated or a
    local one), local (a new local Ray), HOST:PORT or ray://HOST:PORT."""
    simulate: Literal["auto"] | bool = "auto"
    """Start a simulated cluster of `nodes` x `gpus_per_node` virtual GPUs on this machine (CPU ranks on gloo):
    true, false, or auto (when no GPU is visible and no Ray cluster answers)."""
    connect_timeout_s: PositiveFloat = 10.0
    """Seconds a Ray address gets to answer (TCP connect, then the GCS's reply) before the command gives up."""
    intra_node_bandwidth_gbs: PositiveFloat = 50.0
    """GB/s per GPU inside a node, for the step-time estimate (PCIe 5 x16 ~50; NVLink 4 ~450)."""
    inter_node_bandwidth_gbs: PositiveFloat = 25.0
    """GB/s per GPU between nodes (a 200 Gb/s NIC ~25)."""
    host_link_gbs: PositiveFloat = 25.0
    """GB/s per GPU between its memory and the host's, what activation offload copies over (PCIe 5 x16: ~50 raw per
    direction, ~25 with the NICs and other GPUs sharing a PCIe switch; GH200's NVLink-C2C ~450)."""
    warm_ranks: bool | None = None
    """Keep one rank process per GPU for the whole sweep (megatron imported once, each trial's rank a fresh fork of
    it); false: new rank actors in a placement group of each trial's own; null: true on a simulated cluster, false
    on GPUs (forked GPU ranks failed NCCL's NVML start on the first GPU run: docs/support-matrix.md)."""
    host_memory_gib: PositiveFloat | None = None
    """Each node's host memory in GiB, which a checkpoint save is held against; null: what the node reports (a
    simulated cluster's nodes share this machine, so each gets its share)."""

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


# Which trials' checkpoints stay on disk (training.keep_checkpoints, issue 43).
KeepCheckpoints = Literal["none", "winner", "all"]


class TrainingConfig(_Strict):
    """The production run's shape, and the smoke run's length."""

    seq_length: PositiveInt = 4096
    """Tokens per sequence (Megatron's --seq-length)."""
    global_batch_size: PositiveInt = 64
    """Sequences per step of the production run (--global-batch-size) on its GPUs (``budget.gpus``, else the
    cluster's): a trial of W GPUs runs its share, the batch over the copies of its layout the production run holds
    (gbs x W / N), so each data-parallel rank runs the production run's micro-batches (issue 43)."""
    steps: PositiveInt = 20
    """Training steps of an exploration trial (a confirmation runs search.confirm_steps)."""
    checkpoint: bool = True
    """Save a torch_dist checkpoint in every trial and read it back (bitwise)."""
    checkpoint_every: PositiveInt | None = None
    """Also save every this many steps; null: one save, after the last step."""
    keep_checkpoints: KeepCheckpoints = "none"
    """Which trials' checkpoints stay on disk (issue 43): none: each trial deletes its own after the bitwise reload;
    winner: trials keep theirs and the sweep deletes all but the winner's at its end; all: every trial's. The
    sweep's equivalence reference (reference/) is never deleted."""
    trial_timeout_s: PositiveFloat = 900.0
    """Seconds one trial may take, start-up included; then every rank's stack is dumped and the trial is a timeout."""
    warmup_steps: int = Field(2, ge=0)
    """First steps whose time is left out of the throughput."""
    data_paths: list[str] = []
    """Files every node must see (doctor checks them); trials train on synthetic tokens."""
    tokenizer_path: str | None = None
    """The production run's tokenizer, checked by doctor and written into the launch script."""

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
    """How the sweep searches and what it calls best."""

    max_trials: PositiveInt = 40
    """Exploration trials to launch at most (confirmations come on top)."""
    parallel: Literal["auto"] | PositiveInt = "auto"
    """Trials running at once at most; auto: as many as the free GPUs hold."""
    objective: Literal["tokens_per_s", "tflops_per_gpu"] = "tokens_per_s"
    """What the fastest layout maximises."""
    memory_headroom: float = Field(0.10, ge=0.0, lt=1.0)
    """Share of each GPU's memory a stable layout leaves free (its peak stays under (1 - headroom) x
    cluster.gpu_memory_gib)."""
    sampler: Literal["auto", "ranked", "grid", "tpe", "random"] = "auto"
    """How layouts are proposed; auto: every launchable layout when the budget covers them all, else ranked (the
    calibrated estimator's order, refitted after every measured trial, with a share of exploring turns; issue 54);
    tpe: Optuna's TPE with the refit model's turns (the default before issue 54)."""
    seed: int = 0
    """The sampler's seed."""
    seeds: list[str] = []
    """Layouts to run first, in --layout syntax (e.g. a Megatron-Bridge recipe's)."""
    confirm_top: int = Field(3, ge=0)
    """Best candidates re-run to confirm them; the winner must pass every confirmation (0: no confirmation)."""
    confirm_steps: PositiveInt | None = None
    """Steps of a confirmation run; null: twice training.steps."""
    confirm_alone: bool | None = None
    """A confirmation runs with no other trial of the sweep on its nodes (none starts there while it runs), so the
    throughput that decides is not shared with neighbours' links, NICs and filesystem traffic; null: on GPU clusters
    yes, on a simulated one no (its nodes are one machine)."""
    confirm_max_step_time_drift: float = Field(1.5, gt=1.0)
    """A confirmation whose last quarter of steps took more than this many times its first quarter (after warm-up)
    does not confirm the layout: time that grows with the steps (fragmentation, a leak, throttling) is what a long
    run would hit."""
    confirm_max_step_time_p90: float = Field(1.25, gt=1.0)
    """A confirmation whose timed steps' 90th percentile is more than this many times their median does not confirm
    the layout: it stalls (allocator retries near the memory limit, MoE imbalance spikes), and a production run pays
    every stall. A GPU's steps spread by a few percent; one step in four taking 1.25x or more is a stall, not noise.
    Explored trials record it (``step_time_p90_s``) without failing on it."""
    confirm_at_scale: bool = True
    """The winner's last confirmation runs its production layout itself (its copies side by side as one run of N
    GPUs, the production batch) where the cluster alive can hold N, else at the largest data parallelism it can hold;
    that run's measurement is the winner's figure (none of its step projected at N), and a layout that fails at
    scale does not win (issue 53). false: the figure is projected from the trials' size."""
    routing_stress_steps: int = Field(2, ge=0)
    """A confirmation of a MoE layout with EP > 1 ends with this many steps routing every token to one expert, then
    this many to one EP rank's experts; its peak memory under stress must keep the headroom too (0: none)."""
    wall_time_s: PositiveFloat | None = None
    """Stop launching after this many seconds of sweep; null: no limit."""
    gpu_hours: PositiveFloat | None = None
    """Stop launching after the trials held this many GPU-hours; null: no limit."""
    patience: PositiveInt | None = None
    """Stop exploring after this many ended trials without a better stable layout; null: spend the budget."""
    allow_cross_node_tp: bool = False
    """Let a layout whose TP or ETP group ran across nodes be stable (its placement is always recorded)."""
    require_equivalence: bool = True
    """A trial is stable only if it ran against the equivalence reference (the gate); false: when the reference
    could not be made, trials run without the gate may still be stable (the console and report say so)."""


class BudgetConfig(_Strict):
    """What the production run must train, for the decision section of the report (issue 18): its time and cost on
    the winner and the runners-up."""

    tokens: PositiveFloat
    """Tokens to train, e.g. 1e12."""
    gpu_hour_usd: PositiveFloat | None = None
    """Price of one GPU-hour in USD; null: time and GPU-hours only."""
    gpus: PositiveInt | None = None
    """GPUs of the production run: copies of the trial's layout side by side (data parallel); every layout is
    compared as this run (the objective, issue 43); null: the cluster's GPUs (nodes x gpus_per_node)."""


class TrackingConfig(_Strict):
    """Where MLflow records the sweep."""

    mlflow_tracking_uri: str | None = None
    """An MLflow tracking URI (http://HOST:PORT, sqlite:///path.db, a folder); null: MLflow's default
    (MLFLOW_TRACKING_URI, else mlflow.db in the working directory)."""
    experiment: str | None = None
    """The MLflow experiment; null: the sweep's name."""
    connect_timeout_s: PositiveFloat = 10.0
    """Seconds an http(s) tracking server gets to accept a connection before the command gives up (before any
    trial). Credentials come from MLflow's own environment variables (MLFLOW_TRACKING_TOKEN, ...), never the YAML."""


class SweepConfig(_Strict):
    name: str
    """Names the sweep: its folder sweeps/<name>/ and its MLflow experiment."""
    model: ModelSpec
    """A preset name, {preset: NAME, proxy: true, <field>: <override>}, {hf_config: path/to/config.json} or an
    inline spec."""
    cluster: ClusterConfig = ClusterConfig()
    """The cluster."""
    training: TrainingConfig = TrainingConfig()
    """The run's shape and the smoke run's length."""
    space: SpaceConfig = SpaceConfig()
    """The values each axis tries."""
    search: SearchConfig = SearchConfig()
    """The search and its budget."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow."""
    estimate: EstimatorConstants = EstimatorConstants()
    """The estimator's constants, each overridable."""
    run: RunSettings = RunSettings()
    """Run settings that move memory: read by the estimator, built by the smoke run, written into the exports."""
    budget: BudgetConfig | None = None
    """The production run's token budget, for the report's decision (time and cost to train)."""
    source: Path | None = None
    """Set by sweeper: the YAML this came from."""

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
    def production_gpus(self) -> int:
        """N: the production run's GPUs (``budget.gpus``, else the cluster's)."""
        if self.budget is not None and self.budget.gpus is not None:
            return self.budget.gpus
        return self.cluster.total_gpus

    def copies(self, world_size: int) -> int:
        """How many copies of a layout of ``world_size`` GPUs the production run holds side by side (0: none)."""
        return self.production_gpus // world_size

    def trial_global_batch(self, world_size: int) -> int:
        """The global batch a trial of ``world_size`` GPUs runs: the production run's over the copies of its layout
        (gbs x W / N), so every data-parallel rank runs as many micro-batches as in production. Rounded down where
        it does not split (``production_batch_reason`` refuses those layouts); the whole batch for a layout the
        production run cannot hold."""
        gbs, k = self.training.global_batch_size, self.copies(world_size)
        return max(1, gbs // k) if k else gbs

    def production_layout(self, layout: Layout) -> Layout | None:
        """The layout as the production run runs it: ``copies`` times the data parallelism, each data-parallel rank
        with the trial's micro-batches: the global batch scaled alike, which is the production run's when the trial
        ran its share of it (``trial_global_batch``); None when the production run holds no copy."""
        k = self.copies(layout.world_size)
        return scaled_layout(layout, k) if k else None

    def at_scale_layouts(self, layout: Layout) -> list[Layout]:
        """The layout on more GPUs as the production run scales it, largest first: the production layout, then
        fewer copies side by side (each data-parallel rank with the trial's micro-batches); empty when the
        production run holds at most one copy."""
        return [scaled_layout(layout, k) for k in range(self.copies(layout.world_size), 1, -1)]

    def production_batch_reason(self, world_size: int) -> str | None:
        """Why layouts of ``world_size`` GPUs cannot run the production batch in equal shares, or None."""
        gbs, k = self.training.global_batch_size, self.copies(world_size)
        if not k:  # issue 53: it was launched (first, in exhaustive order) though nothing of it could be chosen
            return (f"the layout needs {world_size} GPUs, more than the production run's {self.production_gpus} "
                    "(budget.gpus): no copy of it runs in production")
        if gbs % k:
            return (f"global_batch_size ({gbs}) on the production run's {self.production_gpus} GPUs does not split "
                    f"over the {k} copies of a {world_size}-GPU layout: its trial would not run the production "
                    f"run's micro-batches")
        return None

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
    axes.setdefault("gbs", cfg.trial_global_batch(world))
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


def scaled_layout(layout: Layout, copies: int) -> Layout:
    """``copies`` of ``layout`` side by side as one run: the data parallelism and the global batch times as many."""
    return layout.resized(layout.world_size * copies, layout.gbs * copies)
