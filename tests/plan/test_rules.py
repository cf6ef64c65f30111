"""One focused test per rule in sweeper.plan.rules: a layout it accepts, a layout it rejects, and the reason's wording.

The table below is keyed by rule name; ``test_every_rule_has_cases`` fails when a rule is added without cases.
Each case calls the rule function alone, so a case shows that exact rule's verdict, not another rule's.
"""

from __future__ import annotations

import pytest

from sweeper.config import megatron_release
from sweeper.config.run_settings import RunSettings
from sweeper.config.schema import ClusterConfig
from sweeper.models.catalog import preset
from sweeper.models.spec import ModelSpec
from sweeper.plan import rules
from sweeper.space.layout import Layout
from sweeper.space.pipeline import with_pipeline_split

DENSE = ModelSpec(
    num_layers=8, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4, vocab_size=1000
)
MOE = DENSE.model_copy(update=dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512))
HYBRID = ModelSpec(
    num_layers=8, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=2, vocab_size=1000,
    hybrid_layer_pattern="M*M-MEME", num_moe_experts=8, moe_router_topk=2, mamba_num_heads=16, mamba_num_groups=4,
)
MLA = DENSE.model_copy(update=dict(multi_latent_attention=True, num_query_groups=None))
H100x2 = ClusterConfig(nodes=2, gpus_per_node=8, compute_capability="9.0")
H100x8 = ClusterConfig(nodes=8, gpus_per_node=8, compute_capability="9.0")
LLAMA_405B = preset("llama3.1-405b")
SEQ = 4096


def L(world_size: int = 16, **kw: object) -> Layout:
    return Layout(world_size=world_size, **{"gbs": 64, **kw})  # type: ignore[arg-type]


