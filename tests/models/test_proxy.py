"""Proxy models: CPU-size widths, the real model's structure, and the same layout verdicts as the real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeper.config.load import load_config, proxy_config
from sweeper.models.catalog import preset
from sweeper.models.params import total_params
from sweeper.models.proxy import is_proxy, proxy
from sweeper.plan import rules
from sweeper.plan.rules import RuleContext
from sweeper.plan.space import enumerate_layouts
from sweeper.space.pipeline import with_pipeline_split

SPACES = Path(__file__).resolve().parents[2] / "search_spaces"


@pytest.mark.parametrize("name", ["nemotron-3-nano-30b-a3b", "deepseek-v2-lite", "qwen3-30b-a3b", "llama3-8b"])
def test_proxy_keeps_the_structure_and_shrinks_the_widths(name: str) -> None:
    real = preset(name)
    small = proxy(real)
    assert is_proxy(small) and not is_proxy(real) and proxy(small) == small
    fields = ["num_layers", "hybrid_layer_pattern", "num_attention_heads", "query_groups", "moe_router_topk", "moe_first_k_dense", "multi_latent_attention", "gated_linear_unit", "normalization",
              "untie_embeddings_and_output_weights", "position_embedding_type"]
    if real.is_hybrid:
        fields += ["mamba_heads", "mamba_num_groups", "mamba_conv_kernel"]
    for field in fields:
        assert getattr(small, field) == getattr(real, field), field
    assert (small.q_lora_rank is None) == (real.q_lora_rank is None)
    assert bool(small.moe_shared_expert_intermediate_size) == bool(real.moe_shared_expert_intermediate_size)
    assert small.layer_blocks == real.layer_blocks
    if real.is_moe:  # fewer experts, each power-of-two EP up to 8 dividing them as it divides the real count
        assert small.num_moe_experts <= real.num_moe_experts and small.num_moe_experts >= 2 * small.moe_router_topk
        for ep in (1, 2, 4, 8):
            assert (small.num_moe_experts % ep == 0) == (real.num_moe_experts % ep == 0), ep
    assert total_params(small) < total_params(real) / 20
    if name in ("nemotron-3-nano-30b-a3b", "deepseek-v2-lite"):  # the flagships run as CPU trials
        assert total_params(small) < 100e6


@pytest.mark.parametrize("space", ["nemotron.yaml", "deepseek_v2_lite.yaml"])
def test_proxy_gets_the_real_models_verdict_for_every_layout_of_the_space(space: str) -> None:
    cfg = load_config(SPACES / space)
    real, small = cfg.model, proxy_config(cfg).model
    seq = cfg.training.seq_length
    layouts = enumerate_layouts(cfg)
    assert len(layouts) > 1000
    for layout in layouts:
        fired = [[fn.__name__ for fn in rules.RULES if fn(RuleContext(m, with_pipeline_split(layout, m),
                                                                      cfg.cluster, seq))]
                 for m in (real, small)]
        assert fired[0] == fired[1], (layout.short(), fired)


def test_the_proxys_experts_follow_the_largest_expert_parallel_size_searched() -> None:
    real = preset("nemotron-3-nano-30b-a3b")  # 128 experts, top-6
    assert real.num_moe_experts == 128
    assert proxy(real).num_moe_experts == 16  # 16 at least: 2 x top-6 = 12 rounds up to the cap's 16
    assert proxy(real, max_ep=8).num_moe_experts == 16  # two local experts per rank at EP 8
    assert proxy(real, max_ep=16).num_moe_experts == 32
    assert proxy(real, max_ep=64).num_moe_experts == 128  # never more than the real model's
    assert proxy(real, max_ep=128).num_moe_experts == 128
    cfg = load_config(SPACES / "deepseek_v2_lite.yaml")  # 64 experts, EP up to 16
    assert proxy_config(cfg).model.num_moe_experts == 32
