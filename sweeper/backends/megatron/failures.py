"""Failure classification: turn whatever a rank raised into (failure_kind, one-line root cause).

The kinds are sweeper.record.schema.FAILURE_KINDS. The smoke run raises the typed errors below for conditions it
detects itself; everything else (Megatron assertions, torch and gloo/NCCL errors) is classified by type, by
message and by the phase of the run it happened in (an assertion while building the model means Megatron
rejected the layout; the same in a collective means communication broke) and by its origin: an exception raised
by sweeper's own code is ``internal`` (a sweeper bug, with its file:line), never a verdict on the layout. While
building, only megatron-core's own validation (an ``assert`` or a ``raise`` in its code) is the layout's; a
Transformer Engine, CUDA or NCCL error there is ``infra`` with the place it was raised.
"""

from __future__ import annotations

import dis
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Literal

Phase = Literal["setup", "init", "build", "steps", "replicas", "checkpoint_save", "checkpoint_load", "stress",
                "report"]


class SmokeFailure(Exception):
    """A failure the smoke run detected itself; ``kind`` is a FAILURE_KINDS entry."""

    kind = "infra"


class UnsupportedError(SmokeFailure):
    kind = "unsupported"


class InvalidLayoutError(SmokeFailure, ValueError):
    """A layout Megatron would reject, detected by the smoke run itself (e.g. GBS not divisible by MBS x DP)."""

    kind = "invalid_layout"


class NonFiniteError(SmokeFailure):
    kind = "nan"


class SimulatedOOMError(SmokeFailure):
    """The rank's resident memory exceeded the simulated GPU memory (CPU backend)."""

    kind = "oom"


class CheckpointError(SmokeFailure):
    kind = "checkpoint_error"


class ReplicaDivergenceError(SmokeFailure):
    """Copies of a replicated parameter differ after the steps (replicas.py): the layout trains several models."""

    kind = "replica_divergence"


# The allocator failures of cuBLAS, cuDNN and the CUDA runtime, which do not say "out of memory" (raised as
# RuntimeError, e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`").
_OOM_MARKERS = ("out of memory", "cannot allocate memory", "std::bad_alloc", "cublas_status_alloc_failed",
                "cudnn_status_alloc_failed", "cudaerrormemoryallocation", "cuda_error_out_of_memory")
_PEER_LOST_MARKERS = ("connection closed by peer", "connection reset", "connection refused", "broken pipe")
_COMM_MARKERS = _PEER_LOST_MARKERS + (
    "gloo", "nccl", "timed out", "timeout", "socket", "rendezvous", "processgroup", "tcpstore",
    "address already in use",
)
# The node's GPU management library refusing a process (NCCL calls NVML while it creates a communicator): the node's
# or the runner's fault, not the layout's and not a lost peer. Seen on an H200 in forked warm ranks (trial/host.py).
_NODE_MARKERS = ("nvmlinit", "gpu access blocked by the operating system", "failed to initialize nvml")
_SHAPE_MARKERS = ("shape", "size mismatch", "must be a multiple", "must be divisible", "divisible by")


def classify(exc: BaseException, phase: Phase) -> tuple[str, str]:
    """(failure_kind, one-line error) for an exception raised in ``phase`` of the smoke run."""
    message = one_line(exc)
    if isinstance(exc, SmokeFailure):
        return exc.kind, message
    low = message.lower()
    origin = sweeper_origin(exc)
    environment = isinstance(exc, (MemoryError, OSError)) or _is_torch_oom(exc) or _is_dist_error(exc)
    if origin is not None and not environment:  # out of memory, a full disk, a lost peer: not a bug wherever raised
        if isinstance(exc, NotImplementedError):
            # sweeper's CPU modules refuse what they do not compute (e.g. an attention variant) this way.
            return "unsupported", f"unsupported on this backend: {message} ({origin})"
        # A bug in sweeper is not a property of the layout: never invalid_layout, never told to Optuna.
        return "internal", f"sweeper bug at {origin}: {type(exc).__name__}: {message}"
    if isinstance(exc, MemoryError) or _is_torch_oom(exc) or any(m in low for m in _OOM_MARKERS):
        return "oom", message
    if any(m in low for m in _NODE_MARKERS):
        return "infra", message
    if phase in ("checkpoint_save", "checkpoint_load"):
        what = f"checkpoint {phase.removeprefix('checkpoint_')} failed: {message}"
        # The collective inside the save or load lost its peer (a rank or node died): collateral, the dead peer
        # is the cause. A checkpoint that times out or fails on its own stays the checkpoint's.
        if any(m in low for m in _PEER_LOST_MARKERS):
            return "comm_error", what
        return "checkpoint_error", what
    if _is_dist_error(exc) or any(m in low for m in _COMM_MARKERS):
        return "comm_error", message
    if phase == "init":
        return "comm_error", message
    if phase == "build":
        return _build_failure(exc, message)
    if phase == "steps" and (isinstance(exc, (AssertionError, ValueError)) or any(m in low for m in _SHAPE_MARKERS)):
        # Some layout rules are only checked at the first forward (e.g. MoE with TP>1 needs sequence parallel).
        return "invalid_layout", message
    return "infra", f"{type(exc).__name__}: {message}" if not message.startswith(type(exc).__name__) else message