# (model, layout, cluster, seq_length, expected): expected None = the rule accepts; else a piece of the reason.
Case = tuple[ModelSpec, Layout, ClusterConfig, int, "str | None"]
CASES: dict[str, list[Case]] = {
    "world_divides_model_parallel": [
        (DENSE, L(16, tp=2, pp=2, cp=2), H100x2, SEQ, None),
        (DENSE, L(12, tp=8), H100x2, SEQ,
         "world size (12) is not divisible by tensor_model_parallel_size (8) x pipeline_model_parallel_size (1) x "
         "context_parallel_size (1)"),
    ],
    "world_divides_expert_parallel": [
        (MOE, L(16, ep=8, etp=2), H100x2, SEQ, None),
        (MOE, L(12, tp=2, ep=8), H100x2, SEQ, "world size (12) is not divisible by expert_tensor_parallel_size (1) x "
         "expert_model_parallel_size (8) x pipeline_model_parallel_size (1) (MoE parallel folding)"),
    ],
    "within_cluster": [
        (DENSE, L(16), H100x2, SEQ, None),
        (DENSE, L(32), H100x2, SEQ, "needs 32 GPUs but the cluster has 16"),
    ],
    "tp_inside_node": [
        (DENSE, L(16, tp=8), H100x2, SEQ, None),
        (DENSE, L(16, tp=8), ClusterConfig(nodes=4, gpus_per_node=4), SEQ,
         "a tensor-parallel group of 8 GPUs cannot stay inside one node of 4 GPUs"),
        # 6-GPU groups on 8-GPU nodes: the second group would straddle two nodes.
        (DENSE.model_copy(update=dict(num_attention_heads=6, num_query_groups=6)), L(12, tp=6), H100x2, SEQ,
         "cannot stay inside one node of 8 GPUs"),
        # ...but inside a single node any TP that fits is fine.
        (DENSE.model_copy(update=dict(num_attention_heads=6, num_query_groups=6)), L(6, tp=6), H100x2, SEQ, None),
    ],
    "multi_node_trial_fills_nodes": [
        (DENSE, L(16), H100x2, SEQ, None),
        (DENSE, L(4), H100x2, SEQ, None),
        (DENSE, L(12), ClusterConfig(nodes=2, gpus_per_node=8), SEQ,
         "a 12-GPU trial spans nodes but is not a whole number of 8-GPU nodes"),
    ],
    "vpp_needs_pp": [
        (DENSE, L(16, pp=2, vpp=2), H100x2, SEQ, None),
        (DENSE, L(16, vpp=2), H100x2, SEQ, "virtual pipeline (interleaved schedule) needs pipeline_model_parallel_size > 1"),
    ],
    "vpp_not_hybrid": [
        (HYBRID, L(16, pp=2), H100x2, SEQ, None),
        (HYBRID, L(16, pp=2, vpp=2), H100x2, SEQ, "hybrid Mamba models do not support the interleaved"),
    ],
    "interleaved_microbatches": [
        (DENSE, L(16, pp=2, vpp=2, gbs=32), H100x2, SEQ, None),  # dp 8 -> 4 micro-batches, a multiple of 2
        (DENSE, L(16, pp=4, vpp=2, gbs=8), H100x2, SEQ,  # dp 4 -> 2 micro-batches < PP 4
         "interleaved schedule needs the number of micro-batches (2) to be >= and a multiple of "
         "pipeline_model_parallel_size (4)"),
        (DENSE, L(16, pp=4, vpp=2, gbs=24), H100x2, SEQ, "(6)"),  # 6 >= 4 but not a multiple
        (DENSE, L(16, pp=4, gbs=8), H100x2, SEQ, None),  # the non-interleaved schedule does not care
    ],
    "sp_needs_tp": [
        (DENSE, L(16, tp=2, sp=True), H100x2, SEQ, None),
        (DENSE, L(16, sp=True), H100x2, SEQ, "Cannot use sequence parallelism without tensor parallelism"),
    ],
    "moe_tp_needs_sp": [
        (MOE, L(16, tp=2, sp=True), H100x2, SEQ, None),
        (DENSE, L(16, tp=2, sp=False), H100x2, SEQ, None),
        (MOE, L(16, tp=2, sp=False), H100x2, SEQ, "MoE with tensor parallelism needs sequence parallelism"),
    ],
    "sp_sequence_divisible": [
        (DENSE, L(16, tp=4, cp=2, sp=True), H100x2, 4096, None),
        (DENSE, L(16, tp=4, cp=2, sp=True), H100x2, 4100,
         "sequence parallel needs seq_length (4100) divisible by TP x CP (8)"),
    ],
    "heads_divisible_by_tp": [
        (DENSE, L(16, tp=8), H100x2, SEQ, None),
        (DENSE.model_copy(update=dict(num_attention_heads=12, num_query_groups=12)), L(16, tp=8), H100x2, SEQ,
         "num_attention_heads (12) must be a multiple of tensor_model_parallel_size (8)."),
        # Megatron's TransformerConfig checks heads for every model, even a hybrid one without attention layers.
        (HYBRID.model_copy(update=dict(hybrid_layer_pattern="MMMMMMMM", num_attention_heads=6, num_moe_experts=None)),
         L(16, tp=4), H100x2, SEQ, "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)."),
    ],
    "query_groups_vs_tp": [
        (DENSE, L(16, tp=8), H100x2, SEQ, None),  # 4 groups divide TP 8
        (DENSE, L(16, tp=2), H100x2, SEQ, None),  # 4 groups are a multiple of TP 2
        (DENSE.model_copy(update=dict(num_attention_heads=24, num_query_groups=6)), L(16, tp=4), H100x2, SEQ,
         "num_query_groups (6) must be a multiple or divisor of tensor_model_parallel_size (4)."),
        (MLA, L(16, tp=8), H100x2, SEQ, None),
    ],
    "linear_widths_divisible": [
        (MOE, L(16, tp=8, etp=8, ep=2), H100x2, SEQ, None),
        (DENSE.model_copy(update=dict(ffn_hidden_size=1020)), L(16, tp=8), H100x2, SEQ,
         "ffn_hidden_size (1020) is not divisible by tensor_model_parallel_size (8)"),
        (MOE.model_copy(update=dict(moe_ffn_hidden_size=300)), L(16, etp=8), H100x2, SEQ,
         "moe_ffn_hidden_size (300) is not divisible by expert_tensor_parallel_size (8)"),
        # Fewer query groups than TP: the fused QKV width (3 + 2 x 1) x 20 = 100 must still split 3 ways.
        (DENSE.model_copy(update=dict(num_attention_heads=3, num_query_groups=1, kv_channels=20)), L(16, tp=3),
         ClusterConfig(nodes=1, gpus_per_node=16), SEQ,
         "the fused QKV projection width (100) is not divisible by tensor_model_parallel_size (3)"),
    ],
    "mamba_heads_and_groups": [
        (HYBRID, L(16, tp=4, cp=2), H100x2, SEQ, None),  # 16 heads / TP 4 = 4, divisible by CP 2
        (HYBRID, L(16, tp=8), H100x2, SEQ, "Mamba groups (4) must be divisible by tensor_model_parallel_size (8)"),
        (HYBRID.model_copy(update=dict(mamba_num_heads=24)), L(16, tp=16), ClusterConfig(nodes=1, gpus_per_node=16),
         SEQ, "Mamba heads (24) must be divisible by tensor_model_parallel_size (16)"),
        (HYBRID.model_copy(update=dict(mamba_num_heads=6)), L(16), H100x2, SEQ,
         "Mamba heads (6) must be a multiple of Mamba groups (4)"),
        (HYBRID, L(16, tp=4, cp=8), ClusterConfig(nodes=4, gpus_per_node=8), SEQ,
         "Mamba heads per TP rank (4) must be divisible by context_parallel_size (8)"),
        (DENSE, L(16, tp=8), H100x2, SEQ, None),  # no Mamba layers: nothing to check
    ],
    "pipeline_split": [
        (DENSE, L(16, pp=4), H100x2, SEQ, None),
        (DENSE, L(16, pp=2, vpp=2), H100x2, SEQ, None),
        (DENSE, L(16, pp=2, vpp=3), H100x2, SEQ,
         "layers per pipeline rank (4) must be divisible by the virtual pipeline size (3)"),
        (DENSE, L(16, pp=16), H100x2, SEQ, "num_layers (8) is smaller than pipeline_model_parallel_size (16)"),
        (preset("deepseek-v2-lite"), L(16, pp=2), H100x2, SEQ, "needs an uneven pipeline split"),
        (preset("deepseek-v2-lite"), L(16, pp=2, first_stage_layers=14, last_stage_layers=13), H100x2, SEQ, None),
        (preset("deepseek-v2-lite"), L(16, pp=4, vpp=2), H100x2, SEQ, "neither an uneven first/last-stage split nor "
         "accounting for the embedding and the loss in the split fits with virtual pipeline size 2"),
        # Megatron's embedding/loss accounting: 126 layers + 2 on PP8 x VPP8 (NVIDIA's Llama-3.1-405B recipes).
        (LLAMA_405B, L(64, pp=8, vpp=8, account_for_embedding=True, account_for_loss=True), H100x8, SEQ, None),
        (LLAMA_405B, L(64, pp=8, vpp=8), H100x8, SEQ, "needs an uneven pipeline split"),
        (LLAMA_405B, L(64, pp=8, vpp=8, account_for_embedding=True), H100x8, SEQ,
         "after enabling account_for_embedding_in_pipeline_split or account_for_loss_in_pipeline_split (127) must "
         "be divisible by pipeline_model_parallel_size (8)"),
        (LLAMA_405B, L(64, pp=8, vpp=16, account_for_embedding=True, account_for_loss=True), H100x8, SEQ, None),
        (LLAMA_405B, L(64, pp=8, vpp=32, account_for_embedding=True, account_for_loss=True), H100x8, SEQ,
         "number of layers on each pipeline rank (16, after enabling account_for_embedding/loss_in_pipeline_split)"
         " must be divisible by virtual_pipeline_model_parallel_size (32)"),
        (LLAMA_405B, L(64, pp=8, vpp=8, pipeline_layout="Et|(tt|)*62tL"), H100x8, SEQ, None),
        (LLAMA_405B, L(64, pp=8, vpp=4, pipeline_layout="Et|(tt|)*62tL"), H100x8, SEQ,
         "virtual_pipeline_model_parallel_size (4) conflicts with pipeline_model_parallel_layout"),
        (LLAMA_405B, L(64, pp=8, vpp=8, pipeline_layout="Et|(tt|)*62L"), H100x8, SEQ,
         "Number of decoder layers (125) in pipeline_model_parallel_layout must match num_layers (126)"),
        (LLAMA_405B, L(64, pp=8, pipeline_layout="Et|tx|L"), H100x8, SEQ, "Invalid layer character: 'x'"),
        (preset("deepseek-v2-lite"), L(16, pp=4, first_stage_layers=7, last_stage_layers=7), H100x2, SEQ,
         "uneven split 7/13/7 does not fit 27 layers on 4 pipeline stages"),
        (preset("deepseek-v2-lite"), L(16, pp=2, vpp=3, first_stage_layers=14, last_stage_layers=13), H100x2, SEQ,
         "number of layers at first stage (14) must be divisible by virtual pipeline parallel degree (3)"),
        (DENSE.model_copy(update=dict(num_layers=10)), L(16, pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2),
         H100x2, SEQ, "number of layers on each middle pipeline rank (3) must be divisible by virtual pipeline"),
        (DENSE, L(16, pp=2, first_stage_layers=0, last_stage_layers=8), H100x2, SEQ,
         "num_layers_in_first_pipeline_stage must be larger than 0"),
        # Hybrid: Megatron's MambaStack splits 8 layers on 3 stages with integer division (drops 2): refused...
        (HYBRID, L(12, pp=3), H100x2, SEQ, "would silently drop layers of a hybrid Mamba model"),
        # ...but it honours an explicit first/last split, which rules.with_pipeline_split fills in.
        (HYBRID, with_pipeline_split(L(12, pp=3), HYBRID), H100x2, SEQ, None),
    ],
    "pipeline_split_options": [
        (LLAMA_405B, L(64, pp=8, vpp=8, account_for_embedding=True, account_for_loss=True), H100x8, SEQ, None),
        (LLAMA_405B, L(64, pp=8, account_for_embedding=True, first_stage_layers=15), H100x8, SEQ,
         "cannot be set at the same time with account_for_embedding_in_pipeline_split"),
        (LLAMA_405B, L(64, pp=8, pipeline_layout="Et|(tt|)*62tL", account_for_loss=True), H100x8, SEQ,
         "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments"),
        (HYBRID, L(12, pp=2, account_for_embedding=True), H100x2, SEQ,
         "a hybrid Mamba model ignores account_for_embedding/loss_in_pipeline_split"),
        (DENSE, L(16, account_for_embedding=True), H100x2, SEQ, "pipeline-split options need"),
    ],
    "ep_needs_experts": [
        (MOE, L(16, ep=8), H100x2, SEQ, None),
        (DENSE, L(16, ep=2), H100x2, SEQ, "num_moe_experts must be non None to use expert-parallel."),
    ],
    "etp_needs_experts": [
        (MOE, L(16, etp=2), H100x2, SEQ, None),
        (DENSE, L(16, etp=2), H100x2, SEQ, "expert_tensor_parallel_size > 1 only applies to MoE models"),
    ],
    "experts_divisible_by_ep": [
        (MOE, L(16, ep=8), H100x2, SEQ, None),
        (MOE.model_copy(update=dict(num_moe_experts=6)), L(16, ep=4), H100x2, SEQ,
         "num_moe_experts (6) must be divisible by expert_model_parallel_size (4) (moe_layer.py)"),
    ],
    "mla_tp_needs_sp": [
        (MLA, L(16, tp=2, sp=True), H100x2, SEQ, None),
        (MLA, L(16, tp=1), H100x2, SEQ, None),
        (DENSE, L(16, tp=2), H100x2, SEQ, None),  # GQA: the keys are TP-sharded with their heads
        (MLA, L(16, tp=2), H100x2, SEQ,
         "multi-latent attention with tensor_model_parallel_size 2 needs sequence parallelism"),
        (MLA, L(16, tp=4), H100x2, SEQ, "NVIDIA/Megatron-LM#1699"),
    ],
    "expert_grads_reduced_over_expert_dp": [
        (MOE, L(16, tp=2, etp=2), H100x2, SEQ, None),  # ETP = TP: the expert DP group is the dense DP group
        (MOE, L(16, tp=2, ep=2, etp=1), H100x2, SEQ, None),  # EP > 1: expert buffers reduce over expert DP
        (DENSE, L(16, tp=2, etp=1), H100x2, SEQ, None),
        (MOE, L(16, tp=2, etp=1), H100x2, SEQ,
         "expert_tensor_parallel_size (1) != tensor_model_parallel_size (2) with expert_model_parallel_size 1"),
        (MOE, L(16, tp=1, etp=2), H100x2, SEQ, "NVIDIA/Megatron-LM#5916"),
    ],
    "expert_bias_needs_etp1": [
        (MOE.model_copy(update=dict(add_bias_linear=True)), L(16, etp=1), H100x2, SEQ, None),
        (MOE.model_copy(update=dict(add_bias_linear=True)), L(16, etp=2), H100x2, SEQ,
         "Bias in Moe is only supported when ETP==1"),
        (MOE, L(16, etp=2), H100x2, SEQ, None),
    ],
    "topk1_needs_pre_softmax": [
        (MOE.model_copy(update=dict(moe_router_topk=1, moe_router_pre_softmax=True)), L(16), H100x2, SEQ, None),
        (MOE.model_copy(update=dict(moe_router_topk=1)), L(16), H100x2, SEQ,
         "Please use --moe-router-pre-softmax when topk is 1."),
    ],
    "experts_divisible_by_router_groups": [
        (MOE.model_copy(update=dict(moe_router_num_groups=4)), L(16), H100x2, SEQ, None),
        (MOE.model_copy(update=dict(moe_router_num_groups=3)), L(16), H100x2, SEQ,
         "num_moe_experts (8) must be divisible by moe_router_num_groups"),
    ],
    "cp_sequence_divisible": [
        (DENSE, L(16, cp=4), H100x2, 4096, None),
        (DENSE, L(16, cp=4), H100x2, 4100, "context parallel needs seq_length (4100) divisible by 2 x CP (8)"),
    ],
    "fp8_mla_cp": [
        (MLA, L(16, cp=2, precision="bf16"), H100x2, SEQ, None),
        (DENSE, L(16, cp=2, precision="fp8"), H100x2, SEQ, None),
        (MLA, L(16, cp=2, precision="fp8"), H100x2, SEQ,
         "FP8 multi-latent attention with context parallel is not supported by Transformer Engine"),
    ],
    "global_batch_divisible": [
        (DENSE, L(16, tp=2, mbs=2, gbs=64), H100x2, SEQ, None),  # dp 8 x mbs 2 = 16 divides 64
        (DENSE, L(16, mbs=3, gbs=64), H100x2, SEQ,
         "global_batch_size (64) is not divisible by micro_batch_size (3) x data_parallel_size (16)"),
        (DENSE, L(16, cp=2, gbs=8), H100x2, SEQ, None),  # DP excludes CP: 8 ranks of data
    ],
    "recompute_modules_exist": [
        (MOE, L(16, recompute="selective:moe_act+layernorm"), H100x2, SEQ, None),
        (DENSE, L(16, recompute="selective:mlp+layernorm"), H100x2, SEQ, None),
        (MLA, L(16, recompute="selective:mla_up_proj"), H100x2, SEQ, None),
        (DENSE, L(16, recompute="selective:moe"), H100x2, SEQ, "recompute module moe: the model has no MoE layers"),
        (MOE, L(16, recompute="selective:shared_experts"), H100x2, SEQ,
         "recompute module shared_experts: the model has no shared experts"),
        (DENSE, L(16, recompute="selective:mla_up_proj"), H100x2, SEQ,
         "mla_up_proj: it is only supported with multi_latent_attention"),
        (MOE, L(16, recompute="selective:mlp"), H100x2, SEQ, "recompute module mlp: the model has no dense MLP"),
    ],
    "recompute_modules_fp8_delayed": [
        (MOE, L(16, precision="fp8", recompute="selective:moe"), H100x2, SEQ, None),
        (MOE, L(16, precision="fp8", recompute="selective:moe_act"), ClusterConfig(nodes=2, compute_capability="10.0"),
         SEQ, None),
        (MOE, L(16, precision="fp8", recompute="selective:layernorm"), H100x2, SEQ,
         "recompute module layernorm: delayed scaling (run.fp8_recipe auto on compute capability 9.0) does not "
         "support moe_act and layernorm recompute for fp8"),
        # Issue 52: Megatron-Core raises for fp8_recipe 'delayed' only; current scaling on Hopper recomputes them
        # (Nemotron-3-Nano's FP8 recipe: EP16, selective:layernorm, tensorwise).
        (MOE, L(16, precision="fp8:tensorwise", recompute="selective:moe_act+layernorm"), H100x2, SEQ, None),
        (MOE, L(16, precision="fp8:blockwise", recompute="selective:layernorm"), H100x2, SEQ, None),
        (MOE, L(16, precision="fp8:delayed", recompute="selective:moe_act"),
         ClusterConfig(nodes=2, compute_capability="10.0"), SEQ,
         "recompute module moe_act: delayed scaling does not support moe_act and layernorm recompute for fp8"),
    ],
    "fp8_hardware": [
        # compute capability -> FP8 (delayed) and MXFP8 verdicts
        (DENSE, L(16, precision="fp8"), ClusterConfig(nodes=2, compute_capability="8.9"), SEQ, None),
        (DENSE, L(16, precision="fp8"), ClusterConfig(nodes=2, compute_capability="8.6"), SEQ,
         "FP8 needs compute capability >= 8.9 (Ada/Hopper/Blackwell); the cluster is 8.6"),
        (DENSE, L(16, precision="mxfp8"), ClusterConfig(nodes=2, compute_capability="9.0"), SEQ,
         "MXFP8 needs compute capability 10.x (B200/GB200); Transformer Engine rejects it on 9.0"),
        (DENSE, L(16, precision="mxfp8"), ClusterConfig(nodes=2, compute_capability="10.0"), SEQ, None),
        (DENSE, L(16, precision="mxfp8"), ClusterConfig(nodes=2, compute_capability="12.0"), SEQ,
         "Transformer Engine rejects it on 12.0"),
        (DENSE, L(16, precision="bf16"), ClusterConfig(nodes=2, compute_capability="8.0"), SEQ, None),
        (DENSE, L(16, precision="nvfp4"), ClusterConfig(nodes=2, compute_capability="10.0"), SEQ, None),
        (DENSE, L(16, precision="nvfp4"), ClusterConfig(nodes=2, compute_capability="9.0"), SEQ,
         "NVFP4 needs compute capability 10.x (B200/GB200/B300)"),
        (DENSE, L(16, precision="nvfp4"), ClusterConfig(nodes=2, compute_capability="12.0"), SEQ,
         "its NVFP4 recipe fails on 12.x; the cluster is 12.0"),
        (DENSE, L(16, precision="fp8:blockwise"), ClusterConfig(nodes=2, compute_capability="9.0"), SEQ, None),
        (DENSE, L(16, precision="fp8:blockwise"), ClusterConfig(nodes=2, compute_capability="8.9"), SEQ,
         "FP8 blockwise scaling needs compute capability >= 9.0"),
        (DENSE, L(16, precision="fp8:tensorwise"), ClusterConfig(nodes=2, compute_capability="8.6"), SEQ,
         "FP8 needs compute capability >= 8.9"),
    ],
    "fp8_gemm_shapes": [
        (DENSE, L(16, tp=2, sp=True, precision="fp8"), H100x2, SEQ, None),
        (DENSE, L(16, tp=8, precision="bf16"), H100x2, 4095, None),  # not FP8: no alignment needed
        (DENSE.model_copy(update=dict(hidden_size=264)), L(16, precision="fp8"), H100x2, SEQ,
         "fp8 GEMMs need hidden_size (264) divisible by 16"),
        (DENSE.model_copy(update=dict(ffn_hidden_size=1040)), L(16, precision="fp8"), H100x2, SEQ, None),  # 1040%16=0
        (DENSE.model_copy(update=dict(ffn_hidden_size=1040)), L(16, precision="mxfp8"),
         ClusterConfig(nodes=2, compute_capability="10.0"), SEQ, "mxfp8 GEMMs need ffn_hidden_size / TP (1040)"),
        (MOE.model_copy(update=dict(moe_ffn_hidden_size=520)), L(16, precision="fp8"), H100x2, SEQ,
         "fp8 GEMMs need moe_ffn_hidden_size / ETP (520) divisible by 16"),
        (DENSE, L(16, precision="fp8"), H100x2, 4092, "fp8 GEMMs need tokens per micro-batch per rank (4092)"),
        (DENSE, L(16, precision="fp8"), H100x2, 4088, None),  # 4088 % 8 = 0
        (DENSE, L(16, precision="nvfp4"), ClusterConfig(nodes=2, compute_capability="10.0"), 4088,
         "nvfp4 GEMMs need tokens per micro-batch per rank (4088) divisible by 16"),
    ],
    # -- issue 18 knobs -----------------------------------------------------------------------------------------
    "token_dispatcher": [
        (MOE, L(16, ep=8, moe_token_dispatcher="allgather"), H100x2, SEQ, None),
        (MOE, L(16, ep=8, moe_token_dispatcher="flex:deepep"), H100x2, SEQ, None),
        (DENSE, L(16, moe_token_dispatcher="alltoall"), H100x2, SEQ, "only applies to MoE models"),
        (MOE, L(16, moe_token_dispatcher="flex:hybridep"), H100x2, SEQ, "Flex token dispatcher requires TPxEP > 1"),
    ],
    "a2a_overlap": [
        (MOE, L(16, ep=8, moe_a2a_overlap=True), H100x2, SEQ, None),
        (MOE, L(16, pp=2, vpp=2, ep=8, moe_a2a_overlap=True, recompute="selective"), H100x2, SEQ, None),
        (MOE, L(16, moe_a2a_overlap=True), H100x2, SEQ, "only supported with expert model parallelism"),
        (MOE, L(16, ep=8, moe_a2a_overlap=True, moe_token_dispatcher="allgather"), H100x2, SEQ,
         "supported with alltoall/flex token dispatcher"),
        (MOE, L(16, pp=2, ep=8, moe_a2a_overlap=True), H100x2, SEQ,
         "virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1"),
        (MOE, L(16, ep=8, moe_a2a_overlap=True, recompute="full"), H100x2, SEQ, "disable full recomputation"),
        (MOE, L(16, ep=8, moe_a2a_overlap=True, precision="fp32"), H100x2, SEQ, "only supported with bf16 or fp16"),
        (preset("nemotron-3-nano-30b-a3b"), L(16, ep=8, moe_a2a_overlap=True), H100x2, SEQ,
         "only GPTModel is supported for EP A2A overlapping"),  # issue 44: combined_1f1b.py's assert
    ],
    # Issue 52: transformer_config.py's MTP checks with overlap_moe_expert_parallel_comm.
    "mtp_with_a2a_overlap": [
        (MOE.model_copy(update=dict(mtp_num_layers=1)), L(16, pp=2, vpp=2, ep=8, moe_a2a_overlap=True), H100x2,
         SEQ, None),
        (MOE.model_copy(update=dict(mtp_num_layers=1)), L(16, ep=8, moe_a2a_overlap=True), H100x2, SEQ,
         "Pipeline model parallel size must be larger than 1"),
        (MOE.model_copy(update=dict(mtp_num_layers=2)), L(16, pp=2, vpp=2, ep=8, moe_a2a_overlap=True), H100x2,
         SEQ, "MTP layernum only supports 1"),
    ],
    "cuda_graphs": [
        (MOE, L(16, ep=8, cuda_graph="te:attn+moe_router+moe_preprocess"), H100x2, SEQ, None),
        (DENSE, L(16, cuda_graph="local"), H100x2, SEQ, None),
        (DENSE, L(16, cuda_graph="full_iteration", recompute="full"), H100x2, SEQ, None),
        (DENSE, L(16, cuda_graph="te:attn", offload_layers=2), H100x2, SEQ, "not supported with CPU offloading"),
        (DENSE, L(16, cuda_graph="te:moe_router"), H100x2, SEQ, "moe cuda graph is only supported for MoE."),
        (MOE, L(16, cuda_graph="te:mlp"), H100x2, SEQ, "mlp cuda graph is only supported for dense layers"),
        (MOE, L(16, cuda_graph="te:moe+moe_router"), H100x2, SEQ, "must not contain both moe and moe_router"),
        (MOE, L(16, cuda_graph="te:moe_preprocess"), H100x2, SEQ, "only supported with moe_router cuda graph"),
        (MOE, L(16, cuda_graph="te:moe"), H100x2, SEQ, "only supported with drop-padding MoE"),
        (DENSE, L(16, cuda_graph="te:attn", recompute="full"), H100x2, SEQ,
         "full recompute is only supported with full iteration CUDA graph"),
        (MOE, L(16, ep=8, cuda_graph="local", moe_a2a_overlap=True), H100x2, SEQ,
         "needs cuda_graph_impl transformer_engine"),
    ],
    "local_graphs_dropless_moe": [
        (DENSE, L(16, cuda_graph="local"), H100x2, SEQ, None),
        (MOE, L(16, ep=8, cuda_graph="te:attn+moe_router"), H100x2, SEQ, None),  # the dispatch runs eagerly
        (MOE, L(16, ep=8, cuda_graph="local"), H100x2, SEQ, "captures the MoE layers whole"),
        (HYBRID, L(16, ep=8, cuda_graph="local"), H100x2, SEQ, "copy the per-expert token counts to the host"),
        (MOE, L(16, ep=8, cuda_graph="full_iteration"), H100x2, SEQ, "cuda_graph full_iteration captures"),
    ],
    "activation_offload": [
        (DENSE, L(16, offload_layers=4), H100x2, SEQ, None),
        (DENSE, L(16, offload_layers=8), H100x2, SEQ, "CPU offloading can be done only for layers less than 8"),
        (DENSE, L(16, pp=2, offload_layers=2), H100x2, SEQ, "no support for Pipeline parallelism with CPU offloading"),
        (DENSE, L(16, offload_layers=2, recompute="selective"), H100x2, SEQ,
         "CPU offloading does not work when activation recomputation is enabled"),
    ],
    "offload_not_hybrid": [
        (DENSE, L(16, offload_layers=2), H100x2, SEQ, None),
        (HYBRID, L(16, ep=8), H100x2, SEQ, None),
        (HYBRID, L(16, ep=8, offload_layers=2), H100x2, SEQ, "MambaStack (ssm/mamba_block.py) has no CPU offload"),
    ],
    "megatron_fsdp": [
        (MOE, L(16, ep=8, fsdp="optim_grads_params"), H100x2, SEQ, None),
        (DENSE, L(16, fsdp="optim", distributed_optimizer=False), H100x2, SEQ,
         "Megatron-FSDP v1 is only compatible with --use-distributed-optimizer"),
    ],
    # -- issue 52: run settings Megatron refuses with the layout (their run settings: RUN below) ------------------
    "precision_aware_optimizer_distributed": [
        (DENSE, L(16), H100x2, SEQ, None),
        (DENSE, L(16, distributed_optimizer=False), H100x2, SEQ,
         "--use-precision-aware-optimizer only supported with distributed optimizer"),
    ],
    "optimizer_offload_fp8_params_delayed": [
        (DENSE, L(16, precision="fp8:delayed"), H100x2, SEQ, None),
        (DENSE, L(16, precision="bf16"), H100x2, SEQ, None),
        (DENSE, L(16, precision="fp8:tensorwise", distributed_optimizer=False), H100x2, SEQ, None),  # BF16 weights
        (DENSE, L(16, precision="fp8:tensorwise"), H100x2, SEQ,
         "When `--fp8-param-gather` is enabled, the optimizer cpu offload must be used in conjunction with "
         "`--fp8-recipe delayed` (this layout's recipe: tensorwise"),
        (DENSE, L(16, precision="fp8"), ClusterConfig(nodes=2, compute_capability="10.0"), SEQ,
         "(this layout's recipe: tensorwise"),  # bare fp8: run.fp8_recipe auto is tensorwise on Blackwell
    ],
}
# The run settings a rule's cases run under (RunSettings() for the others).
RUN: dict[str, RunSettings] = {
    "precision_aware_optimizer_distributed": RunSettings(precision_aware_optimizer=True),
    "optimizer_offload_fp8_params_delayed": RunSettings(optimizer_cpu_offload=True, precision_aware_optimizer=True,
                                                        fp8_param_gather=True),
}

