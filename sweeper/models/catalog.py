"""The model catalog: presets with their published architecture numbers, and ``resolve_model`` for the YAML.

``model:`` in a search YAML is a preset name, ``{preset: NAME, <field>: override, ...}``, ``{hf_config: path}``
(a local Hugging Face config.json, no download), ``{hf: DIR}`` (a local HF model folder built on GPU through
Megatron-Bridge; needs the ``gpu`` extra) or an inline spec with ModelSpec's fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sweeper.errors import ModelError, explain_error, field_path
from sweeper.models.hf import spec_from_hf_config
from sweeper.models.proxy import proxy
from sweeper.models.spec import ModelSpec

NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json: hybrid Mamba2 + MoE + GQA, squared-ReLU MLPs.
        ModelSpec(
            name="nemotron-3-nano-30b-a3b",
            num_layers=52,
            hidden_size=2688,
            ffn_hidden_size=1856,
            num_attention_heads=32,
            num_query_groups=2,
            kv_channels=128,
            vocab_size=131072,
            max_position_embeddings=262144,
            gated_linear_unit=False,
            position_embedding_type="none",
            num_moe_experts=128,
            moe_router_topk=6,
            moe_ffn_hidden_size=1856,
            moe_shared_expert_intermediate_size=3712,
            hybrid_layer_pattern=NEMOTRON_3_NANO_PATTERN,
            mamba_num_heads=64,
            mamba_head_dim=64,
            mamba_num_groups=8,
            mamba_state_dim=128,
            published_total_params_b=31.6,
            published_active_params_b=3.6,  # 3.2B active excluding embeddings
        ),
        # deepseek-ai/DeepSeek-V2-Lite config.json: MLA without query compression, first layer dense.
        ModelSpec(
            name="deepseek-v2-lite",
            num_layers=27,
            hidden_size=2048,
            ffn_hidden_size=10944,
            num_attention_heads=16,
            vocab_size=102400,
            max_position_embeddings=163840,
            num_moe_experts=64,
            moe_router_topk=6,
            moe_ffn_hidden_size=1408,
            moe_shared_expert_intermediate_size=2 * 1408,
            moe_first_k_dense=1,
            multi_latent_attention=True,
            # kv_a_layernorm (HF) = Megatron's MLA kv_layernorm, built only with qk_layernorm=True.
            qk_layernorm=True,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_head_dim=128,
            qk_pos_emb_head_dim=64,
            v_head_dim=128,
            published_total_params_b=15.7,
            published_active_params_b=2.4,
        ),
        # deepseek-ai/DeepSeek-V3 config.json: MLA with query compression, 256 routed experts (top 8, 8 groups) and
        # one shared, the first 3 layers dense, one multi-token-prediction layer (num_nextn_predict_layers).
        ModelSpec(
            name="deepseek-v3",
            num_layers=61,
            hidden_size=7168,
            ffn_hidden_size=18432,
            num_attention_heads=128,
            vocab_size=129280,
            max_position_embeddings=163840,
            num_moe_experts=256,
            moe_router_topk=8,
            moe_router_num_groups=8,
            moe_ffn_hidden_size=2048,
            moe_shared_expert_intermediate_size=2048,
            moe_first_k_dense=3,
            multi_latent_attention=True,
            qk_layernorm=True,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_head_dim=128,
            qk_pos_emb_head_dim=64,
            v_head_dim=128,
            mtp_num_layers=1,
            published_total_params_b=671,
            published_active_params_b=37,
        ),
        # meta-llama/Meta-Llama-3-8B config.json.
        ModelSpec(
            name="llama3-8b",
            num_layers=32,
            hidden_size=4096,
            ffn_hidden_size=14336,
            num_attention_heads=32,
            num_query_groups=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            published_total_params_b=8.03,
            published_active_params_b=8.03,
        ),
        # meta-llama/Llama-3.1-405B config.json: 126 layers, which split over PP8 only with Megatron's embedding/loss
        # accounting (NVIDIA's recipes: PP8 x VPP8, 2 layers per virtual stage) or an uneven first/last stage.
        ModelSpec(
            name="llama3.1-405b",
            num_layers=126,
            hidden_size=16384,
            ffn_hidden_size=53248,
            num_attention_heads=128,
            num_query_groups=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            published_total_params_b=405.85,  # 405,853,388,800 in the HF checkpoint
            published_active_params_b=405.85,
        ),
        # Qwen/Qwen3-30B-A3B config.json: 128 experts top-8, QK-norm, head_dim 128 (not hidden/heads).
        ModelSpec(
            name="qwen3-30b-a3b",
            num_layers=48,
            hidden_size=2048,
            ffn_hidden_size=6144,
            num_attention_heads=32,
            num_query_groups=4,
            kv_channels=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            qk_layernorm=True,
            num_moe_experts=128,
            moe_router_topk=8,
            moe_ffn_hidden_size=768,
            published_total_params_b=30.5,
            published_active_params_b=3.3,
        ),
        # mistralai/Mixtral-8x7B-v0.1 config.json.
        ModelSpec(
            name="mixtral-8x7b",
            num_layers=32,
            hidden_size=4096,
            ffn_hidden_size=14336,
            num_attention_heads=32,
            num_query_groups=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            num_moe_experts=8,
            moe_router_topk=2,
            published_total_params_b=46.7,
            published_active_params_b=12.9,
        ),
        # Tiny models for CPU trials (seconds per step on gloo).
        ModelSpec(
            name="tiny-gpt",
            num_layers=4,
            hidden_size=64,
            ffn_hidden_size=256,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=256,
            max_position_embeddings=256,
        ),
        ModelSpec(
            name="tiny-moe",
            num_layers=4,
            hidden_size=64,
            ffn_hidden_size=128,
            num_attention_heads=4,
            num_query_groups=2,
            vocab_size=256,
            max_position_embeddings=256,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=64,
        ),
        # The mission's 16-GPU "5D" check model: 4 layers, hidden 256, FFN 512, MoE.
        ModelSpec(
            name="tiny-5d",
            num_layers=4,
            hidden_size=256,
            ffn_hidden_size=512,
            num_attention_heads=8,
            num_query_groups=4,
            vocab_size=1024,
            max_position_embeddings=512,
            num_moe_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=512,
        ),
    )
}


def resolve_model(value: Any, base_dir: Path = Path(".")) -> ModelSpec:
    """Turn the YAML's ``model:`` value into a ModelSpec, or raise ModelError.

    Any mapping form takes ``proxy: true``: the model's CPU-size proxy (models/proxy.py), same layer structure."""
    if isinstance(value, dict) and "proxy" in value:
        wanted = value["proxy"]
        if not isinstance(wanted, bool):
            raise ModelError(f"must be true or false, got {wanted!r}", where=".proxy")
        spec = resolve_model({k: v for k, v in value.items() if k != "proxy"}, base_dir)
        return proxy(spec) if wanted else spec
    if isinstance(value, str):
        return preset(value)
    if not isinstance(value, dict):
        raise ModelError(f"must be a preset name or a mapping, got {type(value).__name__}")
    if "hf_config" in value:
        extra = sorted(set(value) - {"hf_config", "name"})
        if extra:
            raise ModelError("unknown key next to hf_config", where=f".{extra[0]}")
        path = Path(str(value["hf_config"]))
        return spec_from_hf_config(path if path.is_absolute() else base_dir / path, name=value.get("name"))
    if "hf" in value:
        return _hf_model(value, base_dir)
    if "preset" in value:
        base = preset(str(value["preset"]))
        overrides = {k: v for k, v in value.items() if k != "preset"}
        return _validated({**base.model_dump(exclude_unset=True), "name": base.name, **overrides})
    return _validated(value)


