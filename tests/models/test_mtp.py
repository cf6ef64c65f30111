"""Multi-token prediction (issue 52): ``mtp_num_layers`` in the model spec, read from a Hugging Face config, placed
on the pipeline (``m``), priced where it sits, exported, refused where Megatron refuses it, and a DeepSeek-V3 proxy
trial with a generated pipeline layout and MTP through the FP32 gate on the CPU backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sweeper.config.schema import ClusterConfig
from sweeper.estimate import estimate, stage_memory
from sweeper.estimate.memory import stage_params
from sweeper.export.megatron_lm import model_args
from sweeper.models.catalog import preset
from sweeper.models.hf import spec_from_hf_config
from sweeper.models.params import mtp_extra_params
from sweeper.models.spec import ModelSpec
from sweeper.plan import rules
from sweeper.space.layout import Layout, PipelineSplit
from sweeper.space.pipeline import balanced_layout, mtp_rank, stage_layer_kinds
from tests.space.cpu_trial import assert_trial_passes

ROOT = Path(__file__).resolve().parents[2]
H100x8 = ClusterConfig(nodes=128, gpus_per_node=8, gpu_memory_gib=80, compute_capability="9.0")
V3 = preset("deepseek-v3")
NO_MTP = V3.model_copy(update={"mtp_num_layers": 0})


def test_deepseek_v3_has_its_one_mtp_layer_and_hf_configs_name_it(tmp_path: Path) -> None:
    assert V3.mtp_num_layers == 1
    config = {
        "model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 1000,
        "num_nextn_predict_layers": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert spec_from_hf_config(tmp_path / "config.json").mtp_num_layers == 1
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                      if k != "num_nextn_predict_layers"}))
    assert spec_from_hf_config(tmp_path / "config.json").mtp_num_layers == 0


def test_a_hybrid_model_with_mtp_is_refused() -> None:
    with pytest.raises(ValueError, match="mtp_num_layers: multi-token prediction is modelled for GPT models"):
        ModelSpec(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, vocab_size=128,
                  hybrid_layer_pattern="M*", mtp_num_layers=1)


def test_the_mtp_layer_sits_on_the_last_rank_or_where_the_layout_puts_it() -> None:
    assert mtp_rank(NO_MTP, 8) is None
    assert mtp_rank(V3, 8) == 7
    assert mtp_rank(V3, 8, PipelineSplit(layout="Et|(tt|)*29ttm|L")) == 6  # Megatron's standalone MTP stage
    plain, with_mtp = stage_layer_kinds(NO_MTP, 8, 4, split=PipelineSplit(layout="Et|(tt|)*30mL")), \
        stage_layer_kinds(V3, 8, 4, split=PipelineSplit(layout="Et|(tt|)*30mL"))
    assert plain[:7] == with_mtp[:7]
    assert sum(n for _, n in with_mtp[7]) == sum(n for _, n in plain[7]) + 1  # one more MoE layer on rank 7


def test_mtp_is_priced_on_its_rank() -> None:
    # Its transformer layer, its norms and eh_proj, and the embedding copy its stage builds; its own logits.
    layout = Layout(world_size=1024, tp=2, pp=8, vpp=4, ep=64, sp=True, mbs=1, gbs=8192,
                    pipeline_layout=balanced_layout(61, 8, 4, 1))
    without = stage_params(NO_MTP, 2, 8, 4, 64, 1, split=layout.split)[7]
    with_mtp = stage_params(V3, 2, 8, 4, 64, 1, split=layout.split)[7]
    assert with_mtp.embedding > 0 == without.embedding
    assert with_mtp.layers.dense > without.layers.dense + mtp_extra_params(V3, 2)
    assert with_mtp.layers.expert > without.layers.expert
    last, last_without = stage_memory(V3, layout, 4096)[7], stage_memory(NO_MTP, layout, 4096)[7]
    for part in ("weights", "activations", "logits"):
        assert last.parts[part] > last_without.parts[part], part
    # The whole layout's peak is its hot stage's (rank 0 here, with the most micro-batches in flight); the step
    # follows the slowest stage, which the MTP layer makes rank 7.
    priced, baseline = estimate(V3, layout, H100x8, 4096), estimate(NO_MTP, layout, H100x8, 4096)
    assert priced.memory_gib >= baseline.memory_gib and priced.step_time_s > baseline.step_time_s


def test_mtp_is_exported_and_refused_where_megatron_refuses_it() -> None:
    assert "--mtp-num-layers=1" in model_args(V3, 4096)
    assert not any(a.startswith("--mtp-num-layers") for a in model_args(NO_MTP, 4096))
    flat = Layout(world_size=64, tp=1, pp=1, ep=64, gbs=64, moe_a2a_overlap=True)
    assert "Pipeline model parallel size must be larger than 1 when enabling overlap_moe_expert_parallel_comm " \
           "with MTP layer." in rules.check(V3, flat, H100x8, 4096)
    assert not any("MTP" in r for r in rules.check(NO_MTP, flat, H100x8, 4096))


@pytest.mark.e2e  # in CI (about 3 minutes on 2 cores): issue 52's "done when"
def test_a_deepseek_v3_proxy_with_a_generated_layout_and_mtp_passes_the_fp32_gate(tmp_path: Path) -> None:
    """The DeepSeek-V3 proxy (61 layers, MLA, MoE, one MTP layer) on PP2 x VPP2 with sweeper's generated layout
    ``Et*15|(t*16|)*2t*14mL``, the only split of 61 layers there: a real 2-rank megatron-core trial builds the MTP
    block on rank 1's last virtual stage (with its embedding copy), passes the FP32 equivalence gate against the
    one-rank reference (which holds the MTP layer too) and reloads its checkpoint. About 2 minutes on 2 cores. Its
    MLA compresses the query (q_lora_rank), so megatron-core 0.19's TE-only fused query norm does not concern it: the
    CPU backend runs it on 0.16.1 and 0.19.2 alike."""
    text = balanced_layout(61, 2, 2, 1)
    assert text == "Et*15|(t*16|)*2t*14mL"
    path = tmp_path / "ds3.yaml"
    path.write_text(yaml.safe_dump({
        "name": "ds3-mtp", "model": "deepseek-v3",
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_gib": 80, "compute_capability": "9.0",
                    "simulate": True},
        "training": {"seq_length": 32, "global_batch_size": 8, "steps": 1, "warmup_steps": 0, "checkpoint": True,
                     "trial_timeout_s": 900},
        # PP1 in the space makes the gate's batch 2 sequences (DP2 there): the interleaved schedule needs 2 per rank.
        "space": {"gpus": [2], "pp": [1, 2], "vpp": [2], "precision": ["fp32"]},
    }))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    planned = json.loads(subprocess.run([sys.executable, "-m", "sweeper", "plan", str(path), "--proxy", "--json"],
                                        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
                                        check=True).stdout)
    assert [e["layout"].get("pipeline_layout") for e in planned if e["valid"] and e["layout"]["pp"] == 2] == [text]
    assert_trial_passes(tmp_path, path, f"gpus=2,pp=2,pipeline_layout={text}", "--proxy", timeout=1200)
