"""The errors sweeper reports to its user, and the exit code each one ends a command with.

Every error a user can cause or fix (bad input, an unreachable cluster) is a :class:`SweeperError`: its message is
one line, and it carries the exit code. Library modules raise these; only ``sweeper.cli`` turns them into a line on
stderr and an exit status, so no library module imports the command line. Anything else that escapes a command is
a sweeper bug and keeps its traceback.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class SweeperError(Exception):
    """An error for the user: a one-line message and the exit code of the command that hit it."""

    exit_code: int = EXIT_FAILED

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(SweeperError, ValueError):
    """Bad input (a YAML field, a command-line argument, an environment variable): exit 2, nothing written."""

    exit_code = EXIT_USAGE


class ClusterError(SweeperError, RuntimeError):
    """The cluster cannot be reached or does not match what the configuration asks for: exit 1.

    Not bad input as such: the same address may answer once the cluster is up.
    """

    exit_code = EXIT_FAILED


class TrackingError(SweeperError, RuntimeError):
    """The MLflow tracking server cannot be reached or refuses the sweep: exit 1, before any trial runs (like an
    unreachable cluster, it may answer later)."""

    exit_code = EXIT_FAILED


class ConfigError(UsageError):
    """Bad user input in the search YAML; the message is one line that names the field (exit 2)."""


class ModelError(UsageError):
    """A model (preset name, inline spec or HF config.json) that cannot be read; ``where`` is the key path inside
    ``model`` (e.g. ``.num_layers``), so the YAML loader can name the field."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


class LayoutError(UsageError):
    """A layout string or value that cannot describe any layout (bad key, bad number): exit 2."""


# -- one-line messages for pydantic validation errors (the YAML schema, inline model specs) ------------------------
def field_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the user wrote it: ``space.tp[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def _short_repr(value: Any) -> str:
    # Bounded in depth and length: the value may be a YAML alias that refers to itself or expands enormously.
    return _REPR.repr(value)


def explain_error(err: Mapping[str, Any]) -> str:
    """One pydantic error (``ValidationError.errors()`` item) as a phrase: ``must be a positive integer, got -2``."""
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
