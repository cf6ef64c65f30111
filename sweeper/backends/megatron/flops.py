"""Training FLOPs of one global batch, by the accounting Megatron-LM uses for its TFLOP/s figure.

Every GEMM runs three times per step (forward, data gradient, weight gradient) and costs 2 FLOPs per
multiply-add, so a step costs 6 x tokens x (multiply-adds per token in the forward pass). Per layer and token:
the QKV and output projections (GQA: K and V are num_query_groups heads wide), the causal attention products
(QK^T and AV over half the sequence on average: seq x heads x head_dim), the MLP (a gated MLP has three
matrices instead of two) or, on MoE layers, top-k routed experts plus the shared experts; then the output
logits over the padded vocabulary. Router GEMMs, norms and softmax are ignored, as Megatron ignores them.
"""

from __future__ import annotations

from sweeper.models.spec import ModelSpec


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def mlp_macs_per_token(hidden: int, ffn: int, gated: bool) -> int:
    return hidden * ffn * (3 if gated else 2)


def flops_per_global_batch(spec: ModelSpec, seq_length: int, global_batch_size: int, vocab_size: int) -> float:
    """FLOPs of one training step over ``global_batch_size`` sequences of ``seq_length`` tokens (dense GQA + MoE).

    ``vocab_size`` is the (padded) vocabulary the model is built with."""
    if spec.multi_latent_attention or spec.is_hybrid:
        raise NotImplementedError("FLOP count for MLA / hybrid Mamba models is not implemented")
    h = spec.hidden_size
    q_width = spec.num_attention_heads * spec.head_dim
    kv_width = spec.query_groups * spec.head_dim
    attention = h * (q_width + 2 * kv_width) + q_width * h + seq_length * q_width
    dense_mlp = mlp_macs_per_token(h, spec.ffn_hidden_size, spec.gated_linear_unit)
    moe_mlp = 0
    if spec.is_moe:
        moe_mlp = spec.moe_router_topk * mlp_macs_per_token(h, spec.expert_ffn_hidden_size, spec.gated_linear_unit)
        if spec.moe_shared_expert_intermediate_size:
            moe_mlp += mlp_macs_per_token(h, spec.moe_shared_expert_intermediate_size, spec.gated_linear_unit)
    n_moe = spec.count("moe")
    n_dense = spec.num_layers - n_moe
    per_token = spec.num_layers * attention + n_dense * dense_mlp + n_moe * moe_mlp + h * vocab_size
    return 6.0 * global_batch_size * seq_length * per_token
