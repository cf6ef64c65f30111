"""The model architectures beyond a plain GPT, shared by the CPU and the GPU path: TransformerConfig fields and,
for hybrid Mamba models, the MambaModel builder (the stack spec is the path's own: TE or local modules).

Multi-latent attention (DeepSeek-V2/V3): the MLA widths from the ModelSpec plus DeepSeek's YaRN RoPE. ModelSpec
does not carry RoPE scaling; the values are those of both models' Hugging Face ``rope_scaling`` (the smoke run's
memory and throughput do not depend on them; a ``model: {hf: DIR}`` spec gets the exact ones from
Megatron-Bridge's provider).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from sweeper.backends.megatron.failures import InvalidLayoutError
from sweeper.models.spec import DEEPSEEK_YARN, ModelSpec


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


def mamba_config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """TransformerConfig's hybrid Mamba fields for ``spec`` (which must have a hybrid_layer_pattern)."""
    return dict(
        is_hybrid_model=True,
        mamba_num_heads=spec.mamba_heads,
        mamba_head_dim=spec.mamba_head_dim,
        mamba_num_groups=spec.mamba_num_groups,
        mamba_state_dim=spec.mamba_state_dim,
    )


def mamba_model_builder(spec: ModelSpec, stack_spec: Any) -> Callable[..., Any]:
    """A callable with GPTModel's keyword arguments that builds one MambaModel chunk from ``stack_spec`` (TE's
    mamba_stack_spec on a GPU, cpu.mamba.local_mamba_stack_spec on the CPU), with the spec's conv kernel width."""

    def mamba_chunk(*, config: Any, vocab_size: int, max_sequence_length: int, pre_process: bool,
                    post_process: bool, share_embeddings_and_output_weights: bool, position_embedding_type: str,
                    vp_stage: int | None = None, transformer_layer_spec: Any = None, **_: Any) -> Any:
        from megatron.core.activations import squared_relu
        from megatron.core.models.mamba import MambaModel

        if vp_stage is not None:
            raise InvalidLayoutError("hybrid Mamba models do not support virtual pipeline stages in megatron-core "
                                     "0.16")
        if not spec.gated_linear_unit:
            config.activation_func = squared_relu  # Nemotron-H's relu2 MLPs (ModelSpec has no activation field)
        stack = stack_spec
        if spec.mamba_conv_kernel != 4:
            stack = copy.deepcopy(stack_spec)
            mixer = stack.submodules.mamba_layer.submodules.mixer
            mixer.params = {**(mixer.params or {}), "d_conv": spec.mamba_conv_kernel}
        return MambaModel(
            config=config,
            mamba_stack_spec=stack,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            hybrid_override_pattern=spec.hybrid_layer_pattern,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
        )

    return mamba_chunk
