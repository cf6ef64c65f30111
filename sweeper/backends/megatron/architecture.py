"""TransformerConfig fields of the model architectures beyond a plain GPT, shared by the CPU and the GPU path.

Multi-latent attention (DeepSeek-V2/V3): the MLA widths from the ModelSpec plus DeepSeek's YaRN RoPE. ModelSpec
does not carry RoPE scaling; the values are those of both models' Hugging Face ``rope_scaling`` (the smoke run's
memory and throughput do not depend on them; a ``model: {hf: DIR}`` spec gets the exact ones from
Megatron-Bridge's provider).
"""

from __future__ import annotations

from typing import Any

from sweeper.models.spec import ModelSpec

DEEPSEEK_YARN: dict[str, Any] = dict(
    rope_type="yarn", rotary_base=10000, rotary_scaling_factor=40.0, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
)


def mla_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """MLATransformerConfig's MLA fields for ``spec`` (which must have multi_latent_attention)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_head_dim,
        qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
        v_head_dim=spec.v_head_dim,
        **DEEPSEEK_YARN,
    )
