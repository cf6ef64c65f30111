"""The one device decision of a rank: every tensor sweeper creates on a rank lives on ``rank_device()``.

Megatron keeps what the loss function returns where the model computed it (the rank's CUDA device on a GPU), so a
tensor sweeper makes beside it (a count, a flag) must be made there too: ``torch.stack`` and the collectives
refuse mixed devices.
"""

from __future__ import annotations

import importlib.util

import torch

from sweeper.backends.megatron.failures import SmokeFailure, one_line


def rank_device() -> torch.device:
    """This rank's current CUDA device on a GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def compute_capability() -> tuple[int, int] | None:
    """This rank's CUDA device's compute capability, None on the CPU."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return int(major), int(minor)
    return None


def capability_text(capability: tuple[int, int] | None) -> str | None:
    """``(9, 0)`` as ``"9.0"``, the form the YAML's ``cluster.compute_capability`` and RunSettings take."""
    return None if capability is None else f"{capability[0]}.{capability[1]}"


def device_capability_text() -> str | None:
    """This rank's compute capability as ``"9.0"``, None on the CPU."""
    return capability_text(compute_capability())


class CapabilityMismatchError(SmokeFailure):
    """This rank's GPU is not of the compute capability the YAML declares (``infra``: the configuration's or the
    node's, never the layout's)."""

    kind = "infra"


def check_declared_capability(declared: str, rank: int) -> str | None:
    """This rank's compute capability as ``"9.0"`` (None on the CPU); raises CapabilityMismatchError when it is
    not ``declared`` (``cluster.compute_capability``, which the environment, estimate and exports were made for)."""
    actual = device_capability_text()
    if actual is None:
        return None
    from sweeper.config.capability import capability_mismatch

    problem = capability_mismatch(declared, actual, f"rank {rank}'s GPU ({torch.cuda.get_device_name()})")
    if problem is not None:
        raise CapabilityMismatchError(problem)
    return actual


class TransformerEngineImportError(SmokeFailure):
    """Transformer Engine is installed but does not import on this rank (``infra``: the node's install, not the
    layout). Megatron's layer specs swallow this and would build the local spec on the GPU instead."""

    kind = "infra"


def transformer_engine_present() -> bool:
    """Whether the TE layer spec can run here: False when Transformer Engine is not installed (find_spec, which
    the driver asks too, trial/host.py); raises TransformerEngineImportError when it is but fails to import."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # a broken CUDA/cuDNN library raises OSError, RuntimeError as well (re-raised)
        raise TransformerEngineImportError(
            f"Transformer Engine is installed but does not import on this rank: {one_line(exc)}") from exc
    return True
