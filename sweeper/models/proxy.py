"""Proxy models: a production model shrunk to CPU size with the same layer structure, for CPU trials.

A proxy keeps every fact the layout rules read: the layer count and hybrid pattern, attention heads and query
groups, top-k, shared and first-k-dense layers, the MLA structure (query compression or not), Mamba heads and
groups. Widths shrink (hidden, FFN, expert and shared FFN, head dimensions, MLA ranks, Mamba head and state
dimensions, vocabulary), and each width keeps its divisibility by the parallel sizes and the FP8 GEMM alignment
the rules check: a width becomes the largest power of two dividing it, capped, so ``width % d`` and
``width / tp % 16`` come out the same for every power-of-two TP and ETP up to 8 (16 for the FP8 and 32 for the
MXFP8 alignment). Divisibility by other factors (a TP of 3 or 6) is not kept.

The routed experts shrink the same way, to the largest power of two dividing their count, capped at twice the
largest expert-parallel size the sweep searches (at least 16, 2 x top-k and 4 x the router's groups): every
power-of-two EP of the space divides the proxy's experts exactly when it divides the real model's, and each EP rank
keeps at least two local experts where the real model's do. The Nemotron-3-Nano proxy with EP up to 8 has 16
experts instead of 128: each expert is its own parameters, so the count, not the width, set what the proxy's
build, optimizer step and checkpoint cost on the CPU (issue 31: a one-rank step 5.4 -> 3.1 s).

A proxy trial proves the distributed mechanics of a layout on the real model's structure (process groups,
sharding, pipeline split, expert routing, gradient sync, checkpoint resharding); it says nothing about the real
model's memory or speed, and every report that shows one says so.
"""

from __future__ import annotations

from sweeper.models.spec import ModelSpec

PROXY_SUFFIX = "-proxy"
PROXY_NOTE = ("proxy model (the real model's layer structure at CPU size): it proves each layout's distributed "
              "mechanics, not the real model's memory or speed")
_MAX_POWER_OF_TWO = 256  # FFN widths: divisibility by TP (<= 8) x the 32-element MXFP8 alignment survives
_HIDDEN = 64  # every width the rules check on hidden_size is a divisor of 64 (the MXFP8 alignment is 32)
_HEAD_DIM_CAP = 16  # head dimensions: the fused QKV width (heads + 2 groups) x head_dim % TP survives TP <= 16
_VOCAB = 256
_MIN_EXPERTS = 16  # routed experts: the cap never goes below this (docstring)


def is_proxy(spec: ModelSpec | str) -> bool:
    """Whether a spec (or a recorded model name) is a proxy."""
    return (spec if isinstance(spec, str) else spec.name).endswith(PROXY_SUFFIX)


def proxy(spec: ModelSpec, max_ep: int = 1) -> ModelSpec:
    """The CPU-size proxy of ``spec`` (a proxy's proxy is itself) for a sweep whose largest expert-parallel size
    is ``max_ep``."""
    if is_proxy(spec):
        return spec
    update: dict[str, object] = dict(
        name=spec.name + PROXY_SUFFIX,
        hidden_size=_shrink(spec.hidden_size, cap=_HIDDEN),
        ffn_hidden_size=_shrink(spec.ffn_hidden_size),
        # Counts derived from widths become explicit, so shrinking a width cannot change them.
        kv_channels=_shrink(spec.head_dim, cap=_HEAD_DIM_CAP),
        vocab_size=min(spec.vocab_size, _VOCAB),
        published_total_params_b=None,
        published_active_params_b=None,
    )
    if spec.num_moe_experts is not None:
        update["num_moe_experts"] = proxy_experts(spec, max_ep)
    if spec.moe_ffn_hidden_size is not None:
        update["moe_ffn_hidden_size"] = _shrink(spec.moe_ffn_hidden_size)
    if spec.moe_shared_expert_intermediate_size is not None:
        update["moe_shared_expert_intermediate_size"] = _shrink(spec.moe_shared_expert_intermediate_size)
    if spec.multi_latent_attention:
        update.update(
            q_lora_rank=None if spec.q_lora_rank is None else _shrink(spec.q_lora_rank, cap=32),
            kv_lora_rank=_shrink(spec.kv_lora_rank, cap=32),
            qk_head_dim=_shrink(spec.qk_head_dim, cap=_HEAD_DIM_CAP),
            qk_pos_emb_head_dim=_shrink(spec.qk_pos_emb_head_dim, cap=8),  # RoPE: even
            v_head_dim=_shrink(spec.v_head_dim, cap=_HEAD_DIM_CAP),
        )
    if spec.is_hybrid:
        update.update(
            mamba_num_heads=spec.mamba_heads,
            mamba_head_dim=_shrink(spec.mamba_head_dim, cap=8),
            mamba_state_dim=_shrink(spec.mamba_state_dim, cap=16),
        )
    return ModelSpec.model_validate({**spec.model_dump(), **update})


def proxy_experts(spec: ModelSpec, max_ep: int = 1) -> int | None:
    """The proxy's routed experts: the largest power of two dividing the real count, capped (module docstring)."""
    if spec.num_moe_experts is None:
        return None
    cap = max(_MIN_EXPERTS, 2 * max_ep, 2 * spec.moe_router_topk, 4 * (spec.moe_router_num_groups or 0))
    return _shrink(spec.num_moe_experts, cap=cap)


def power_of_two_part(value: int, cap: int) -> int:
    """The largest power of two dividing ``value``, at most ``cap``."""
    two = 1
    while value % (two * 2) == 0 and two * 2 <= cap:
        two *= 2
    return two


def _shrink(width: int, cap: int = _MAX_POWER_OF_TWO) -> int:
    return power_of_two_part(width, cap)