RULE_NAMES = [fn.__name__ for fn in rules.RULES]
PARAMS = [
    pytest.param(name, *case, id=f"{name}-{i}-{'ok' if case[-1] is None else 'bad'}")
    for name, cases in CASES.items()
    for i, case in enumerate(cases)
]


def test_every_rule_has_cases() -> None:
    assert sorted(CASES) == sorted(RULE_NAMES)
    for name, cases in CASES.items():
        verdicts = {expected is None for *_, expected in cases}
        assert verdicts == {True, False}, f"{name} needs a valid and an invalid case"


def on_this_release(name: str, expected: str | None) -> str | None:
    """A case's expected refusal on the installed megatron-core: what 0.19 no longer refuses is valid there."""
    if name == "expert_grads_reduced_over_expert_dp" and megatron_release.installed() >= rules.EXPERT_GRADS_FIXED_IN:
        return None  # NVIDIA/Megatron-LM#5916 is fixed: nothing to refuse
    if expected and "needs cuda_graph_impl transformer_engine" in expected and megatron_release.graph_modules():
        return None  # 0.19 checks the A2A overlap's graph scopes on TE graphs only
    return expected


@pytest.mark.parametrize(("name", "model", "layout", "cluster", "seq_length", "expected"), PARAMS)
def test_rule(name: str, model: ModelSpec, layout: Layout, cluster: ClusterConfig, seq_length: int,
              expected: str | None) -> None:
    fn = getattr(rules, name)
    run = RUN.get(name, RunSettings())
    reason = fn(rules.RuleContext(model, layout, cluster, seq_length, run))
    expected = on_this_release(name, expected)
    if expected is None:
        assert reason is None, reason
    else:
        assert reason is not None and expected in reason, reason
        assert reason in rules.check(model, layout, cluster, seq_length, run)  # check() reports it too


