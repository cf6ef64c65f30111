"""Sequence-parallel norms for Megatron's local (pure torch) layer spec, used where Transformer Engine is absent.

Megatron's ``WrappedTorchNorm`` asserts "sequence parallel not supported by torch LayerNorm", although nothing in a
norm depends on which tokens a rank holds: with sequence parallelism each tensor-parallel rank normalises its own
slice of the sequence with the same (replicated) weights, so each rank's weight gradient covers only its tokens and
the TP ranks' gradients must be *summed*. Megatron does that sum in ``finalize_model_grads``
(``_allreduce_non_tensor_model_parallel_grads``) for every parameter marked ``sequence_parallel=True`` — the mark
Transformer Engine's norms set. ``SequenceParallelTorchNorm`` builds the same torch LayerNorm/RMSNorm as
``WrappedTorchNorm`` and sets that mark.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class SequenceParallelTorchNorm:
    """A torch ``LayerNorm``/``RMSNorm`` (as Megatron's ``WrappedTorchNorm`` makes) whose parameters carry
    ``sequence_parallel = config.sequence_parallel``, so their gradients are summed over the TP group."""

    def __new__(  # type: ignore[misc]
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        # The same refusals as WrappedTorchNorm, except sequence parallel.
        if config.layernorm_zero_centered_gamma:
            raise NotImplementedError("zero_centered_gamma not supported by torch LayerNorm")
        if config.persist_layer_norm:
            raise NotImplementedError("persist_layer_norm not supported by torch LayerNorm")
        if config.memory_efficient_layer_norm:
            raise NotImplementedError("memory_efficient_layer_norm not supported by torch LayerNorm")
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise NotImplementedError(f"normalization {config.normalization!r} has no sequence-parallel torch norm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm
