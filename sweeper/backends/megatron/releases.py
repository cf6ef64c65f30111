"""What differs between the megatron-core releases sweeper runs (0.16.1 to 0.19.x), in one place: the trial code
calls these instead of branching on the version where it uses megatron-core.

Each difference names the release that made it. The CPU stand-ins' patches have their own table
(cpu/patches.py), checked against the installed release by tests/backends/test_cpu_patches.py.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from packaging.version import Version

if TYPE_CHECKING:
    import torch

# Multi-latent attention without a query LoRA normalises the query in a fused norm+linear q_proj when qk_layernorm is
# on (transformer/mla_qk_norm_config.py); 0.16.1 had no query norm there. Checked on 0.19.2, not on 0.17/0.18.
MLA_Q_NORM_FUSED = Version("0.17")


def batch_on_this_cp_rank(batch: dict[str, Any]) -> dict[str, Any]:
    """``megatron.core.utils.get_batch_on_this_cp_rank`` for a pretraining batch (no packed sequences): the sequence
    in 2*CP chunks, CP rank i keeping chunks i and 2*CP-1-i. From 0.19 the function also asks whether hybrid CP is
    on (it is not: sweeper's CP is the layout's one group)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        # 0.19 splits over the group it is given, the whole world without one (0.16 asked parallel_state itself).
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                         cp_group=parallel_state.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)


def expert_mlp_classes() -> tuple[type[torch.nn.Module], ...]:
    """megatron-core's expert MLP modules of this release: SequentialMLP and TEGroupedMLP, and up to 0.16 the legacy
    GroupedMLP (removed by 0.19). A class megatron-core leaves a MagicMock without its package is left out."""
    from megatron.core.transformer.moe import experts

    names = ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")
    return tuple(cls for name in names if isinstance(cls := getattr(experts, name, None), type))