def test_bare_fp8_takes_the_runs_recipe() -> None:
    """A bare fp8 means run.fp8_recipe: tensorwise there lifts the delayed-only recompute refusal on Hopper."""
    lo = L(16, precision="fp8", recompute="selective:layernorm")
    assert rules.recompute_modules_fp8_delayed(rules.RuleContext(MOE, lo, H100x2, SEQ)) is not None
    run = RunSettings(fp8_recipe="tensorwise")
    assert rules.recompute_modules_fp8_delayed(rules.RuleContext(MOE, lo, H100x2, SEQ, run)) is None


def test_nemotron_3_nanos_fp8_recipe_is_writable_on_hopper() -> None:
    """Issue 52: NVIDIA's Nemotron-3-Nano FP8 layout (EP16, selective:layernorm recompute, current scaling) on
    H100 nodes; before recipes were precision values the delayed-scaling rule refused it."""
    nemotron = preset("nemotron-3-nano-30b-a3b")
    lo = L(16, ep=16, precision="fp8:tensorwise", recompute="selective:layernorm")
    assert rules.check(nemotron, lo, H100x2, 8192) == []
    assert rules.check(nemotron, L(16, ep=16, precision="fp8:delayed", recompute="selective:layernorm"), H100x2,
                       8192) != []


