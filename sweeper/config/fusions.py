"""The kernel fusions a production run turns on, per ``run.framework``: one table that the GPU trial
(``backends/megatron/gpu.py``), the Megatron-LM export and the Bridge export read (issue 44, item 8).

What each framework does, read in the source of the versions sweeper pins:

- Megatron-LM core_v0.16.1 (``megatron/training/arguments.py``): gradient_accumulation_fusion,
  masked_softmax_fusion, bias_dropout_fusion and apply_rope_fusion are ``store_false`` flags (``--no-...``), so on;
  ``core_transformer_config_from_args`` sets persist_layer_norm to ``not --no-persist-layer-norm`` and
  bias_activation_fusion to ``--no-bias-swiglu-fusion``'s value under ``--swiglu``, else ``--no-bias-gelu-fusion``'s;
  ``validate_args`` turns bias-gelu fusion off without linear biases and rope fusion off for position embeddings
  other than rope. cross_entropy_loss_fusion is TransformerConfig's own ``store_true`` flag: off.
- Megatron-Bridge 0.3.1, read the same in 0.4.2, 0.5.1 and 0.6.2 (``models/gpt_provider.py`` GPTModelProvider):
  masked_softmax_fusion and cross_entropy_loss_fusion on, gradient_accumulation_fusion on where apex's
  ``fused_weight_gradient_mlp_cuda`` imports (``utils/fusions.can_enable_gradient_accumulation_fusion``); each model's
  provider sets the rest (Llama's and DeepSeek's bias-activation, bias-dropout and persistent layer norm on, ...), and
  ``provide()`` turns rope fusion off for position embeddings other than rope. sweeper takes Megatron-LM's fusions
  plus the cross-entropy one, and its Bridge export sets each explicitly (``model.<field>``), so the recipe's provider
  runs what the trial ran; gradient_accumulation_fusion is left to Bridge's own probe, which is the trial's (below).
- megatron-core: TransformerConfig's defaults, every fusion off.

Two fusions need a kernel outside megatron-core: gradient_accumulation_fusion apex's ``fused_weight_gradient_mlp_cuda``
(the output layer is megatron-core's ColumnParallelLinear even on the TE spec, and raises without it:
``tensor_parallel/layers.py``), apply_rope_fusion Transformer Engine's fused RoPE (TransformerConfig.__post_init__
raises without it). The GPU trial turns a fusion off where its kernel is missing and notes it (Megatron-LM would
raise there; Bridge turns gradient accumulation fusion off itself). The CPU backend runs none of them
(``backends/megatron/build.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sweeper.models.spec import ModelSpec

# The kernel each fusion needs beyond megatron-core and PyTorch (see the module docstring).
KERNELS: dict[str, str] = {
    "gradient_accumulation_fusion": "apex's fused_weight_gradient_mlp_cuda",
    "apply_rope_fusion": "Transformer Engine's fused RoPE",
}


@dataclass(frozen=True)
class Fusion:
    field: str  # TransformerConfig's
    flag: str  # Megatron-LM's flag that flips its default
    megatron_lm: bool  # on by default in Megatron-LM
    megatron_bridge: bool  # on in sweeper's Bridge runs (module docstring)
    glu_flag: str | None = None  # the flag under --swiglu, where it differs


FUSIONS: tuple[Fusion, ...] = (
    Fusion("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion", True, True),
    Fusion("bias_activation_fusion", "--no-bias-gelu-fusion", True, True, glu_flag="--no-bias-swiglu-fusion"),
    Fusion("masked_softmax_fusion", "--no-masked-softmax-fusion", True, True),
    Fusion("bias_dropout_fusion", "--no-bias-dropout-fusion", True, True),
    Fusion("apply_rope_fusion", "--no-rope-fusion", True, True),
    Fusion("persist_layer_norm", "--no-persist-layer-norm", True, True),
    Fusion("cross_entropy_loss_fusion", "--cross-entropy-loss-fusion", False, True),
)


def _model_allows(field: str, spec: ModelSpec) -> bool:
    """Megatron-LM's validate_args (and Bridge's provide() for rope): bias-gelu fusion needs linear biases (SwiGLU
    fuses without), rope fusion needs rotary position embeddings."""
    if field == "bias_activation_fusion":
        return spec.gated_linear_unit or spec.add_bias_linear
    if field == "apply_rope_fusion":
        return spec.position_embedding_type == "rope"
    return True


def _on(fusion: Fusion, framework: str) -> bool:
    return {"megatron-lm": fusion.megatron_lm, "megatron-bridge": fusion.megatron_bridge}.get(framework, False)


def framework_fusions(framework: str, spec: ModelSpec) -> dict[str, bool]:
    """Every fusion field of TransformerConfig, on or off as ``framework`` runs ``spec``."""
    return {f.field: _on(f, framework) and _model_allows(f.field, spec) for f in FUSIONS}


def megatron_lm_args(fusions: dict[str, bool], spec: ModelSpec) -> list[str]:
    """The Megatron-LM flags that turn its defaults for ``spec`` into ``fusions``."""
    args: list[str] = []
    for fusion in FUSIONS:
        default = framework_fusions("megatron-lm", spec)[fusion.field]
        if fusions[fusion.field] != default:
            args.append(fusion.glu_flag if fusion.glu_flag and spec.gated_linear_unit else fusion.flag)
    return args


def bridge_overrides(fusions: dict[str, bool]) -> list[str]:
    """``model.<field>=<value>`` for every fusion; gradient accumulation fusion only when off (on, Bridge probes for
    its kernel as the trial does)."""
    return [f"model.{field}={str(on).lower()}" for field, on in fusions.items()
            if not (field == "gradient_accumulation_fusion" and on)]
