"""Failure classification: turn whatever a rank raised into (failure_kind, one-line root cause).

The kinds are sweeper.record.schema.FAILURE_KINDS. The smoke run raises the typed errors below for conditions it
detects itself; everything else (Megatron assertions, torch and gloo/NCCL errors) is classified by type, by
message and by the phase of the run it happened in (an assertion while building the model means Megatron
rejected the layout; the same in a collective means communication broke) and by its origin: an exception raised
by sweeper's own code is ``internal`` (a sweeper bug, with its file:line), never a verdict on the layout.
"""

from __future__ import annotations

import os
import re
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
    if phase == "build" and isinstance(exc, (AssertionError, ValueError, RuntimeError, TypeError, IndexError)):
        # Megatron validates layouts with asserts and ValueErrors while building config and model.
        return "invalid_layout", message
    if phase == "steps" and (isinstance(exc, (AssertionError, ValueError)) or any(m in low for m in _SHAPE_MARKERS)):
        # Some layout rules are only checked at the first forward (e.g. MoE with TP>1 needs sequence parallel).
        return "invalid_layout", message
    return "infra", f"{type(exc).__name__}: {message}" if not message.startswith(type(exc).__name__) else message


_SWEEPER_ROOT = Path(__file__).resolve().parents[2]  # the sweeper package
# Frames that only pass a call through (the CUDA-to-CPU device mode wraps every torch call Megatron makes).
_PASS_THROUGH = {(str(_SWEEPER_ROOT / "backends" / "megatron" / "cpu_compat.py"), "__torch_function__")}


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
