"""Exact parameter counts of a ModelSpec, per block and per model-parallel shard, as Megatron-Core builds them.

Every count mirrors the modules Megatron-Core 0.16 instantiates (``SelfAttention``/``MLASelfAttention``, ``MLP``,
``MoELayer`` with ``TopKRouter`` + experts + ``SharedExpertMLP``, ``MambaMixer``, ``LanguageModelEmbedding``, the
output layer and the final norm), including the per-TP-rank split Megatron applies (column/row parallel linears
divide one dimension by TP; norms, routers and row-parallel biases are replicated). The estimator turns these
shard counts into bytes per rank; ``total_params``/``active_params`` give the numbers people publish.

Conventions (so the published numbers can be compared honestly):
- the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * TP`` as Megatron does;
- the "local" (non-Transformer-Engine) spec splits MLA's down projections over TP while the TE spec keeps them
  whole (``TELinear(parallel_mode="duplicated")``); ``local_spec`` selects which one to mirror.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from sweeper.models.spec import Block, ModelSpec

# Megatron-LM's --make-vocab-size-divisible-by default: the vocabulary is padded to a multiple of this times TP.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


@dataclass(frozen=True)
class ShardParams:
    """Parameters of one block (or model part) held by one rank.

    ``dense`` is replicated across the data-parallel group (sharded by the distributed optimizer over DP*CP);
    ``expert`` belongs to routed experts (sharded over the expert-data-parallel group)."""

    dense: int = 0
    expert: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert

    def __add__(self, other: ShardParams) -> ShardParams:
        return ShardParams(self.dense + other.dense, self.expert + other.expert)

    def scaled(self, n: int) -> ShardParams:
        return ShardParams(self.dense * n, self.expert * n)


def padded_vocab_size(spec: ModelSpec, tp: int = 1) -> int:
    """Megatron's padded vocabulary (``_vocab_size_with_padding``)."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-spec.vocab_size // multiple) * multiple


def norm_params(spec: ModelSpec, width: int) -> int:
    """RMSNorm has a weight; LayerNorm a weight and a bias."""
    return width * (1 if spec.normalization == "RMSNorm" else 2)


def _split(width: int, parts: int) -> int:
    """A dimension split over ``parts`` ranks; Megatron asserts divisibility (the rules check it before launch)."""
    if width % parts:
        raise ValueError(f"dimension {width} is not divisible by {parts}")
    return width // parts


def attention_params(spec: ModelSpec, tp: int = 1, local_spec: bool = False) -> int:
    """One attention block on one TP rank, with its input norm."""
    h = spec.hidden_size
    n = norm_params(spec, h)  # input_layernorm (fused into the QKV linear with TE; same count)
    if spec.multi_latent_attention:
        heads = spec.num_attention_heads
        q_head = spec.qk_head_dim + spec.qk_pos_emb_head_dim
        # TE keeps the down projections whole on every TP rank; the local spec's ColumnParallelLinear splits them.
        down_parts = tp if local_spec else 1
        if spec.q_lora_rank is None:
            n += h * _split(heads * q_head, tp)
        else:
            n += h * _split(spec.q_lora_rank, down_parts)
            n += spec.q_lora_rank * _split(heads * q_head, tp)
            if spec.qk_layernorm:
                n += norm_params(spec, spec.q_lora_rank)
        n += h * _split(spec.kv_lora_rank + spec.qk_pos_emb_head_dim, down_parts)
        n += spec.kv_lora_rank * _split(heads * (spec.qk_head_dim + spec.v_head_dim), tp)
        if spec.qk_layernorm:
            n += norm_params(spec, spec.kv_lora_rank)
        n += _split(heads * spec.v_head_dim, tp) * h
        if spec.add_bias_linear:
            n += h  # row-parallel bias is replicated
        return n
    d = spec.head_dim
    qkv = _split(spec.num_attention_heads * d + 2 * spec.query_groups * d, tp)
    n += h * qkv
    if spec.add_bias_linear or spec.add_qkv_bias:
        n += qkv
    if spec.qk_layernorm:
        n += 2 * norm_params(spec, d)  # q_layernorm and k_layernorm over one head's width
    n += _split(spec.num_attention_heads * d, tp) * h
    if spec.add_bias_linear:
        n += h
    return n


def _mlp(spec: ModelSpec, ffn: int, parts: int) -> int:
    """fc1 (2*ffn wide when gated) + fc2 of one MLP split over ``parts`` ranks, without the norm."""
    h = spec.hidden_size
    fc1 = _split(ffn * (2 if spec.gated_linear_unit else 1), parts)
    n = h * fc1 + _split(ffn, parts) * h
    if spec.add_bias_linear:
        n += fc1 + h
    return n


def mlp_params(spec: ModelSpec, tp: int = 1) -> int:
    """One dense MLP block on one TP rank, with its pre-MLP norm."""
    return norm_params(spec, spec.hidden_size) + _mlp(spec, spec.ffn_hidden_size, tp)


