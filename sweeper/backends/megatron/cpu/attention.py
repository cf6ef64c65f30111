"""Context-parallel core attention for Megatron's local (pure torch) layer spec, used where TE is absent.

Megatron's local ``DotProductAttention`` refuses context parallelism (only TE implements it). This module does
what CP attention must compute, in the plainest way that runs under gloo: every CP rank all-gathers the keys and
values of the whole sequence (backward reduce-scatters their gradients, Megatron's own
``gather_from_sequence_parallel_region`` on the CP group), puts them back in sequence order, and attends with its
local queries under the causal mask of their *global* positions. The batch is split the way Megatron's
``get_batch_on_this_cp_rank`` splits it: the sequence in 2*CP chunks, CP rank i holding chunks i and 2*CP-1-i.
The arithmetic is the local attention's (scaled scores, masked fill with -10000, softmax in fp32 where Megatron
does it, then probabilities times values), so it equals non-CP attention for this rank's query positions.
It costs the full sequence's K/V memory on every rank (no ring overlap): a functional stand-in for validating
layouts, not a fast kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

_MASKED = -10000.0  # what Megatron's attention_mask_func fills in; exp() of it is 0 in fp32


def load_balanced_positions(seq_local: int, cp_size: int, cp_rank: int, device: torch.device | None = None
                            ) -> torch.Tensor:
    """Global sequence positions of the ``seq_local`` tokens CP rank ``cp_rank`` holds (chunks r and 2*CP-1-r)."""
    chunk = divide(seq_local, 2)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def to_sequence_order(gathered: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[CP*2c, ...] gathered in CP-rank order (each rank's chunks r, 2CP-1-r) -> [2CP*c, ...] in sequence order."""
    # Rank r's two chunks are gathered at slots 2r and 2r+1; global chunk g lives in slot 2g (g < CP) or
    # slot 2(2CP-1-g)+1 (g >= CP).
    chunks = gathered.chunk(2 * cp_size, dim=0)
    order = [2 * g if g < cp_size else 2 * (2 * cp_size - 1 - g) + 1 for g in range(2 * cp_size)]
    return torch.cat([chunks[slot] for slot in order], dim=0)


class ContextParallelDotProductAttention(MegatronModule):
    """Drop-in for the local spec's ``core_attention`` with context_parallel_size > 1 (causal self-attention).

    Same constructor and forward signature as Megatron's ``DotProductAttention``; query [sq, b, np, hn] and
    key/value [sq, b, ng, hn] hold this CP rank's load-balanced chunks; output [sq, b, np*hn].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        # Refuse what this module does not compute rather than compute something else.
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"CPU context-parallel attention supports causal masks only, not "
                                      f"{attn_mask_type.name}")
        if config.window_size is not None:
            raise NotImplementedError("CPU context-parallel attention does not support sliding-window attention")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"CPU context-parallel attention does not support softmax_type "
                                      f"{config.softmax_type!r}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:
            # Megatron divides the scale by the layer number and multiplies the fp32 scores back by it.
            self.softmax_scale /= self.layer_number
        self.softmax_in_fp32 = config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("CPU context-parallel attention supports neither packed sequences nor "
                                      "attention bias")
        if attention_mask is not None:
            # A given mask covers the local query rows but would have to be gathered for the keys; the smoke run
            # never passes one (the causal mask is implied).
            raise NotImplementedError("CPU context-parallel attention builds the causal mask itself; an explicit "
                                      "attention_mask is not supported")
        cp_size = self.cp_group.size()
        cp_rank = self.cp_group.rank()
        seq_local, batch, heads, head_dim = query.shape
        groups = key.size(2)

        # [sq, b, ng, hn] of this rank -> [s, b, ng, hn] of the whole sequence; backward reduce-scatters.
        key = to_sequence_order(
            tensor_parallel.gather_from_sequence_parallel_region(key, True, group=self.cp_group), cp_size)
        value = to_sequence_order(
            tensor_parallel.gather_from_sequence_parallel_region(value, True, group=self.cp_group), cp_size)
        if heads > groups:  # GQA: each group's K/V serves heads/groups query heads (Megatron's head order)
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        seq = key.size(0)

        # [b*np, sq, hn] x [b*np, hn, s] -> [b*np, sq, s]
        q = query.reshape(seq_local, batch * heads, head_dim).transpose(0, 1)
        k = key.reshape(seq, batch * heads, head_dim).transpose(0, 1)
        scores = torch.baddbmm(
            torch.empty(batch * heads, seq_local, seq, dtype=query.dtype, device=query.device),
            q, k.transpose(1, 2), beta=0.0, alpha=self.softmax_scale,
        ).view(batch, heads, seq_local, seq)

        q_pos = load_balanced_positions(seq_local, cp_size, cp_rank, device=query.device)
        k_pos = torch.arange(seq, device=query.device)
        future = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).view(1, 1, seq_local, seq)
        dtype = scores.dtype
        if self.softmax_in_fp32 and dtype != torch.float32:
            scores = scores.float()
        if self.config.apply_query_key_layer_scaling:
            scores = scores * self.layer_number
        probs = torch.softmax(scores.masked_fill(future, _MASKED), dim=-1).to(dtype)
        if self.config.sequence_parallel:
            probs = self.attention_dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)

        # [b*np, sq, s] x [b*np, s, hn] -> [b, np, sq, hn] -> [sq, b, np*hn]
        v = value.reshape(seq, batch * heads, head_dim).transpose(0, 1)
        context = torch.bmm(probs.view(batch * heads, seq_local, seq), v)
        context = context.view(batch, heads, seq_local, head_dim).permute(2, 0, 1, 3).contiguous()
        return context.view(seq_local, batch, heads * head_dim)


class LatentDotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` with the key and value head widths of multi-latent attention.

    ``MLASelfAttention`` builds its core attention with ``k_channels`` (qk_head_dim + qk_pos_emb_head_dim) and
    ``v_channels`` (v_head_dim), which only Transformer Engine's attention accepts. The local attention's
    arithmetic already works per tensor (scores from Q and K of one width, context from V of another); only the
    output width, heads x v_channels instead of heads x kv_channels, has to follow V. MLA passes its own
    softmax scale (YaRN's mscale over sqrt(q_head_dim)).
    """

    def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