def test_check_collects_every_reason_and_nothing_for_a_valid_layout() -> None:
    assert rules.check(DENSE, L(16, tp=2, pp=2, sp=True), H100x2, SEQ) == []
    reasons = rules.check(DENSE, L(16, sp=True, ep=2, mbs=3), H100x2, SEQ)
    assert any("without tensor parallelism" in r for r in reasons)
    assert any("expert-parallel" in r for r in reasons)
    assert any("global_batch_size" in r for r in reasons)


@pytest.mark.parametrize(
    ("capability", "precision", "valid"),
    [("9.0", "mxfp8", False), ("12.0", "mxfp8", False), ("10.0", "mxfp8", True), ("10.3", "mxfp8", True),
     ("8.6", "fp8", False), ("8.9", "fp8", True), ("9.0", "fp8", True), ("12.0", "fp8", True),
     ("8.9", "fp8:blockwise", False), ("9.0", "fp8:blockwise", True), ("8.9", "fp8:tensorwise", True),
     ("10.0", "fp8:delayed", True),
     ("9.0", "nvfp4", False), ("10.0", "nvfp4", True), ("10.3", "nvfp4", True), ("12.0", "nvfp4", False)],
)
def test_precision_gating_by_compute_capability(capability: str, precision: str, valid: bool) -> None:
    cluster = ClusterConfig(nodes=2, gpus_per_node=8, compute_capability=capability)
    reasons = rules.check(DENSE, L(16, tp=2, sp=True, precision=precision), cluster, SEQ)
    assert (reasons == []) == valid, reasons


