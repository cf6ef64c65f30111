"""Model specs: parameter counts of the presets against their published sizes, and HF config.json import.

Tolerance: 3%. Published totals are rounded to 3 significant figures (0.3% at most); "active" figures are
rounded to 2 (e.g. "3.3B": up to 1.5%), and vendors differ on whether the input embedding counts as active.
So each preset's active figure is compared with the convention its publisher uses (documented per preset).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sweeper.errors import ModelError
from sweeper.models.catalog import PRESETS, preset
from sweeper.models.hf import spec_from_hf_config
from sweeper.models.params import active_params, padded_vocab_size, total_params

TOLERANCE = 0.03

# Whether the publisher's "active parameters" include the input embedding table.
#  - nemotron-3-nano: NVIDIA's model card: "31.6B total, ~3.6B active including embeddings" (3.2B without);
#    the catalog records 3.6, so compare with embeddings (3.58B computed; 3.23B without).
#  - deepseek-v2-lite: "2.4B activated" (DeepSeek-V2 paper, Table of V2-Lite); computed 2.66B with the
#    input embedding and 2.45B without -> DeepSeek counts without it.
#  - qwen3-30b-a3b "3.3B activated", mixtral-8x7b "12.9B active": both include embeddings (3.35B / 12.88B).
ACTIVE_INCLUDES_INPUT_EMBEDDING = {
    "nemotron-3-nano-30b-a3b": True,
    "deepseek-v2-lite": False,
    "deepseek-v3": False,  # "37B activated" (DeepSeek-V3 report): computed 36.6B without, 37.6B with
    "llama3-8b": True,
    "qwen3-30b-a3b": True,
    "mixtral-8x7b": True,
    "llama3.1-405b": True,
}
PUBLISHED = [name for name, spec in PRESETS.items() if spec.published_total_params_b is not None]


@pytest.mark.parametrize("name", PUBLISHED)
def test_total_params_match_published(name: str) -> None:
    spec = PRESETS[name]
    assert spec.published_total_params_b is not None
    assert total_params(spec) / 1e9 == pytest.approx(spec.published_total_params_b, rel=TOLERANCE)


@pytest.mark.parametrize("name", PUBLISHED)
def test_active_params_match_published(name: str) -> None:
    spec = PRESETS[name]
    assert spec.published_active_params_b is not None
    active = active_params(spec, include_input_embedding=ACTIVE_INCLUDES_INPUT_EMBEDDING[name])
    assert active / 1e9 == pytest.approx(spec.published_active_params_b, rel=TOLERANCE)


def test_exact_counts_of_known_models() -> None:
    # Llama-3-8B: 8,030,261,248 parameters (the HF checkpoint's safetensors total).
    assert total_params(PRESETS["llama3-8b"]) == 8_030_261_248
    # Llama-3.1-405B: 405,853,388,800 (HF safetensors total).
    assert total_params(PRESETS["llama3.1-405b"]) == 405_853_388_800
    # Mixtral-8x7B: 46,702,792,704 (HF safetensors total).
    assert total_params(PRESETS["mixtral-8x7b"]) == 46_702_792_704


def test_vocab_padding_follows_megatron() -> None:
    spec = PRESETS["tiny-gpt"].model_copy(update={"vocab_size": 50257})
    assert padded_vocab_size(spec, 1) == 50304
    assert padded_vocab_size(spec, 8) == 51200


def test_dense_model_active_equals_total() -> None:
    assert active_params(PRESETS["llama3-8b"]) == total_params(PRESETS["llama3-8b"])


# -- HF config.json import -------------------------------------------------------------------------------------------
LLAMA3_8B_HF: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}


def _write(tmp_path: Path, data: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_llama3_8b_reproduces_the_preset(tmp_path: Path) -> None:
    spec = spec_from_hf_config(_write(tmp_path, LLAMA3_8B_HF), name="llama3-8b")
    preset = PRESETS["llama3-8b"]
    fields = set(type(preset).model_fields) - {"published_total_params_b", "published_active_params_b"}
    assert {f: getattr(spec, f) for f in fields} == {f: getattr(preset, f) for f in fields}


def test_directory_path_reads_its_config_json(tmp_path: Path) -> None:
    _write(tmp_path, LLAMA3_8B_HF)
    assert spec_from_hf_config(tmp_path).num_layers == 32


def test_qwen2_has_qkv_bias_and_qwen3_qk_norm(tmp_path: Path) -> None:
    small = dict(LLAMA3_8B_HF, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000)
    assert spec_from_hf_config(_write(tmp_path, dict(small, model_type="qwen2"))).add_qkv_bias
    q3 = spec_from_hf_config(_write(tmp_path, dict(small, model_type="qwen3", head_dim=128)))
    assert q3.qk_layernorm and q3.kv_channels == 128
    mistral = spec_from_hf_config(_write(tmp_path, dict(small, model_type="mistral", head_dim=64)))
    assert mistral.kv_channels is None  # head_dim equal to hidden/heads is Megatron's default


def test_mixtral_and_qwen3_moe(tmp_path: Path) -> None:
    base = dict(LLAMA3_8B_HF, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=1000)
    mix = spec_from_hf_config(_write(tmp_path, dict(base, model_type="mixtral", num_local_experts=8,
                                                    num_experts_per_tok=2)))
    assert (mix.num_moe_experts, mix.moe_router_topk, mix.expert_ffn_hidden_size) == (8, 2, 256)
    q = spec_from_hf_config(_write(tmp_path, dict(base, model_type="qwen3_moe", num_experts=16,
                                                  num_experts_per_tok=4, moe_intermediate_size=64)))
    assert (q.num_moe_experts, q.moe_router_topk, q.moe_ffn_hidden_size, q.qk_layernorm) == (16, 4, 64, True)


DEEPSEEK_V2_LITE_HF: dict[str, Any] = {
    "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 102400, "max_position_embeddings": 163840, "tie_word_embeddings": False, "n_group": 1,
}


def test_deepseek_v2_lite_matches_the_preset_counts(tmp_path: Path) -> None:
    spec = spec_from_hf_config(_write(tmp_path, DEEPSEEK_V2_LITE_HF))
    assert spec.multi_latent_attention and spec.q_lora_rank is None
    assert spec.moe_shared_expert_intermediate_size == 2 * 1408
    assert total_params(spec) == total_params(PRESETS["deepseek-v2-lite"])


def test_nemotron_h_pattern_or_block_list(tmp_path: Path) -> None:
    cfg = {
        "model_type": "nemotron_h", "hidden_size": 2688, "intermediate_size": 1856, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 262144,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
        "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "mlp_hidden_act": "relu2",
        "tie_word_embeddings": False,
    }
    spec = spec_from_hf_config(_write(tmp_path, cfg))
    assert total_params(spec) == total_params(PRESETS["nemotron-3-nano-30b-a3b"])
    names = {"M": "mamba", "E": "moe", "*": "attention"}
    listed = dict(cfg, layers_block_type=[names[c] for c in cfg["hybrid_override_pattern"]])
    del listed["hybrid_override_pattern"]
    assert spec_from_hf_config(_write(tmp_path, listed)).hybrid_layer_pattern == cfg["hybrid_override_pattern"]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        spec_from_hf_config(tmp_path / "nope.json")


def test_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not valid JSON"):
        spec_from_hf_config(_write(tmp_path, "{not json"))


def test_unsupported_model_type(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="unsupported model_type 'gpt2'") as err:
        spec_from_hf_config(_write(tmp_path, {"model_type": "gpt2"}))
    assert err.value.where == ".model_type"


def test_missing_key_is_named(tmp_path: Path) -> None:
    broken = {k: v for k, v in LLAMA3_8B_HF.items() if k != "num_hidden_layers"}
    with pytest.raises(ModelError, match="num_hidden_layers") as err:
        spec_from_hf_config(_write(tmp_path, broken))
    assert err.value.where == ".num_hidden_layers"


def test_resolve_model_accepts_hf_config(tmp_path: Path) -> None:
    from sweeper.models.catalog import resolve_model

    _write(tmp_path, LLAMA3_8B_HF)
    spec = resolve_model({"hf_config": "config.json", "name": "mine"}, base_dir=tmp_path)
    assert spec.name == "mine" and spec.num_layers == 32


def test_a_copy_with_other_fields_derives_its_own_layer_blocks() -> None:
    moe = preset("deepseek-v2-lite")
    assert moe.count("moe") == 26  # layer_blocks is cached on the preset now
    dense = moe.model_copy(update=dict(num_moe_experts=None, moe_router_topk=None, moe_ffn_hidden_size=None,
                                       moe_shared_expert_intermediate_size=None))
    assert dense.count("moe") == 0 and dense.count("mlp") == dense.num_layers


def test_mla_query_groups_are_the_heads() -> None:
    """MLA has one key and value per head: num_query_groups may be unset or the head count, nothing else (issue 45;
    heads 2, groups 1 passed the rules at TP2 and Megatron refused the build)."""
    from pydantic import ValidationError

    from sweeper.models.spec import ModelSpec

    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=100,
                multi_latent_attention=True)
    assert ModelSpec(**base).query_groups == 2
    assert ModelSpec(**base, num_query_groups=2).query_groups == 2
    with pytest.raises(ValidationError, match="MLA has one key and value per head"):
        ModelSpec(**base, num_query_groups=1)
