"""The search YAML: its pydantic schema, its defaults, and one-line errors that name the offending field.

Keys and meanings follow ARCHITECTURE.md exactly; unknown keys are errors (a typo must not silently fall back
to a default on a 16-GPU reservation). ``load_config`` is the only entry point: it returns a validated
``SweepConfig`` with the model resolved to a ``ModelSpec``, or raises ``ConfigError`` with one line.
"""

from __future__ import annotations

import math
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from sweeper.errors import UsageError
from sweeper.config.estimator import EstimatorConstants
from sweeper.space.layout import LayoutError, canonical_recompute
from sweeper.models.proxy import PROXY_SUFFIX, is_proxy, power_of_two_part, proxy
from sweeper.models.spec import ModelSpec
from sweeper.config.run_settings import RunSettings

# gt=0.0 (a float) tells the error formatter to say "greater than 0" rather than "a positive integer".
PositiveFloat = Annotated[float, Field(gt=0.0)]


class ConfigError(UsageError):
    """Bad user input in the search YAML; the message is one line that names the field (exit 2)."""


# What cluster.address and --address accept. A bare host (no port) is refused: Ray has no default GCS port to
# fall back on, and guessing one would send the connection somewhere the user did not name.
ADDRESS_FORMS = "auto, local, HOST:PORT or ray://HOST:PORT"
_ADDRESS = re.compile(r"(?P<scheme>ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252}))"
                      r":(?P<port>[0-9]{1,5})")


def check_address(value: str) -> str:
    """``value`` if it is one of ADDRESS_FORMS; raises ValueError saying what is accepted."""
    if value in ("auto", "local"):
        return value
    match = _ADDRESS.fullmatch(value)
    if match is None or not 1 <= int(match.group("port")) <= 65535:
        raise ValueError(f"must be {ADDRESS_FORMS}, got {value!r}")
    return value


def split_address(value: str) -> tuple[str, int]:
    """Host (without IPv6 brackets) and port of a HOST:PORT or ray://HOST:PORT address checked by check_address."""
    match = _ADDRESS.fullmatch(value)
    if match is None:
        raise ValueError(f"not HOST:PORT: {value!r}")
    return match.group("host").strip("[]"), int(match.group("port"))


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
            raise _FieldError(("cluster", "simulate"), f"true cannot be combined with cluster.address "
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


Axis = list[PositiveInt]


class SpaceConfig(_Strict):
    gpus: Axis | None = None  # None = every GPU of the cluster
    tp: Axis = [1]
    pp: Axis = [1]
    vpp: Axis = [1]
    cp: Axis = [1]
    ep: Axis = [1]
    etp: Axis = [1]
    sp: list[Literal["auto"] | bool] = ["auto"]
    mbs: Axis = [1]
    precision: list[Literal["fp32", "fp16", "bf16", "fp8", "mxfp8"]] = ["bf16"]
    # none | selective | full | selective:<modules>, e.g. selective:moe_act+layernorm (Megatron's recompute modules)
    recompute: list[str] = ["none"]
    distributed_optimizer: list[bool] = [True]

    @field_validator("*", mode="after")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must list at least one value")
        return value

    @field_validator("recompute", mode="after")
    @classmethod
    def _recompute(cls, value: list[str]) -> list[str]:
        try:  # the canonical spelling (a Layout holds the same), duplicates dropped
            return list(dict.fromkeys(canonical_recompute(str(v)) for v in value))
        except LayoutError as exc:
            raise ValueError(str(exc).removeprefix("recompute: ")) from None


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
    wall_time_s: PositiveFloat | None = None
    gpu_hours: PositiveFloat | None = None


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
    source: Path | None = None  # the YAML this came from (set by load_config)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value):
            raise ValueError(f"must be letters, digits, '.', '_' or '-' (it names the sweep folder), got {value!r}")
        return value

    @model_validator(mode="after")
    def _fits_cluster(self) -> SweepConfig:
        for i, gpus in enumerate(self.space.gpus or []):
            if gpus > self.cluster.total_gpus:
                raise _FieldError(
                    ("space", "gpus", i),
                    f"{gpus} GPUs requested but the cluster has {self.cluster.nodes} x "
                    f"{self.cluster.gpus_per_node} = {self.cluster.total_gpus}",
                )
        return self

    @model_validator(mode="after")
    def _seeds(self) -> SweepConfig:
        from sweeper.plan.space import layout_from_string

        for i, text in enumerate(self.search.seeds):  # a bad seed is bad input: refused before any command runs
            try:
                layout_from_string(self, text)
            except LayoutError as exc:
                raise _FieldError(("search", "seeds", i), str(exc).removeprefix("--layout: ")) from None
        return self

    @property
    def world_sizes(self) -> list[int]:
        return sorted(set(self.space.gpus or [self.cluster.total_gpus]))

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name


class _FieldError(ValueError):
    """A cross-field check that knows which field is at fault."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


# --proxy: the trials of a proxy sweep are CPU-sized too, and there are few of them (README: "--proxy").
PROXY_SEQ_LENGTH_CAP = 128
PROXY_GLOBAL_BATCH_CAP = 32
PROXY_STEPS = 3
PROXY_MAX_TRIALS = 4


def proxy_config(cfg: SweepConfig) -> SweepConfig:
    """The space with its model's CPU-size proxy (models/proxy.py) and CPU-size training: the sequence length and
    global batch become their power-of-two parts (capped), so the layout rules' divisibility checks read the same;
    at most PROXY_STEPS steps and PROXY_MAX_TRIALS trials. The sweep is named ``<name>-proxy``."""
    if is_proxy(cfg.model) and cfg.name.endswith(PROXY_SUFFIX):
        return cfg
    t = cfg.training
    steps = min(t.steps, PROXY_STEPS)
    training = t.model_copy(update=dict(
        seq_length=power_of_two_part(t.seq_length, PROXY_SEQ_LENGTH_CAP),
        global_batch_size=power_of_two_part(t.global_batch_size, PROXY_GLOBAL_BATCH_CAP),
        steps=steps,
        warmup_steps=min(t.warmup_steps, steps - 1),
        checkpoint_every=t.checkpoint_every if t.checkpoint_every and t.checkpoint_every < steps else None,
    ))
    search = cfg.search.model_copy(update=dict(max_trials=min(cfg.search.max_trials, PROXY_MAX_TRIALS)))
    name = cfg.name if cfg.name.endswith(PROXY_SUFFIX) else cfg.name + PROXY_SUFFIX
    return cfg.model_copy(update=dict(name=name, model=proxy(cfg.model), training=training, search=search))


SHIPPED_SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


def resolve_space_path(path: str | Path) -> Path:
    """The search YAML a command names: the path itself, or for a bare file name that is not here (``nemotron.yaml``,
    or ``nemotron``) the search space of that name shipped in ``search_spaces/``."""
    path = Path(path)
    if path.is_file() or path.parent != Path("."):
        return path
    for folder in (Path("search_spaces"), SHIPPED_SPACES):
        for candidate in (folder / path.name, folder / f"{path.name}.yaml"):
            if candidate.is_file():
                return candidate
    return path


def load_config(path: str | Path) -> SweepConfig:
    """Read, validate and resolve a search YAML; raises ConfigError with one line naming the field."""
    from sweeper.models.catalog import ModelError, resolve_model

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply to read") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: YAML syntax error{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (name, model, cluster, ...), got {type(data).__name__}")
    if "source" in data:  # set by load_config itself, never read from the YAML
        raise ConfigError(f"{path}: source: unknown key")
    problem = _non_finite(data, ())
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    if "model" not in data:
        raise ConfigError(f"{path}: model: required (a preset name, an inline spec or {{hf_config: path}})")
    problem = _bool_for_number(data["model"])
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    try:
        data = {**data, "model": resolve_model(data["model"], base_dir=path.parent)}
    except ModelError as exc:
        raise ConfigError(f"{path}: model{exc.where}: {exc}") from None
    try:
        return SweepConfig.model_validate({**data, "source": path}, strict=True)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {format_validation_error(exc)}") from None


def _non_finite(data: Any, root: tuple[str | int, ...]) -> str | None:
    """The first .inf / .nan anywhere in the YAML, as ``field: must be a finite number, got inf``.

    Iterative, and each container is visited once: YAML aliases can make a document refer to itself, or expand
    a few lines into billions of nodes.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, root)]
    seen: set[int] = set()
    while stack:
        value, loc = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return f"{_dotted(loc)}: must be a finite number, got {value}"
        if isinstance(value, (dict, list)):
            if id(value) in seen:
                continue
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            children = [(item, (*loc, key if isinstance(key, int) else str(key))) for key, item in items]
            stack.extend(reversed(children))
    return None


