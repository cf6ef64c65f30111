"""The declared compute capability (``cluster.compute_capability``) against the one a GPU reports.

The environment, the estimate and the exports are made for the declared capability, while a GPU rank picks its FP8
recipe and whether FP8 parameters apply from its device (backends/megatron/gpu.py): when the two differ, a trial
measures another run than the one exported. ``doctor`` says so per node before any trial, and every GPU rank
fails its trial with the same line (``infra``: the YAML's or the node's, never the layout's).
"""

from __future__ import annotations


def capability_mismatch(declared: str, actual: str | None, where: str) -> str | None:
    """One line when ``actual`` (what ``where`` reports, e.g. "rank 3's GPU (NVIDIA H100)") differs from
    ``declared``; None when they agree or nothing was reported (no GPU, a probe that could not tell)."""
    if actual is None or _parts(actual) == _parts(declared):
        return None
    return (f"cluster.compute_capability is {declared} but {where} is {actual}: the trial would pick its FP8 recipe "
            f"for {actual} while the environment, estimate and exports are made for {declared} "
            f"(set cluster.compute_capability: \"{actual}\")")


def _parts(capability: str) -> tuple[int, ...] | str:
    try:
        return tuple(int(part) for part in capability.strip().split("."))
    except ValueError:
        return capability.strip()
