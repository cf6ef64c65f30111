"""Proof of placement, rank side: the global ranks of every Megatron process group this rank belongs to, read from
the groups megatron-core itself built (parallel_state), and the GPU this rank ran on. The runner joins them with
the node each rank ran on into the trial's ``placement`` (trial/aggregate.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

# Group kind -> megatron-core's getter for this rank's group of that kind (DP without CP, as Megatron's "DP").
GROUP_GETTERS: dict[str, Callable[[], Any]] = {
    "tp": lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False),
    "pp": lambda: parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
    "cp": lambda: parallel_state.get_context_parallel_group(check_initialized=False),
    "dp": lambda: parallel_state.get_data_parallel_group(with_context_parallel=False),
    "ep": lambda: parallel_state.get_expert_model_parallel_group(check_initialized=False),
    "etp": lambda: parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
    "edp": lambda: parallel_state.get_expert_data_parallel_group(check_initialized=False),
}


def process_groups() -> dict[str, list[int]]:
    """Kind -> the global ranks of this rank's group, for every kind megatron-core built a group of."""
    out: dict[str, list[int]] = {}
    for kind, getter in GROUP_GETTERS.items():
        group = getter()
        if group is not None:
            out[kind] = sorted(dist.get_process_group_ranks(group))
    return out


def gpu_index() -> str:
    """The GPU this rank ran on as the node numbers it: its entry of CUDA_VISIBLE_DEVICES (Ray sets it per actor;
    simulated clusters give fake ids), else LOCAL_RANK."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[local % len(visible)] if visible else str(local)