def _hf_model(value: dict[str, Any], base_dir: Path) -> ModelSpec:
    """``model: {hf: DIR}``: a local Hugging Face model folder (or hub-cache folder models--org--name) that the GPU
    trial builds through Megatron-Bridge (backends/megatron/gpu.py); the ModelSpec for planning comes from its
    config.json. Local only: nothing is downloaded (HF_HUB_OFFLINE=1)."""
    import importlib.util
    import os

    extra = sorted(set(value) - {"hf"})
    if extra:
        raise ModelError("unknown key next to hf (the name is the folder)", where=f".{extra[0]}")
    try:
        has_bridge = importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):
        has_bridge = False
    if not has_bridge:
        raise ModelError(
            "hf needs Megatron-Bridge, which is not installed (pip install -e '.[bridge]' installs the release "
            "paired with the installed megatron-core, with Transformer Engine: docs/support-matrix.md); for planning "
            "alone use {hf_config: DIR}", where=".hf"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(str(value["hf"])).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if not path.is_dir():
        raise ModelError(f"{path}: not a local folder (sweeper never downloads: pass a folder holding config.json "
                         "or a hub-cache folder models--ORG--NAME)", where=".hf")
    if not (path / "config.json").is_file() and (path / "snapshots").is_dir():
        # A hub-cache folder: the snapshot refs/main points to, else the only snapshot there is.
        ref = path / "refs" / "main"
        snapshots = sorted(p for p in (path / "snapshots").iterdir() if (p / "config.json").is_file())
        if ref.is_file() and (path / "snapshots" / ref.read_text().strip() / "config.json").is_file():
            path = path / "snapshots" / ref.read_text().strip()
        elif len(snapshots) == 1:
            path = snapshots[0]
        else:
            raise ModelError(f"{path}: hub-cache folder with {len(snapshots)} snapshots and no refs/main; pass the "
                             "snapshot folder itself", where=".hf")
    # The name carries the folder to the GPU trial (gpu.HF_NAME_PREFIX): ModelSpec is what travels to the ranks.
    return spec_from_hf_config(path, name=f"hf:{path}")


def preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise ModelError(f"unknown preset '{name}' (known: {', '.join(PRESETS)})")
    return PRESETS[name]


def _validated(data: dict[str, Any]) -> ModelSpec:
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        return _raise(explain_error(err), "." + field_path(loc) if loc else "")


def _raise(message: str, where: str) -> ModelSpec:
    raise ModelError(message, where=where)