def test_presets_have_valid_layouts_on_their_spaces() -> None:
    """Sanity: the catalog's real models are not rejected wholesale by a too strict rule."""
    cluster = ClusterConfig(nodes=2, gpus_per_node=8, compute_capability="12.0")
    nemotron = preset("nemotron-3-nano-30b-a3b")
    assert rules.check(nemotron, L(16, tp=2, pp=2, ep=8, sp=True, precision="fp8"), cluster, SEQ) == []
    v2 = preset("deepseek-v2-lite")
    lo = with_pipeline_split(L(16, tp=1, pp=2, ep=8), v2)
    assert rules.check(v2, lo, H100x2, SEQ) == []


def test_the_space_checker_gives_every_layout_the_reasons_check_gives() -> None:
    """Checker remembers each rule's verdict per value of the fields the rule declares it reads (READS): a wrong
    declaration would hand a layout another layout's verdict. Every layout of every shipped space, proxies too."""
    from sweeper.config.load import SHIPPED_SPACES, load_config, proxy_config
    from sweeper.plan.rules import Checker
    from sweeper.plan.space import enumerate_layouts

    compared = 0
    for path in sorted(SHIPPED_SPACES.glob("*.yaml")):
        for cfg in (load_config(path), proxy_config(load_config(path))):
            checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length)
            for layout in enumerate_layouts(cfg):
                assert checker(layout) == rules.check(cfg.model, layout, cfg.cluster, cfg.training.seq_length)
                compared += 1
    assert compared > 5000


