"""Import a local Hugging Face ``config.json`` as a ModelSpec (no download, no transformers import).

Each supported ``model_type`` maps its HF keys onto Megatron-Core's names, the way Megatron-Bridge's providers do:
llama / mistral / qwen2 / qwen3 (dense GQA, Qwen2 with QKV bias, Qwen3 with QK-norm), mixtral / qwen3_moe (MoE),
deepseek_v2 / deepseek_v3 (MLA + MoE with shared experts and first-k dense layers) and nemotron_h (hybrid
Mamba2 / attention / MoE by pattern). Anything missing or malformed raises ``ModelError`` naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sweeper.errors import ModelError
from sweeper.models.spec import ATTENTION, MAMBA, MLP, MOE, ModelSpec

_MISSING = object()


class _Config:
    """The parsed JSON with key access that fails with a ModelError naming the key."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        self.data = data
        self.path = path

    def req(self, key: str) -> Any:
        value = self.data.get(key, _MISSING)
        if value is _MISSING or value is None:
            raise ModelError(f"{self.path}: missing key '{key}' required for model_type "
                             f"'{self.data.get('model_type')}'", where=f".{key}")
        return value

    def opt(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value


def _gqa_fields(c: _Config, num_layers: int | None = None) -> dict[str, Any]:
    """Fields every Llama-like decoder shares (``num_layers`` when the layer count comes from elsewhere)."""
    heads = int(c.req("num_attention_heads"))
    hidden = int(c.req("hidden_size"))
    head_dim = c.opt("head_dim")
    out: dict[str, Any] = dict(
        num_layers=int(c.req("num_hidden_layers")) if num_layers is None else num_layers,
        hidden_size=hidden,
        ffn_hidden_size=int(c.req("intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=int(c.opt("num_key_value_heads", heads)),
        vocab_size=int(c.req("vocab_size")),
        max_position_embeddings=int(c.opt("max_position_embeddings", 4096)),
        untie_embeddings_and_output_weights=not bool(c.opt("tie_word_embeddings", False)),
        add_qkv_bias=bool(c.opt("attention_bias", False)),
        add_bias_linear=bool(c.opt("mlp_bias", False)),
    )
    # Megatron's kv_channels defaults to hidden/heads; only an explicit, different head_dim needs setting.
    if head_dim is not None and int(head_dim) != hidden // heads:
        out["kv_channels"] = int(head_dim)
    return out


def _llama(c: _Config) -> dict[str, Any]:
    return _gqa_fields(c)


def _qwen2(c: _Config) -> dict[str, Any]:
    # Qwen2 always carries a bias on the QKV projection (no config flag for it).
    return {**_gqa_fields(c), "add_qkv_bias": True}


def _qwen3(c: _Config) -> dict[str, Any]:
    return {**_gqa_fields(c), "qk_layernorm": True}


def _mixtral(c: _Config) -> dict[str, Any]:
    out = _gqa_fields(c)
    out.update(num_moe_experts=int(c.req("num_local_experts")), moe_router_topk=int(c.req("num_experts_per_tok")))
    return out


def _qwen3_moe(c: _Config) -> dict[str, Any]:
    out = _qwen3(c)
    if c.opt("mlp_only_layers") or int(c.opt("decoder_sparse_step", 1)) != 1:
        raise ModelError(f"{c.path}: qwen3_moe with mlp_only_layers / decoder_sparse_step != 1 is not supported",
                         where=".mlp_only_layers")
    out.update(
        num_moe_experts=int(c.req("num_experts")),
        moe_router_topk=int(c.req("num_experts_per_tok")),
        moe_ffn_hidden_size=int(c.req("moe_intermediate_size")),
    )
    return out


def _deepseek(c: _Config) -> dict[str, Any]:
    heads = int(c.req("num_attention_heads"))
    q_lora = c.opt("q_lora_rank")
    shared = int(c.opt("n_shared_experts", 0))
    expert_ffn = int(c.req("moe_intermediate_size"))
    if int(c.opt("moe_layer_freq", 1)) != 1:
        raise ModelError(f"{c.path}: moe_layer_freq != 1 is not supported", where=".moe_layer_freq")
    return dict(
        num_layers=int(c.req("num_hidden_layers")),
        hidden_size=int(c.req("hidden_size")),
        ffn_hidden_size=int(c.req("intermediate_size")),
        num_attention_heads=heads,
        vocab_size=int(c.req("vocab_size")),
        max_position_embeddings=int(c.opt("max_position_embeddings", 4096)),
        untie_embeddings_and_output_weights=not bool(c.opt("tie_word_embeddings", False)),
        num_moe_experts=int(c.req("n_routed_experts")),
        moe_router_topk=int(c.req("num_experts_per_tok")),
        moe_ffn_hidden_size=expert_ffn,
        moe_shared_expert_intermediate_size=shared * expert_ffn if shared else None,
        moe_first_k_dense=int(c.opt("first_k_dense_replace", 0)),
        moe_router_num_groups=int(c.opt("n_group")) if int(c.opt("n_group", 1)) > 1 else None,
        multi_latent_attention=True,
        qk_layernorm=True,  # kv_a_layernorm / q_a_layernorm
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(c.req("kv_lora_rank")),
        qk_head_dim=int(c.req("qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(c.req("qk_rope_head_dim")),
        v_head_dim=int(c.req("v_head_dim")),
        mtp_num_layers=int(c.opt("num_nextn_predict_layers", 0)),
    )


_BLOCK_SYMBOLS = {"mamba": MAMBA, "attention": ATTENTION, "mlp": MLP, "moe": MOE}


def _nemotron_h(c: _Config) -> dict[str, Any]:
    pattern = c.opt("hybrid_override_pattern")
    if pattern is None:
        # Newer exports list block names instead of the pattern string.
        blocks = c.opt("layers_block_type")
        if not isinstance(blocks, list):
            raise ModelError(f"{c.path}: missing key 'hybrid_override_pattern' (or 'layers_block_type')",
                             where=".hybrid_override_pattern")
        try:
            pattern = "".join(_BLOCK_SYMBOLS[str(b)] for b in blocks)
        except KeyError as exc:
            raise ModelError(f"{c.path}: unknown layer type {exc} in layers_block_type",
                             where=".layers_block_type") from None
    pattern = str(pattern)
    out = _gqa_fields(c, num_layers=len(pattern))
    out.update(
        # relu2 (squared ReLU) MLPs are not gated; a *glu activation would be.
        gated_linear_unit="glu" in str(c.opt("mlp_hidden_act", "relu2")).lower(),
        position_embedding_type="none",
        hybrid_layer_pattern=pattern,
        mamba_num_heads=int(c.req("mamba_num_heads")),
        mamba_head_dim=int(c.req("mamba_head_dim")),
        mamba_num_groups=int(c.req("n_groups")),
        mamba_state_dim=int(c.req("ssm_state_size")),
        mamba_conv_kernel=int(c.opt("conv_kernel", 4)),
    )
    if MOE in pattern:
        out.update(
            num_moe_experts=int(c.req("n_routed_experts")),
            moe_router_topk=int(c.req("num_experts_per_tok")),
            moe_ffn_hidden_size=int(c.req("moe_intermediate_size")),
        )
        shared = c.opt("moe_shared_expert_intermediate_size")
        if shared and int(c.opt("n_shared_experts", 1)):
            out["moe_shared_expert_intermediate_size"] = int(shared) * int(c.opt("n_shared_experts", 1))
    return out


_FAMILIES: dict[str, Callable[[_Config], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "nemotron_h": _nemotron_h,
}


def spec_from_hf_config(path: Path, name: str | None = None) -> ModelSpec:
    """Read ``path`` (a config.json, or a folder holding one) into a ModelSpec; raises ModelError."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"{path}: no such file", where=".hf_config")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                         where=".hf_config") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: cannot read: {exc}", where=".hf_config") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}", where=".hf_config")
    model_type = data.get("model_type")
    if model_type not in _FAMILIES:
        raise ModelError(
            f"{path}: unsupported model_type {model_type!r} (supported: {', '.join(sorted(_FAMILIES))})",
            where=".model_type",
        )
    config = _Config(data, path)
    try:
        fields = _FAMILIES[model_type](config)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelError):
            raise
        raise ModelError(f"{path}: malformed value: {exc}", where=".hf_config") from None
    fields["name"] = name or str(data.get("_name_or_path") or path.parent.name or model_type)
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ModelError(f"{path}: {loc}: {err['msg']}", where=f".{loc}") from None
