"""A linear layer whose whole weight every tensor-parallel rank holds: the local twin of TE's duplicated TELinear.

Multi-latent attention's down projections (``linear_q_down_proj``, ``linear_kv_down_proj``) are Transformer
Engine's ``TELinear(parallel_mode="duplicated")`` in megatron-core's TE layer spec: no communication, the full
weight on every TP rank, its gradient summed over the TP group under sequence parallelism (each rank saw its own
tokens: the weight is marked ``sequence_parallel`` for ``finalize_model_grads``). Megatron's local spec builds them
as ``ColumnParallelLinear`` instead and all-gathers the output; the backward of that gather only splits the
gradient, so the shared rotary key ``k_pos_emb``, which every rank feeds to its own heads only, keeps one rank's
heads' gradient (NVIDIA/Megatron-LM#1699, open): the local spec trains another model under TP (measured: gradient
norm 2.0713 vs 2.11566 for a 2-layer MLA model at TP2). This module gives the CPU path the GPU path's layer.
``cpu.compat`` registers it where ``MLASelfAttention`` looks for ``TELinear``, so Megatron builds it with the
duplicated-mode arguments, exactly as it builds TE's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.parallel_state import get_tensor_model_parallel_group
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class DuplicatedLinear(MegatronModule):
    """``Y = X A^T (+ b)`` with A whole on every TP rank; returns ``(output, bias or None)`` as Megatron's linears.

    Accepts ``TELinear``'s constructor (``parallel_mode`` must be "duplicated", or None as for a plain linear)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None = "duplicated",
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool = False,
        tp_comm_buffer_name: str | None = None,
        is_expert: bool = False,
        tp_group: torch.distributed.ProcessGroup | None = None,
        name: str | None = None,  # the module's dotted name, which megatron-core 0.19 passes to every layer
    ) -> None:
        super().__init__(config=config)
        if parallel_mode not in ("duplicated", None):
            raise NotImplementedError(f"DuplicatedLinear is not {parallel_mode}-parallel")
        if skip_weight_param_allocation or is_expert:
            raise NotImplementedError("DuplicatedLinear holds its own weight and is not an expert layer")
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp_group or get_tensor_model_parallel_group()
        # As _initialize_affine_weight_cpu draws a column-parallel weight: the full fp32 master from the global
        # generator, then cast. Every TP rank draws the same numbers, and the draws that follow stay in step.
        master = torch.empty(output_size, input_size, dtype=torch.float32)
        init_method(master)
        self.weight = torch.nn.Parameter(master.to(config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        for param in self.parameters():
            # Reduced over data parallelism like any dense weight; over TP too under SP (finalize_model_grads),
            # where each TP rank's gradient covers only its part of the sequence (TELinear sets the same).
            param.allreduce = True
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> Any:
        """Replicated over TP (no axis is sharded), as TELinear's duplicated mode saves it."""
        state_dict = self.state_dict(prefix="", keep_vars=True)
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        # Without the caller's data-parallel group, both groups come from parallel_state (Megatron's fallback).
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, None, sharded_offsets, tp_group=self.tp_group if dp_cp_group else None,
            dp_cp_group=dp_cp_group,
        )
