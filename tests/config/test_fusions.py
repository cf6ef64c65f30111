"""Kernel fusions per framework (issue 44, item 8): the one table the GPU trial and both exports read."""

from __future__ import annotations

from sweeper.config.fusions import FUSIONS, bridge_overrides, framework_fusions, megatron_lm_args
from sweeper.models.catalog import preset

ALL = {f.field for f in FUSIONS}


def test_megatron_lm_turns_on_its_store_false_fusions_and_bridge_the_cross_entropy_one_too() -> None:
    llama = preset("llama3-8b")  # SwiGLU, RoPE, no linear biases
    lm = framework_fusions("megatron-lm", llama)
    assert {k for k, on in lm.items() if on} == ALL - {"cross_entropy_loss_fusion"}
    assert framework_fusions("megatron-bridge", llama) == {**lm, "cross_entropy_loss_fusion": True}
    assert set(framework_fusions("megatron-core", llama).values()) == {False}  # TransformerConfig's defaults


def test_the_model_turns_off_what_megatron_lm_turns_off() -> None:
    """validate_args: bias-gelu fusion off without linear biases, rope fusion off without RoPE."""
    gelu = preset("llama3-8b").model_copy(update={"gated_linear_unit": False, "add_bias_linear": False,
                                                  "position_embedding_type": "learned_absolute"})
    fusions = framework_fusions("megatron-lm", gelu)
    assert fusions["bias_activation_fusion"] is False and fusions["apply_rope_fusion"] is False
    assert megatron_lm_args(fusions, gelu) == []  # Megatron-LM's own defaults for this model
    biased = gelu.model_copy(update={"add_bias_linear": True})
    assert framework_fusions("megatron-lm", biased)["bias_activation_fusion"] is True


def test_the_megatron_lm_flags_flip_only_its_defaults() -> None:
    llama = preset("llama3-8b")
    assert megatron_lm_args(framework_fusions("megatron-lm", llama), llama) == []
    assert megatron_lm_args(framework_fusions("megatron-bridge", llama), llama) == ["--cross-entropy-loss-fusion"]
    assert megatron_lm_args(framework_fusions("megatron-core", llama), llama) == [
        "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]
    gelu = llama.model_copy(update={"gated_linear_unit": False, "add_bias_linear": True})
    assert "--no-bias-gelu-fusion" in megatron_lm_args(framework_fusions("megatron-core", gelu), gelu)


def test_bridge_gets_every_fusion_but_leaves_gradient_accumulation_to_its_kernel_probe() -> None:
    llama = preset("llama3-8b")
    on = bridge_overrides(framework_fusions("megatron-bridge", llama))
    assert "model.cross_entropy_loss_fusion=true" in on and "model.apply_rope_fusion=true" in on
    assert not any(item.startswith("model.gradient_accumulation_fusion") for item in on)
    off = bridge_overrides(framework_fusions("megatron-core", llama))
    assert len(off) == len(FUSIONS) and all(item.endswith("=false") for item in off)
