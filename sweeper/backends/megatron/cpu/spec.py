"""Adapt Megatron's local (pure torch) GPT block spec so that context and sequence parallelism run without TE.

The local spec's ``DotProductAttention`` refuses CP and its ``WrappedTorchNorm`` refuses SP. ``adapt_local_block_spec``
returns a copy of the block spec in which, only where the layout needs it, core attention becomes
``ContextParallelDotProductAttention`` (cp > 1) or, for multi-latent attention, ``LatentDotProductAttention`` (K and V
of different widths), and every torch norm becomes ``SequenceParallelTorchNorm`` (sequence_parallel). Multi-latent
attention's down projections become ``DuplicatedLinear``, the layer TE's spec uses there (the local spec's
column-parallel ones drop part of the rotary key's gradient under TP: cpu/linear.py). A MoE layer's
``SequentialMLP`` becomes ``GroupedSequentialMLP`` (the same experts and checkpoint, one batched matmul per
projection instead of a loop over the experts: cpu/experts.py). Everything else — and the whole spec when CP is 1,
SP off and the model neither MLA nor MoE — stays Megatron's own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from sweeper.backends.megatron.cpu.attention import ContextParallelDotProductAttention, LatentDotProductAttention
from sweeper.backends.megatron.cpu.experts import GroupedSequentialMLP
from sweeper.backends.megatron.cpu.linear import DuplicatedLinear
from sweeper.backends.megatron.cpu.norm import SequenceParallelTorchNorm
from sweeper.backends.megatron.cpu.patches import dotted, record


def adapt_local_block_spec(block_spec: Any, config: TransformerConfig) -> Any:
    """The block spec with CP attention and SP norms swapped in where the config needs them (a copy)."""
    swaps: dict[type, type] = {}
    if config.num_moe_experts:
        swaps[SequentialMLP] = GroupedSequentialMLP
    if config.multi_latent_attention:
        # MLA's core attention has K and V of different widths (MLA with CP is refused: rules.py).
        swaps[DotProductAttention] = LatentDotProductAttention
    elif config.context_parallel_size > 1:
        swaps[DotProductAttention] = ContextParallelDotProductAttention
    if config.sequence_parallel:
        swaps[WrappedTorchNorm] = SequenceParallelTorchNorm
    for original, stand_in in swaps.items():
        record(dotted(original), stand_in)
    if not swaps:
        return block_spec
    # A copy: Megatron's spec builders may hand out shared spec objects (one MoE layer spec for every layer).
    return _swap(copy.deepcopy(block_spec), swaps)


def _swap(node: Any, swaps: dict[type, type]) -> Any:
    if isinstance(node, type):
        return swaps.get(node, node)
    if isinstance(node, MLASelfAttentionSubmodules):
        # TE's spec: duplicated down projections (a column-parallel one is elsewhere in the spec, so not a swap).
        node.linear_q_down_proj = node.linear_kv_down_proj = DuplicatedLinear
        record(dotted(MLASelfAttentionSubmodules), DuplicatedLinear)
    if isinstance(node, list):
        return [_swap(item, swaps) for item in node]
    if isinstance(node, functools.partial):
        # From megatron-core 0.19 a spec may be functools.partial(<module class>, submodules=...).
        func = _swap(node.func, swaps)
        args = tuple(_swap(arg, swaps) for arg in node.args)
        keywords = {key: _swap(value, swaps) for key, value in node.keywords.items()}
        return functools.partial(func, *args, **keywords)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            swapped = _swap(value, swaps)
            if swapped is not value:
                setattr(node, field.name, swapped)
    return node