def _bool_for_number(model: Any) -> str | None:
    """A YAML true/false given to a numeric field of an inline model (``num_layers: true`` is not 1 layer).

    The model's own schema is lax about this; the rest of the YAML is validated strictly.
    """
    if not isinstance(model, dict):
        return None
    for key, value in model.items():
        field = ModelSpec.model_fields.get(str(key))
        if field is None or not isinstance(value, bool):
            continue
        accepted = set(get_args(field.annotation)) or {field.annotation}
        if bool not in accepted and accepted & {int, float}:
            return f"model.{key}: must be a number, got {value!r}"
    return None


def format_validation_error(exc: ValidationError) -> str:
    """The first error of a pydantic ValidationError as ``space.tp[0]: must be a positive integer, got -2``."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    ctx_error = err.get("ctx", {}).get("error")
    if isinstance(ctx_error, _FieldError):
        return f"{_dotted(ctx_error.loc)}: {ctx_error}"
    return f"{_dotted(_drop_union_tags(loc))}: {_explain(err)}"


def _drop_union_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    # pydantic puts the union member it tried into the path (e.g. 'literal['auto']', 'int'); users never wrote it.
    return tuple(p for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or p.startswith(("literal[", "function-")))))


_TYPE_TAGS = {"int", "bool", "float", "str", "constrained-int", "constrained-float", "list[constrained-int]"}


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def _short_repr(value: Any) -> str:
    # Bounded in depth and length: the value may be a YAML alias that refers to itself or expands enormously.
    return _REPR.repr(value)


def _explain(err: dict[str, Any]) -> str:
    kind, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    got = f", got {_short_repr(value)}"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required"
    if kind == "greater_than" and ctx.get("gt") == 0 and not isinstance(ctx.get("gt"), float):
        return f"must be a positive integer{got}"
    if kind == "greater_than":
        return f"must be greater than {ctx.get('gt')}{got}"
    if kind in ("greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = ctx.get("ge", ctx.get("lt", ctx.get("le")))
        return f"must be {op} {bound}{got}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer{got}"
    if kind in ("float_type", "float_parsing"):
        return f"must be a number{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false{got}"
    if kind in ("string_type",):
        return f"must be a string{got}"
    if kind == "list_type":
        return f"must be a list{got}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping{got}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    message = str(err.get("msg", "invalid"))
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return message[:1].lower() + message[1:]
