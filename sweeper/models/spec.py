"""ModelSpec: the architecture facts every other part of sweeper reasons about.

One frozen pydantic value describes a decoder-only model the way Megatron-Core builds it: dense GPT with GQA,
MoE (routed + shared experts, first-k dense layers), MLA attention (DeepSeek) and hybrid Mamba/attention/MoE
layer patterns (Nemotron-H). Field names follow Megatron's `TransformerConfig` / `MLATransformerConfig` so a
Megatron user recognises them and the backend can pass them through without translation tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

# Megatron's hybrid_override_pattern symbols (megatron/core/ssm/mamba_hybrid_layer_allocation.py).
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
# DeepSeek-V2/V3's YaRN RoPE (both models' Hugging Face ``rope_scaling``), in MLATransformerConfig's names. ModelSpec
# does not carry RoPE scaling; the smoke run's memory and throughput do not depend on it, the exports state it.
DEEPSEEK_YARN: dict[str, Any] = dict(
    rope_type="yarn", rotary_base=10000, rotary_scaling_factor=40.0, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
)
Block = Literal["mamba", "attention", "mlp", "moe"]


class ModelSpec(BaseModel):
    """A decoder-only model. A plain GPT layer is attention + MLP (dense, or MoE on MoE layers);
    a hybrid model (``hybrid_layer_pattern`` set) has one mixer per layer, as Megatron's MambaModel does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    num_layers: PositiveInt
    hidden_size: PositiveInt
    ffn_hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_query_groups: PositiveInt | None = None  # None = multi-head attention (groups == heads)
    kv_channels: PositiveInt | None = None  # head dim; None = hidden_size // num_attention_heads
    vocab_size: PositiveInt
    max_position_embeddings: PositiveInt = 4096
    untie_embeddings_and_output_weights: bool = True
    gated_linear_unit: bool = True  # SwiGLU: the MLP's first projection is 2 x ffn wide
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"

    # MoE
    num_moe_experts: PositiveInt | None = None
    moe_router_topk: PositiveInt = 2
    moe_ffn_hidden_size: PositiveInt | None = None  # None = ffn_hidden_size
    moe_shared_expert_intermediate_size: PositiveInt | None = None  # total width of all shared experts
    moe_first_k_dense: int = Field(0, ge=0)  # DeepSeek's first_k_dense_replace: the first k layers keep a dense MLP
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: PositiveInt | None = None

    # MLA (DeepSeek-V2/V3)
    multi_latent_attention: bool = False
    q_lora_rank: PositiveInt | None = None  # None = no query compression (V2-Lite)
    kv_lora_rank: PositiveInt = 512
    qk_head_dim: PositiveInt = 128
    qk_pos_emb_head_dim: PositiveInt = 64
    v_head_dim: PositiveInt = 128

    # Multi-token prediction (DeepSeek-V3's num_nextn_predict_layers): MTP layers after the last decoder layer, on
    # the last pipeline stage (an "m" in a pipeline_model_parallel_layout), Megatron's mtp_num_layers.
    mtp_num_layers: int = Field(0, ge=0)

    # Hybrid Mamba (Nemotron-H): one character per layer, M mamba, * attention, - dense MLP, E MoE
    hybrid_layer_pattern: str | None = None
    mamba_num_heads: PositiveInt | None = None
    mamba_head_dim: PositiveInt = 64
    mamba_num_groups: PositiveInt = 8
    mamba_state_dim: PositiveInt = 128
    mamba_conv_kernel: PositiveInt = 4

    # Published sizes, for the catalog's self-check and the user's orientation (not used in arithmetic).
    published_total_params_b: float | None = None
    published_active_params_b: float | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.hybrid_layer_pattern is not None:
            bad = set(self.hybrid_layer_pattern) - {MAMBA, ATTENTION, MLP, MOE}
            if bad:
                raise ValueError(f"hybrid_layer_pattern: unknown symbols {sorted(bad)} (use M, *, -, E)")
            if len(self.hybrid_layer_pattern) != self.num_layers:
                raise ValueError(
                    f"hybrid_layer_pattern has {len(self.hybrid_layer_pattern)} layers, num_layers is {self.num_layers}"
                )
            if MOE in self.hybrid_layer_pattern and self.num_moe_experts is None:
                raise ValueError("hybrid_layer_pattern has MoE layers (E) but num_moe_experts is not set")
        if self.num_moe_experts is not None and self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk ({self.moe_router_topk}) exceeds num_moe_experts ({self.num_moe_experts})"
            )
        if self.multi_latent_attention and self.num_query_groups not in (None, self.num_attention_heads):
            # MLA's linear_kv_up_proj gives every head its own key and value, and megatron-core's Attention takes
            # heads per TP rank from num_query_groups when it is below TP (transformer/attention.py) while its core
            # attention is told num_gqa_groups=num_query_groups (extensions/transformer_engine.py): both assume
            # groups == heads. Found by tests/plan/test_rules_vs_megatron.py (issue 45).
            raise ValueError(
                f"multi_latent_attention: num_query_groups ({self.num_query_groups}) must be unset or equal "
                f"num_attention_heads ({self.num_attention_heads}); MLA has one key and value per head"
            )
        if self.mtp_num_layers and self.hybrid_layer_pattern is not None:
            # megatron-core 0.16's MambaModel builds no MTP block (0.19's hybrid MTP is a pattern of its own).
            raise ValueError("mtp_num_layers: multi-token prediction is modelled for GPT models, not hybrid Mamba ones")
        if self.moe_first_k_dense > self.num_layers:
            raise ValueError(f"moe_first_k_dense ({self.moe_first_k_dense}) exceeds num_layers ({self.num_layers})")
        return self

    # -- derived facts -----------------------------------------------------------------------------------------
    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid_layer_pattern is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def mamba_heads(self) -> int:
        """Mamba2 heads; Megatron's default is expand(2) * hidden / head_dim."""
        return self.mamba_num_heads or 2 * self.hidden_size // self.mamba_head_dim

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> ModelSpec:
        """pydantic copies ``__dict__``, cached properties included: a copy with other fields derives its own."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            for name, attr in vars(type(self)).items():
                if isinstance(attr, cached_property):
                    copy.__dict__.pop(name, None)
        return copy

    @cached_property
    def layer_blocks(self) -> tuple[tuple[Block, ...], ...]:
        """The blocks of each layer, in order. A GPT layer is (attention, mlp) or (attention, moe); a hybrid
        layer is exactly one block (Megatron's MambaModel: M, *, - or E)."""
        if self.hybrid_layer_pattern is not None:
            names: dict[str, Block] = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe"}
            return tuple((names[c],) for c in self.hybrid_layer_pattern)
        dense: tuple[Block, ...] = ("attention", "mlp")
        if not self.is_moe:
            return (dense,) * self.num_layers
        moe: tuple[Block, ...] = ("attention", "moe")
        return (dense,) * self.moe_first_k_dense + (moe,) * (self.num_layers - self.moe_first_k_dense)

    @cached_property
    def block_counts(self) -> dict[Block, int]:
        counts: dict[Block, int] = {}
        for blocks in self.layer_blocks:
            for block in set(blocks):
                counts[block] = counts.get(block, 0) + 1
        return counts

    def count(self, block: Block) -> int:
        """How many layers contain this block."""
        return self.block_counts.get(block, 0)

    @property
    def has_attention(self) -> bool:
        return self.count("attention") > 0