def test_each_rule_reads_only_the_layout_fields_it_declares() -> None:
    """The invariant the space Checker relies on: two layouts equal in a rule's READS get the same verdict from it.
    Random layouts over wide axis ranges (uneven splits, FP8 and MXFP8, recompute modules, odd batches), for dense,
    MoE, MLA and hybrid models on three device generations and several sequence lengths."""
    import random
    from collections import defaultdict
    from operator import attrgetter

    from sweeper.errors import LayoutError

    rng = random.Random(15)
    verdicts: dict[tuple[str, object], set[str | None]] = defaultdict(set)
    models = [preset(n) for n in ("tiny-gpt", "tiny-moe", "nemotron-3-nano-30b-a3b", "deepseek-v2-lite")]
    for model in models:
        for cc in ("8.0", "9.0", "10.0"):
            cluster = ClusterConfig(nodes=2, gpus_per_node=8, compute_capability=cc)
            for seq in (64, 4096, 4098):
                for _ in range(150):
                    try:
                        layout = Layout(
                            world_size=rng.choice([1, 2, 4, 6, 8, 12, 16, 32]), tp=rng.choice([1, 2, 3, 4, 8]),
                            pp=rng.choice([1, 2, 3, 4]), cp=rng.choice([1, 2, 4]), ep=rng.choice([1, 2, 4, 64]),
                            etp=rng.choice([1, 2]), vpp=rng.choice([1, 2, 3]), sp=rng.choice([True, False]),
                            mbs=rng.choice([1, 2, 3]), gbs=rng.choice([6, 8, 16, 64]),
                            precision=rng.choice(["bf16", "fp16", "fp8", "fp8:delayed", "fp8:tensorwise",
                                                  "fp8:blockwise", "mxfp8"]),
                            recompute=rng.choice(["none", "full", "selective", "selective:moe_act+layernorm",
                                                  "selective:mla_up_proj", "selective:mlp+shared_experts"]),
                        )
                    except LayoutError:
                        continue
                    layout = with_pipeline_split(layout, model)
                    ctx = rules.RuleContext(model, layout, cluster, seq)
                    for fn in rules.RULES:
                        reads = rules.READS[fn]
                        key = attrgetter(*reads)(layout) if reads else None
                        verdicts[(f"{fn.__name__}|{model.name}|{cc}|{seq}", key)].add(fn(ctx))
    differing = {k: v for k, v in verdicts.items() if len(v) > 1}
    assert not differing, next(iter(differing.items()))
    assert len(verdicts) > 1000