def _build_failure(exc: BaseException, message: str) -> tuple[str, str]:
    """Only Megatron's own validation is the layout's: an ``assert`` or a ``raise`` of AssertionError or ValueError
    in megatron-core (TransformerConfig's and ModelParallelConfig's ``__post_init__``, the MoE and pipeline checks
    while building), or a RuntimeError raised by parallel_state's checks of the parallel sizes ("world_size (6) is
    not divisible by 4"). A NotImplementedError raised by megatron-core is a combination it does not implement
    (``unsupported``). Anything else while building (a Transformer Engine, CUDA or NCCL error; torch raising inside
    a call Megatron made) says nothing about the layout: ``infra``, with the error's own line and where it was
    raised."""
    where = raised_at(exc)
    if where is not None and where[2] and where[0].startswith("megatron" + os.sep):
        if isinstance(exc, NotImplementedError):
            return "unsupported", f"not implemented in megatron-core: {message} ({where[0]}:{where[1]})"
        if isinstance(exc, (AssertionError, ValueError)):
            return "invalid_layout", message
        if type(exc) is RuntimeError and where[0] == _PARALLEL_STATE:
            return "invalid_layout", message
    text = message if message.startswith(type(exc).__name__) else f"{type(exc).__name__}: {message}"
    return "infra", f"{text} (raised in {where[0]}:{where[1]})" if where is not None else text


_PARALLEL_STATE = os.path.join("megatron", "core", "parallel_state.py")


def raised_at(exc: BaseException) -> tuple[str, int, bool] | None:
    """(file, line, whether a ``raise`` or ``assert`` statement there raised it) for the innermost Python frame of
    ``exc``'s traceback; the file is relative to the package root it belongs to (``megatron/core/...``,
    ``transformer_engine/...``) where it is an installed package's. A torch function implemented in C raises
    without a frame of its own: the innermost frame is then its caller's, at a call, not a raise statement."""
    innermost = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if (str(Path(code.co_filename).resolve()), code.co_name) not in _PASS_THROUGH:
            innermost = tb
        tb = tb.tb_next
    if innermost is None:
        return None
    code = innermost.tb_frame.f_code
    statement = any(ins.offset == innermost.tb_lasti and ins.opname == "RAISE_VARARGS"
                    for ins in dis.get_instructions(code))
    return _package_relative(code.co_filename), innermost.tb_lineno, statement


def _package_relative(filename: str) -> str:
    path = Path(filename).resolve()
    roots = {_SWEEPER_ROOT.parent, *(Path(p).resolve() for p in sys.path if p)}
    for root in sorted(roots, key=lambda p: len(p.parts), reverse=True):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return str(path)


_SWEEPER_ROOT = Path(__file__).resolve().parents[2]  # the sweeper package
# Frames that only pass a call through (the CUDA-to-CPU device mode wraps every torch call Megatron makes).
_PASS_THROUGH = {(str(_SWEEPER_ROOT / "backends" / "megatron" / "cpu" / "compat.py"), "__torch_function__")}


def sweeper_origin(exc: BaseException) -> str | None:
    """``path:line`` inside sweeper when sweeper's own code raised ``exc``, else None.

    The origin is the innermost frame outside torch (torch raises on behalf of whoever called it: Megatron when
    Megatron passed the shapes, sweeper when sweeper did) and outside pass-through wrappers. An error raised in
    Megatron, Transformer Engine or torch-called-by-Megatron is the layout's (or the library's); one raised in
    sweeper's modules is sweeper's."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    torch_root = _torch_root()
    for frame, line in reversed(frames):
        path = str(Path(frame.f_code.co_filename).resolve())
        if torch_root is not None and path.startswith(torch_root):
            continue
        if (path, frame.f_code.co_name) in _PASS_THROUGH:
            continue
        if path.startswith(str(_SWEEPER_ROOT) + os.sep):
            return f"{Path(path).relative_to(_SWEEPER_ROOT.parent)}:{line}"
        return None
    return None


def _torch_root() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return None
    return str(Path(torch.__file__).resolve().parent) + os.sep


# gloo/c10d messages start with the C++ source location and end with generic advice; neither is the cause.
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_BOILERPLATE = (" This is typically caused by", " Exception raised from")


def one_line(exc: BaseException) -> str:
    """The exception's first meaningful line, without C++ source locations and boilerplate; capped length."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = _SOURCE_LOCATION.sub("", lines[0]) if lines else type(exc).__name__
    for marker in _BOILERPLATE:
        first = first.split(marker)[0]
    if isinstance(exc, AssertionError) and not lines:
        first = "AssertionError (Megatron gave no message)"
    # NCCL's first line is generic ("unhandled system error"); the cause is on the line after its "Last error:".
    last = next((lines[i + 1] for i, line in enumerate(lines[:-1]) if line.rstrip(":") == "Last error"), None)
    if last:
        first = f"{first.rstrip('. ')}; last error: {last}"
    return first if len(first) <= 400 else first[:397] + "..."


def _is_torch_oom(exc: BaseException) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return isinstance(exc, torch.OutOfMemoryError)


def _is_dist_error(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, getattr(dist, "DistError", ()))