def moe_params(spec: ModelSpec, tp: int = 1, ep: int = 1, etp: int = 1) -> ShardParams:
    """One MoE block on one rank: norm + router + shared expert are dense (shared expert split by TP);
    the routed experts are spread over EP and each split over ETP."""
    assert spec.num_moe_experts is not None, "moe_params on a dense model"
    h = spec.hidden_size
    dense = norm_params(spec, h) + spec.num_moe_experts * h  # pre-MLP norm + router weight (replicated)
    if spec.moe_shared_expert_intermediate_size:
        dense += _mlp(spec, spec.moe_shared_expert_intermediate_size, tp)
    local_experts = _split(spec.num_moe_experts, ep)
    expert = local_experts * _mlp(spec, spec.expert_ffn_hidden_size, etp)
    return ShardParams(dense=dense, expert=expert)


def mamba_params(spec: ModelSpec, tp: int = 1) -> int:
    """One Mamba2 mixer layer on one TP rank (``MambaMixer``), with its input norm."""
    h = spec.hidden_size
    heads, groups, state = spec.mamba_heads, spec.mamba_num_groups, spec.mamba_state_dim
    d_inner = heads * spec.mamba_head_dim
    n = norm_params(spec, h)  # layer norm fused into in_proj with TE
    n += h * _split(2 * d_inner + 2 * groups * state + heads, tp)  # in_proj -> z, x, B, C, dt (no bias)
    conv_dim = _split(d_inner + 2 * groups * state, tp)  # depthwise conv over x, B, C
    n += conv_dim * spec.mamba_conv_kernel + conv_dim  # conv1d weight [conv_dim, 1, k] + bias
    n += 3 * _split(heads, tp)  # dt_bias, A_log, D (one per head)
    n += _split(d_inner, tp)  # gated RMSNorm weight
    n += _split(d_inner, tp) * h  # out_proj (no bias)
    return n


def block_params(
    spec: ModelSpec, block: Block, tp: int = 1, ep: int = 1, etp: int = 1, local_spec: bool = False
) -> ShardParams:
    """Parameters of one block on one rank."""
    if block == "attention":
        return ShardParams(dense=attention_params(spec, tp, local_spec))
    if block == "mlp":
        return ShardParams(dense=mlp_params(spec, tp))
    if block == "moe":
        return moe_params(spec, tp, ep, etp)
    return ShardParams(dense=mamba_params(spec, tp))


def embedding_params(spec: ModelSpec, tp: int = 1) -> int:
    """Word embedding (vocab split over TP) plus learned absolute positions (replicated), on the first stage."""
    n = padded_vocab_size(spec, tp) // tp * spec.hidden_size
    if spec.position_embedding_type == "learned_absolute":
        n += spec.max_position_embeddings * spec.hidden_size
    return n


def output_params(spec: ModelSpec, tp: int = 1, pp: int = 1) -> int:
    """Final norm + output layer on the last stage. A tied output layer is the embedding itself when one
    stage holds both, and a separate copy (kept in sync by the embedding group) when PP > 1."""
    n = norm_params(spec, spec.hidden_size)
    if spec.untie_embeddings_and_output_weights or pp > 1:
        n += padded_vocab_size(spec, tp) // tp * spec.hidden_size
    return n


@lru_cache(maxsize=4096)
def layer_params(
    spec: ModelSpec, layer: int, tp: int = 1, ep: int = 1, etp: int = 1, local_spec: bool = False
) -> ShardParams:
    """All blocks of one decoder layer (0-based) on one rank."""
    out = ShardParams()
    for block in spec.layer_blocks[layer]:
        out = out + block_params(spec, block, tp, ep, etp, local_spec)
    return out


def mtp_extra_params(spec: ModelSpec, tp: int = 1) -> int:
    """What each multi-token-prediction layer holds besides its transformer layer (multi_token_prediction.py): the
    norms of the embedding and of the hidden state (enorm, hnorm), eh_proj (2h -> h, column-parallel) and its final
    norm. Its output layer is the model's; the stage it sits on also builds an embedding copy when it is not the
    first (``output_params``' rule for a tied output layer, applied to the embedding)."""
    h = spec.hidden_size
    return 3 * norm_params(spec, h) + _split(2 * h, 1) * _split(h, tp)


def total_params(spec: ModelSpec) -> int:
    """Every parameter of the unsharded model (vocabulary padded for TP=1; a tied output layer counted once)."""
    n = embedding_params(spec) + output_params(spec)
    return n + sum(layer_params(spec, i).total for i in range(spec.num_layers))


def active_params(spec: ModelSpec, include_input_embedding: bool = True) -> int:
    """Parameters one token touches: everything dense, the shared experts and ``moe_router_topk`` routed experts.

    ``include_input_embedding=False`` drops the word/position embedding table (a lookup, not a matmul), the
    convention NVIDIA and DeepSeek use for their "active" figures; the output layer is always counted."""
    n = total_params(spec)
    if spec.num_moe_experts is not None:
        per_expert = _mlp(spec, spec.expert_ffn_hidden_size, 1)
        n -= spec.count("moe") * (spec.num_moe_experts - spec.moe_router_topk) * per_expert
    if not include_input_embedding:
        n -= embedding_params(spec)
        if not spec.untie_embeddings_and_output_weights:
            n += padded_vocab_size(spec) * spec.hidden_size  # tied: the table is still the output layer
    return n
