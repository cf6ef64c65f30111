"""Reading a search YAML: ``load_config`` is the only entry point. It returns a validated ``SweepConfig`` with the
model resolved to a ``ModelSpec``, or raises ``ConfigError`` with one line that names the offending field; and the
``--proxy`` and shipped-space conveniences the commands offer on top of it."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast, get_args

import yaml
from pydantic import ValidationError

from sweeper.config.schema import FieldError, SweepConfig
from sweeper.errors import ConfigError, ModelError, explain_error, field_path
from sweeper.models.catalog import resolve_model
from sweeper.models.proxy import PROXY_SUFFIX, is_proxy, power_of_two_part, proxy
from sweeper.models.spec import ModelSpec

# --proxy: the trials of a proxy sweep are CPU-sized too, and few (docs/getting-started.md, "--proxy").
PROXY_SEQ_LENGTH_CAP = 128
PROXY_GLOBAL_BATCH_CAP = 32
# One training step: after the gate's forward/backward on the reference weights, one optimizer step is what the
# replica check and the checkpoint's bitwise reload need (the update, the gradient sync, the distributed
# optimizer's parameter gather). A proxy proves mechanics and its speed is the CPU's, so a warm-up step before a
# timed one bought nothing but a 16-rank step's 20-40 s per trial (benchmarks/proxy_sweep.py).
PROXY_STEPS = 1
PROXY_MAX_TRIALS = 3
# The proxy sweep's confirmation: its best layout once more (PROXY_CONFIRM_TOP) for two steps, so a second step
# runs from the weights the first one updated and gathered (a step-time drift needs 8 timed steps,
# search/selection.py, and the CPU backend holds none against a layout: a longer run would measure nothing more),
# and one step per routing-stress mode; the whole sweep ends in minutes on two cores (benchmarks/proxy_sweep.py).
PROXY_CONFIRM_TOP = 1
PROXY_CONFIRM_STEPS = 2
PROXY_ROUTING_STRESS_STEPS = 1


def proxy_config(cfg: SweepConfig) -> SweepConfig:
    """The space with its model's CPU-size proxy (models/proxy.py) and CPU-size training: the sequence length and
    global batch become their power-of-two parts (capped), so the layout rules' divisibility checks read the same;
    at most PROXY_STEPS steps, PROXY_MAX_TRIALS trials and a short confirmation. The sweep is named
    ``<name>-proxy``. Its trials run on the fewest ranks that keep each layout's groups (trial/proxy_run.py)."""
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
    s = cfg.search
    search = s.model_copy(update=dict(
        max_trials=min(s.max_trials, PROXY_MAX_TRIALS),
        confirm_top=min(s.confirm_top, PROXY_CONFIRM_TOP),
        confirm_steps=min(s.confirm_steps or 2 * steps, PROXY_CONFIRM_STEPS),
        routing_stress_steps=min(s.routing_stress_steps, PROXY_ROUTING_STRESS_STEPS),
    ))
    name = cfg.name if cfg.name.endswith(PROXY_SUFFIX) else cfg.name + PROXY_SUFFIX
    model = proxy(cfg.model, max_ep=max(cfg.space.values("ep"), default=1))
    return cfg.model_copy(update=dict(name=name, model=model, training=training, search=search))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: ``1e12`` and ``2.5E-3`` are numbers (YAML 1.1, PyYAML's
    default, needs a dot and a signed exponent, so ``budget: {tokens: 1e12}`` would read as the string '1e12')."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

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


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> SweepConfig:
    """Read, validate and resolve a search YAML; raises ConfigError with one line naming the field.

    ``overrides``: ``section.field=value`` items (the CLI's ``--set``) applied over the YAML before validation,
    with OmegaConf's dot-list parsing (``training.steps=4``, ``space.tp=[1,2]``, ``search.sampler=grid``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # _Loader is a SafeLoader
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
        raise ConfigError(
            f"{path}: expected a mapping of sections (name, model, cluster, ...), got {type(data).__name__}")
    if overrides:
        data = _overridden(data, overrides)
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


def _overridden(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with the ``--set`` items merged over it (a ConfigError names the item it cannot apply)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged: Any = OmegaConf.create(data)
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item}: expected section.field=value, e.g. training.steps=4")
        parts, node = key.strip().split("."), cast(Any, data)
        for depth, part in enumerate(parts[:-1]):
            node = node.get(part) if isinstance(node, dict) else None
            if node is not None and not isinstance(node, dict):
                where = ".".join(parts[:depth + 1])
                raise ConfigError(f"--set {item}: {where} is {node!r} in the YAML, not a section with fields")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, ValueError, TypeError) as exc:
            raise ConfigError(f"--set {item}: {str(exc).splitlines()[0]}") from None
    result = OmegaConf.to_container(merged, resolve=False)
    assert isinstance(result, dict)
    return {str(k): v for k, v in result.items()}


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
            return f"{field_path(loc)}: must be a finite number, got {value}"
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
    if isinstance(ctx_error, FieldError):
        return f"{field_path(ctx_error.loc)}: {ctx_error}"
    return f"{field_path(_drop_union_tags(loc))}: {explain_error(err)}"


def _drop_union_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    # pydantic puts the union member it tried into the path (e.g. 'literal['auto']', 'int'); users never wrote it.
    return tuple(p for p in loc
                 if not (isinstance(p, str) and (p in _TYPE_TAGS or p.startswith(("literal[", "function-")))))


_TYPE_TAGS = {"int", "bool", "float", "str", "constrained-int", "constrained-float", "list[constrained-int]"}
