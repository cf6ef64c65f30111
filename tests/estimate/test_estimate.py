"""The estimator: exact per-rank parameter and grad-buffer checks against real megatron-core, and unit tests of
the memory / step-time model's structure (pipeline placement, in-flight micro-batches, divisors, speed).

The Megatron checks build each pipeline stage's GPTModel (all its virtual stages) under a fake process group in
one subprocess (``python tests/estimate/test_estimate.py CASES_JSON`` runs ``_probe``), because parallel_state is global
and megatron's import is slow; the subprocess prints the parameter count and the DDP buffers of each stage.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sweeper.config.run_settings import RunSettings
from sweeper.config.schema import ClusterConfig
from sweeper.estimate import Calibration, Estimate, EstimatorConstants, estimate, stage_memory
from sweeper.estimate.memory import ActivationShape, in_flight_microbatches, stage_params
from sweeper.models.catalog import PRESETS, preset
from sweeper.models.spec import ModelSpec
from sweeper.space.layout import Layout
from sweeper.space.pipeline import stage_counts, stage_layers

ROOT = Path(__file__).resolve().parents[2]

# -- cases built by real megatron-core -----------------------------------------------------------------------------
_TINY = PRESETS["tiny-gpt"].model_dump()
_MOE = PRESETS["tiny-moe"].model_dump()
_MLA = dict(
    _MOE, num_layers=5, num_query_groups=None, multi_latent_attention=True, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
    v_head_dim=16, qk_layernorm=True, moe_shared_expert_intermediate_size=128, moe_first_k_dense=1,
)


def _lo(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 1, vpp: int = 1,
        first: int | None = None, last: int | None = None) -> dict[str, Any]:
    return dict(world_size=world_size, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, first_stage_layers=first,
                last_stage_layers=last)


CASES: dict[str, dict[str, Any]] = {
    "dense-tp2-pp2": {"model": _TINY, "layout": _lo(8, tp=2, pp=2)},
    "dense-tp1-pp4": {"model": _TINY, "layout": _lo(4, pp=4)},
    "dense-tp2-pp2-vpp2": {"model": _TINY, "layout": _lo(8, tp=2, pp=2, vpp=2)},
    "dense-uneven-1-3": {"model": _TINY, "layout": _lo(4, tp=2, pp=2, first=1, last=3)},
    "dense-uneven-vpp": {"model": dict(_TINY, num_layers=8), "layout": _lo(6, pp=3, vpp=2, first=2, last=2)},
    "dense-tied-pp2": {"model": dict(_TINY, untie_embeddings_and_output_weights=False), "layout": _lo(4, tp=2, pp=2)},
    "dense-tied-pp1": {"model": dict(_TINY, untie_embeddings_and_output_weights=False), "layout": _lo(2, tp=2)},
    "dense-layernorm-bias-qknorm-learned-pos": {
        "model": dict(_TINY, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True, qk_layernorm=True,
                      gated_linear_unit=False, position_embedding_type="learned_absolute", kv_channels=32),
        "layout": _lo(4, tp=2, pp=2),
    },
    "moe-tp2-pp2-ep2": {"model": _MOE, "layout": _lo(8, tp=2, pp=2, ep=2)},
    "moe-tp1-ep4": {"model": _MOE, "layout": _lo(4, ep=4)},
    "moe-etp2-vpp2": {"model": _MOE, "layout": _lo(8, tp=2, pp=2, ep=2, etp=2, vpp=2)},
    "moe-shared-first-dense-ungated": {
        "model": dict(_MOE, moe_shared_expert_intermediate_size=96, moe_first_k_dense=1, gated_linear_unit=False),
        "layout": _lo(8, tp=2, pp=2, ep=2),
    },
    "mla-moe-tp2-ep2": {"model": _MLA, "layout": _lo(8, tp=2, ep=2)},
    "mla-qlora-uneven": {"model": dict(_MLA, num_layers=4, q_lora_rank=48), "layout": _lo(8, tp=2, pp=2, ep=2, first=1, last=3)},
}


def _spec(case: dict[str, Any]) -> ModelSpec:
    return ModelSpec.model_validate(case["model"])


def _predicted_stages(case: dict[str, Any]):
    lo = case["layout"]
    return stage_params(_spec(case), lo["tp"], lo["pp"], lo["vpp"], lo["ep"], lo["etp"], lo["first_stage_layers"],
                        lo["last_stage_layers"], local_spec=True)


@pytest.fixture(scope="module")
def megatron_built() -> dict[str, list[dict[str, Any]]]:
    pytest.importorskip("megatron.core")
    names = list(CASES)
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps([CASES[n] for n in names])],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(f"megatron probe failed:\n{proc.stderr[-4000:]}")
    return dict(zip(names, json.loads(proc.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("name", list(CASES))
def test_params_per_rank_equal_megatron(name: str, megatron_built: dict[str, list[dict[str, Any]]]) -> None:
    built = [stage["params"] for stage in megatron_built[name]]
    assert [p.total for p in _predicted_stages(CASES[name])] == built


@pytest.mark.parametrize("name", list(CASES))
def test_grad_buffer_and_optimizer_shards_equal_megatron_up_to_alignment(
    name: str, megatron_built: dict[str, list[dict[str, Any]]]
) -> None:
    """Megatron's DDP grad buffer holds every parameter's FP32 main grad, plus alignment padding when the
    distributed optimizer is on: each parameter starts at a multiple of 64 elements and each bucket ends at a
    multiple of lcm(DP, 128) (param_and_grad_buffer.py). The estimator ignores that padding; this bounds it
    exactly, per dense/expert buffer. The distributed optimizer's FP32 master + Adam shards are the buffer's
    numel / DP per bucket, so the same bound (divided by DP) covers them."""
    lo = CASES[name]["layout"]
    for predicted, stage in zip(_predicted_stages(CASES[name]), megatron_built[name]):
        for expert in (False, True):
            buffers = [b for b in stage["buffers"] if b["expert"] == expert]
            actual = sum(b["grad_bytes"] for b in buffers)
            want = 4 * (predicted.expert if expert else predicted.dense)
            slack = 4 * sum(63 * b["tensors"] + b["buckets"] * (math.lcm(b["dp"], 128) - 1) for b in buffers)
            assert want <= actual <= want + slack, (expert, want, actual, slack)
            dp = {b["dp"] for b in buffers}
            if buffers:
                shards = (lo["world_size"] // (lo["tp"] * lo["pp"]) if not expert
                          else lo["world_size"] // (lo["etp"] * lo["ep"] * lo["pp"]))
                assert dp == {shards}  # the group the estimator shards the optimizer over


# -- pipeline placement ----------------------------------------------------------------------------------------------
def test_even_and_uneven_stage_counts() -> None:
    assert stage_counts(32, 4) == (8, 8, 8, 8)
    assert stage_counts(27, 2, first=14) == (14, 13)
    assert stage_counts(27, 3, first=9, last=10) == (9, 8, 10)
    with pytest.raises(ValueError):
        stage_counts(27, 2)
    with pytest.raises(ValueError):
        stage_counts(10, 4, first=3)  # 7 layers over 3 middle stages


def test_interleaved_chunks_follow_megatron_offsets() -> None:
    # 8 layers, PP=2, VPP=2: rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7.
    assert stage_layers(8, 2, 2) == (((0, 1), (4, 5)), ((2, 3), (6, 7)))
    # Uneven + interleaved: first 2, middle 4, last 2 over 3 ranks, VPP 2 -> chunks of 1, 2, 1.
    assert stage_layers(8, 3, 2, 2, 2) == (((0,), (4,)), ((1, 2), (5, 6)), ((3,), (7,)))


def test_hybrid_pattern_layers_land_on_their_stage() -> None:
    spec = PRESETS["nemotron-3-nano-30b-a3b"]
    p = stage_params(spec, 1, 2, first=27, last=25)
    # Stage sums add up to the whole model and experts live where the E layers are.
    assert sum(s.total for s in p) == sum(s.total for s in stage_params(spec, 1, 1))
    first_moe = spec.hybrid_layer_pattern[:27].count("E")
    assert p[0].expert * (spec.count("moe") - first_moe) == p[1].expert * first_moe


def test_in_flight_microbatches() -> None:
    assert [in_flight_microbatches(r, 4, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(0, 4, 1, 2) == 2  # never more than there are micro-batches
    assert in_flight_microbatches(0, 1, 1, 8) == 1
    # Interleaved, PP=4 VPP=2: rank 0 warms up (4-1)*2 + (2-1)*4 = 10 chunks, holds 11 chunks of half its layers.
    assert in_flight_microbatches(0, 4, 2, 8) == 5.5
    assert in_flight_microbatches(3, 4, 2, 8) == 2.5


# -- estimate(): structure -------------------------------------------------------------------------------------------
H100 = ClusterConfig(nodes=2, gpus_per_node=8, gpu_memory_gib=80, compute_capability="9.0", gpu_kind="h100",
                     intra_node_bandwidth_gbs=450, inter_node_bandwidth_gbs=50)
LLAMA = PRESETS["llama3-8b"]
NEMOTRON = PRESETS["nemotron-3-nano-30b-a3b"]


def _est(model: ModelSpec = LLAMA, seq: int = 4096, **kw: Any) -> Estimate:
    base: dict[str, Any] = dict(world_size=8, tp=2, pp=1, sp=True, mbs=1, gbs=64)
    return estimate(model, Layout(**{**base, **kw}), H100, seq)


def test_model_state_matches_megatron_bytes_per_parameter() -> None:
    # Llama-3-8B, TP1 DP8, BF16, distributed optimizer: 2 (bf16 weight) + 4 (fp32 grad) + 12/8 (master + Adam).
    e = _est(tp=1, sp=False)
    params = stage_params(LLAMA, 1, 1)[0].total
    gib = 1 << 30
    assert e.breakdown["weights"] == pytest.approx(2 * params / gib)
    assert e.breakdown["grads"] == pytest.approx(4 * params / gib)
    assert e.breakdown["optimizer"] == pytest.approx(12 * params / 8 / gib)
    no_do = _est(tp=1, sp=False, distributed_optimizer=False)
    assert no_do.breakdown["optimizer"] == pytest.approx(12 * params / gib)


def test_recompute_orders_activation_memory() -> None:
    none, sel, full = (_est(recompute=r).breakdown["activations"] for r in ("none", "selective", "full"))
    assert full < sel <= none
    assert full < none / 10


def test_recompute_modules_trade_memory_for_time() -> None:
    """Megatron's selective recompute modules: each one drops what it recomputes, and the costly ones add time."""
    moe = preset("qwen3-30b-a3b")  # a separate pre-MLP norm, routed experts
    cluster = ClusterConfig(nodes=1, gpus_per_node=8, gpu_memory_gib=80, gpu_kind="h100", intra_node_bandwidth_gbs=450)

    def run(recompute: str, model: ModelSpec = moe) -> Estimate:
        return estimate(model, Layout(world_size=8, ep=8, mbs=1, gbs=8, recompute=recompute), cluster, 4096)

    none, act, act_ln, layer, full = (run(r) for r in (
        "none", "selective:moe_act", "selective:moe_act+layernorm", "selective:moe", "full"))
    mem = [e.breakdown["activations"] for e in (none, act, act_ln, layer, full)]
    assert mem == sorted(mem, reverse=True) and len(set(mem)) == 5
    assert none.step_time_s == act.step_time_s == act_ln.step_time_s  # elementwise recompute: ~free
    assert none.step_time_s < layer.step_time_s <= full.step_time_s  # MoE GEMMs and all-to-alls again
    assert layer.breakdown["transient"] > none.breakdown["transient"]  # one MoE layer rebuilt in backward
    dense = preset("llama3-8b")
    assert run("selective:mlp", dense).breakdown["activations"] < run("selective", dense).breakdown["activations"]
    mla = preset("deepseek-v2-lite")
    assert (run("selective:mla_up_proj", mla).breakdown["activations"]
            < run("selective", mla).breakdown["activations"])


def test_unfused_attention_and_dropout_keep_what_megatron_keeps() -> None:
    """--attention-backend unfused keeps the softmax output (mbs x heads/TP x seq/CP x seq, BF16) per attention
    layer; dropout keeps a 1-byte mask per block output (and the score dropout's mask and output)."""
    def act(**constants: Any) -> float:
        lo = Layout(world_size=8, tp=2, sp=True, mbs=1, gbs=8)
        return estimate(LLAMA, lo, H100, 4096, EstimatorConstants(**constants)).breakdown["activations"]

    gib, tokens, heads, h = 1 << 30, 4096, LLAMA.num_attention_heads, LLAMA.hidden_size
    layers, kv_extra = LLAMA.num_layers, 2 * (heads - LLAMA.query_groups) * LLAMA.head_dim * tokens * 2 / 2
    lse = tokens * heads * 4 / 2
    scores = tokens * heads / 2 * 4096 * 2
    assert act(attention_backend="unfused") - act() == pytest.approx(layers * (scores + kv_extra - lse) / gib)
    assert act(attention_backend="unfused", attention_dropout=0.1) - act(attention_backend="unfused") == (
        pytest.approx(layers * scores / 2 * 3 / gib))
    # megatron-core's local spec without TE: the torch softmax's FP32 output beside its BF16 copy (6 bytes a score;
    # the H200 run of scripts/gpu_check.sh: the 1.2B model's peak rose 14.1 GiB per sequence, flash predicted 3.6).
    assert act(attention_backend="local") - act(attention_backend="unfused") == pytest.approx(
        layers * scores / 2 * 4 / gib)
    assert act(hidden_dropout=0.1) - act() == pytest.approx(layers * 2 * tokens * h / 2 / gib)
    assert act(attention_dropout=0.1) == act()  # flash attention keeps only an RNG state for its dropout


def test_tp_sp_cp_divide_activations() -> None:
    a1 = _est(tp=1, sp=False).breakdown["activations"]
    a2 = _est(tp=2, sp=True).breakdown["activations"]
    a2_nosp = _est(tp=2, sp=False).breakdown["activations"]
    assert a2 == pytest.approx(a1 / 2)  # with SP every activation tensor is sharded over TP
    assert a2 < a2_nosp < a1
    cp2 = _est(tp=2, cp=2, seq=8192).breakdown["activations"]
    assert cp2 == pytest.approx(a2)  # CP2 at twice the sequence keeps the per-rank tokens


def test_pipeline_first_stage_is_worst_and_logits_on_last() -> None:
    e = _est(world_size=16, tp=2, pp=4, gbs=64)
    assert e.breakdown["in_flight_microbatches"] == 4  # 1F1B peak on stage 0
    e_full = _est(world_size=16, tp=2, pp=4, gbs=64, recompute="full")
    assert e_full.memory_gib < e.memory_gib


def test_moe_expert_parallel_divides_expert_state() -> None:
    by_ep = {ep: _est(NEMOTRON, world_size=16, tp=1, pp=2, sp=False, ep=ep) for ep in (1, 2, 4, 8)}
    weights = [by_ep[ep].breakdown["weights"] for ep in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True)
    assert by_ep[8].memory_gib < by_ep[1].memory_gib


def test_fp8_adds_weight_cache_and_shrinks_linear_inputs() -> None:
    bf16, fp8 = _est(precision="bf16"), _est(precision="fp8")
    assert fp8.breakdown["fp8_weights"] > 0 and bf16.breakdown["fp8_weights"] == 0
    assert fp8.breakdown["activations"] < bf16.breakdown["activations"]
    assert fp8.step_time_s is not None and bf16.step_time_s is not None and fp8.step_time_s < bf16.step_time_s


def test_nvfp4_on_blackwell_keeps_two_fp4_weight_copies_and_runs_its_gemms_at_the_fp4_rate() -> None:
    """TE's NVFP4 weight workspace: row- and column-wise, 0.5 byte + one E4M3 scale per 16 elements each; linear
    inputs kept at the same 0.5625 byte; GEMMs at the dense FP4 peak (B200: 9 PFLOP/s) times achievable_mfu_fp4."""
    from sweeper.estimate.memory import fp8_weight_bytes

    assert fp8_weight_bytes("nvfp4", EstimatorConstants(), "10.0") == (2.0, pytest.approx(2 * (0.5 + 1 / 16)))
    b200 = ClusterConfig(nodes=1, gpus_per_node=8, gpu_memory_gib=180, compute_capability="10.0")
    by = {p: estimate(LLAMA, Layout(world_size=8, mbs=1, gbs=64, precision=p), b200, 4096)
          for p in ("bf16", "mxfp8", "nvfp4")}
    layer_params = stage_params(LLAMA, 1, 1)[0].layers.total
    assert by["nvfp4"].breakdown["fp8_weights"] * 2**30 == pytest.approx(2 * 0.5625 * layer_params, rel=1e-6)
    assert by["nvfp4"].breakdown["activations"] < by["mxfp8"].breakdown["activations"] < by["bf16"].breakdown[
        "activations"]
    times = {p: by[p].step_time_s or 0.0 for p in by}
    assert times["nvfp4"] < times["mxfp8"] < times["bf16"]


def test_each_fp8_recipe_prices_its_own_mechanism() -> None:
    """Issue 52 (step_time.fp8_amax_pass_seconds, BLOCKWISE_GEMM_SLOWDOWN, ActivationShape.linear_input_bytes): on
    H100 at TP2+SP, current scaling reads each GEMM input once more for its amax and all-reduces it over TP, so it is
    slower than delayed scaling by exactly that pass and those reductions; blockwise pays its GEMM promotion and
    keeps an FP32 scale per 128 saved elements; a bare fp8 under run.fp8_recipe prices as the recipe it names."""
    from sweeper.estimate.devices import DEVICES
    from sweeper.estimate.step_time import AMAX_REDUCTIONS_PER_BLOCK, block_flops, fp8_amax_pass_seconds

    h100 = ClusterConfig(nodes=1, gpus_per_node=8, compute_capability="9.0")
    lo = dict(world_size=8, tp=2, sp=True, mbs=1, gbs=64)
    by = {r: estimate(LLAMA, Layout(**lo, precision=f"fp8:{r}"), h100, 4096)  # type: ignore[arg-type]
          for r in ("delayed", "tensorwise", "blockwise")}
    terms = {r: e.step_time_terms_s for r, e in by.items()}
    assert set(terms["tensorwise"]) == set(terms["delayed"])  # the same term names: compute.<block>.fp8
    # The amax pass of every layer's GEMMs (per-rank widths at TP2), per micro-batch of 4096 tokens, 16 of them.
    microbatches, tokens, h = 64 // 4, 4096, LLAMA.hidden_size
    extra = 0.0
    for block, widths in (("attention", (h, h / 2)), ("mlp", (h, LLAMA.ffn_hidden_size / 2))):
        gemm = block_flops(LLAMA, block, 4096).gemm  # type: ignore[arg-type]
        extra += tokens * fp8_amax_pass_seconds(gemm, widths, DEVICES["h100"]) * LLAMA.num_layers
    mlp_compute = "compute.mlp.fp8"
    assert terms["tensorwise"][mlp_compute] > terms["delayed"][mlp_compute]
    gained = sum(terms["tensorwise"][t] - terms["delayed"][t] for t in terms["delayed"] if t.startswith("compute."))
    assert gained == pytest.approx(extra * microbatches, rel=1e-6)
    assert terms["tensorwise"]["tp"] > terms["delayed"]["tp"]  # AMAX_REDUCTIONS_PER_BLOCK latency-bound all-reduces
    assert AMAX_REDUCTIONS_PER_BLOCK > 0
    assert by["blockwise"].step_time_s > by["delayed"].step_time_s  # type: ignore[operator]
    assert by["blockwise"].breakdown["activations"] > by["delayed"].breakdown["activations"]
    assert by["tensorwise"].breakdown["activations"] == by["delayed"].breakdown["activations"]
    bare = estimate(LLAMA, Layout(**lo, precision="fp8"), h100, 4096,  # type: ignore[arg-type]
                    run=RunSettings(fp8_recipe="tensorwise"))
    assert bare.step_time_s == by["tensorwise"].step_time_s and bare.memory_gib == by["tensorwise"].memory_gib


def test_the_knobs_move_memory_and_step_time_the_way_their_mechanisms_do() -> None:
    """Issue 18 (memory.dispatch_buffer_bytes, graph_static_bytes, step_time.expert_dispatch, _exposed_launches):
    at EP 8 and top-6, allgather moves and holds every token of the group where alltoall moves the routed copies;
    flex's kernels use more of the link; the A2A overlap hides exchange time and keeps one more layer alive;
    CUDA graphs keep static buffers and remove launch waits where kernels are short; offloaded layers leave the
    device and cost copy time only where the copy outlasts a layer's compute."""
    moe = dict(world_size=8, tp=1, sp=False, ep=8, mbs=1, gbs=64)
    by = {d: _est(NEMOTRON, **moe, moe_token_dispatcher=d) for d in ("alltoall", "allgather", "flex:deepep")}
    assert _est(NEMOTRON, **moe).step_time_s == by["alltoall"].step_time_s  # unset is alltoall
    assert by["allgather"].breakdown["transient"] > by["alltoall"].breakdown["transient"]
    assert by["allgather"].step_time_s > by["alltoall"].step_time_s > by["flex:deepep"].step_time_s  # type: ignore
    overlap = _est(NEMOTRON, **moe, moe_a2a_overlap=True)
    assert overlap.step_time_s < by["alltoall"].step_time_s  # type: ignore[operator]
    layer = by["alltoall"].breakdown["activations"] / NEMOTRON.num_layers  # one more layer alive at the peak
    assert overlap.breakdown["activations"] - by["alltoall"].breakdown["activations"] == pytest.approx(layer, rel=1e-9)
    # A CPU-sized model at a tiny micro-batch is launch-bound: graphs make it faster and hold static buffers.
    tiny = preset("tiny-gpt")
    eager, graphed = (_est(tiny, seq=64, tp=1, sp=False, cuda_graph=g) for g in ("none", "local"))
    assert graphed.step_time_s < eager.step_time_s  # type: ignore[operator]
    assert graphed.breakdown["activations"] > eager.breakdown["activations"]
    big_eager, big_graphed = (_est(LLAMA, tp=1, sp=False, cuda_graph=g) for g in ("none", "te:attn"))
    assert big_graphed.step_time_s == pytest.approx(big_eager.step_time_s)  # long kernels: nothing to save
    plain, offloaded = (_est(LLAMA, tp=1, sp=False, offload_layers=n) for n in (0, 16))
    assert offloaded.breakdown["activations"] < 0.6 * plain.breakdown["activations"]
    assert offloaded.step_time_s >= plain.step_time_s  # type: ignore[operator]


def test_megatron_fsdp_shards_what_its_strategy_names_and_pays_for_it_in_traffic() -> None:
    """Issue 18 (memory.model_state_bytes, step_time): Megatron-FSDP's optim shards what the distributed optimizer
    does; optim_grads also shards the grads, reduce-scattered after every micro-batch; optim_grads_params also the
    weights, all-gathered per decoder layer twice per micro-batch. Two layers are whole at a time."""
    kw = dict(tp=1, sp=False, gbs=64)  # DP 8, 8 micro-batches
    ddp, optim, grads, params = (_est(**kw, fsdp=f) for f in (None, "optim", "optim_grads", "optim_grads_params"))
    assert optim.breakdown == ddp.breakdown and optim.step_time_s == ddp.step_time_s
    stage = stage_params(LLAMA, 1, 1)[0]
    whole = 2 * stage.largest_layer
    gib = 1 << 30
    assert grads.breakdown["grads"] == pytest.approx(4 * (stage.total / 8 + whole) / gib)
    assert grads.breakdown["weights"] == ddp.breakdown["weights"]
    assert params.breakdown["weights"] == pytest.approx(
        2 * (stage.layers.total / 8 + whole + stage.embedding + stage.output) / gib)
    assert params.breakdown["optimizer"] == ddp.breakdown["optimizer"]
    assert params.memory_gib < grads.memory_gib < ddp.memory_gib
    assert ddp.step_time_s < grads.step_time_s < params.step_time_s  # type: ignore[operator]


def test_fragmentation_applies_to_dynamic_memory_only() -> None:
    """Megatron's param/grad buffers and optimizer shards are a few tensors made once: reserved = state +
    fragmentation x (activations + transients + logits)."""
    e = _est(tp=1, sp=False)
    b = e.breakdown
    state = b["weights"] + b["grads"] + b["optimizer"] + b["fp8_weights"] + b["workspaces"]
    dynamic = b["activations"] + b["transient"] + b["logits"]
    assert e.memory_gib == pytest.approx(state + EstimatorConstants().allocator_fragmentation * dynamic)
    assert b["fragmentation"] == pytest.approx((EstimatorConstants().allocator_fragmentation - 1) * dynamic)


def test_grad_buffer_dtype_follows_grad_reduce_in_fp32() -> None:
    """FP32 main grads by default (Megatron-LM's and Megatron-Bridge's BF16 default), BF16 when turned off."""
    lo = Layout(world_size=8, mbs=1, gbs=64)
    fp32 = estimate(LLAMA, lo, H100, 4096).breakdown["grads"]
    bf16 = estimate(LLAMA, lo, H100, 4096, run=RunSettings(grad_reduce_in_fp32=False)).breakdown["grads"]
    core = estimate(LLAMA, lo, H100, 4096, run=RunSettings(framework="megatron-core")).breakdown["grads"]
    bridge = estimate(LLAMA, lo, H100, 4096, run=RunSettings(framework="megatron-bridge")).breakdown["grads"]
    assert core == pytest.approx(bf16) and bridge == pytest.approx(fp32)  # each framework's default
    assert fp32 == pytest.approx(2 * bf16)
    fp16 = estimate(LLAMA, Layout(world_size=8, mbs=1, gbs=64, precision="fp16"), H100, 4096).breakdown["grads"]
    assert fp16 == pytest.approx(bf16)


def test_bf16_grads_cost_fp32_copies_in_the_optimizer_step_not_with_activations() -> None:
    """distrib_optimizer.py _copy_model_grads_to_main_grads: ``shard_main_param.grad = shard_model_grad.float()``
    makes an FP32 copy of each owned grad shard when the buffer is BF16 (none when it is FP32); it lives from the
    step to the next zero_grad, so the peak holds the larger of it and forward/backward's memory."""
    lo = Layout(world_size=8, ep=8, mbs=1, gbs=64)  # EDP 1: every expert's grad is owned here, unsharded
    bf16 = stage_memory(NEMOTRON, lo, 4096, run=RunSettings(grad_reduce_in_fp32=False))[0]
    fp32 = stage_memory(NEMOTRON, lo, 4096)[0]
    assert fp32.parts["grad_copies"] == 0.0
    owned = bf16.params.dense / 8 + bf16.params.expert / 1
    assert bf16.parts["grad_copies"] == pytest.approx(4 * owned / (1 << 30))
    forward = sum(bf16.parts[k] for k in ("activations", "transient", "logits"))
    assert bf16.allocated_gib == pytest.approx(bf16.state_gib + max(forward, bf16.parts["grad_copies"]))
    assert bf16.between_steps_gib == pytest.approx(bf16.state_gib + bf16.parts["grad_copies"])
    # At seq 1024 the step's copies, not the activations, set the peak.
    short = stage_memory(NEMOTRON, lo, 1024, run=RunSettings(grad_reduce_in_fp32=False))[0]
    # The precision-aware optimizer reads the BF16 grads in place; CPU offload keeps the offloaded share on the host.
    aware = RunSettings(grad_reduce_in_fp32=False, precision_aware_optimizer=True, exp_avg_dtype="bf16",
                        exp_avg_sq_dtype="bf16")
    pao = stage_memory(NEMOTRON, lo, 4096, run=aware)[0]
    assert pao.parts["grad_copies"] == 0.0
    assert pao.parts["optimizer"] == pytest.approx(bf16.parts["optimizer"] * (4 + 2 + 2) / 12)
    # Offload needs the precision-aware optimizer (Megatron-LM's validate_args), which copies no grads.
    offload = RunSettings(grad_reduce_in_fp32=False, precision_aware_optimizer=True, optimizer_cpu_offload=True,
                          optimizer_offload_fraction=0.75)
    half = stage_memory(NEMOTRON, lo, 4096, run=offload)[0]
    assert half.parts["optimizer"] == pytest.approx(0.25 * bf16.parts["optimizer"])
    assert half.parts["grad_copies"] == 0.0
    assert short.dynamic_gib == pytest.approx(short.parts["grad_copies"])


def test_routed_memory_follows_the_hottest_ep_rank_within_its_bound() -> None:
    """Dropless MoE: the busiest EP rank's share scales the routed-token memory; EP 1 has no imbalance; the
    factor never exceeds every token of every EP rank landing on one rank's experts."""
    from sweeper.estimate.memory import hot_rank_factor

    def routed(ep: int, factor: float, calibration: Calibration | None = None) -> float:
        lo = Layout(world_size=8, ep=ep, mbs=1, gbs=64)
        return estimate(NEMOTRON, lo, H100, 4096, EstimatorConstants(moe_hot_rank_factor=factor),
                        calibration=calibration).breakdown["activations"]

    assert routed(1, 3.0) == pytest.approx(routed(1, 1.0))
    assert routed(8, 2.0) > routed(8, 1.0)
    assert routed(8, 1.0, Calibration(moe_hot_rank_factor=2.0)) == pytest.approx(routed(8, 2.0))
    shape = ActivationShape(tokens=4096, mbs=1, tp=1, sp=False, cp=1, ep=8, etp=1, precision="bf16",
                            recompute="none", seq_length=4096, hot_rank_factor=100.0)
    k = NEMOTRON.moe_router_topk
    assert hot_rank_factor(NEMOTRON, shape) == 8 * min(k, NEMOTRON.num_moe_experts // 8) / k


def test_the_error_band_decides_what_may_fit() -> None:
    """fits is the central prediction; may_fit (never pruned) holds while the band's lower end fits."""
    lo = Layout(world_size=8, ep=8, mbs=1, gbs=64)
    e = estimate(NEMOTRON, lo, H100, 4096)
    c = EstimatorConstants()
    assert e.memory_band_gib == (pytest.approx(e.memory_gib / (1 + c.memory_over_prediction)),
                                 pytest.approx(e.memory_gib / (1 - c.memory_under_prediction)))
    non_torch = e.breakdown["non_torch"]
    limit = 0.9 * 80
    assert e.fits == (e.memory_gib + non_torch <= limit)
    assert e.may_fit == (e.memory_band_gib[0] + non_torch <= limit)
    assert e.uncertain == (e.may_fit and not e.fits)
    narrow = estimate(NEMOTRON, lo, H100, 4096, EstimatorConstants(memory_over_prediction=0.0))
    assert narrow.may_fit == narrow.fits


def test_fp8_weight_copies_follow_recipe_device_and_param_gather() -> None:
    """TE keeps the FP8 weight plus a transpose where FP8 GEMMs are TN-only (Hopper, 12.x Blackwell), one copy
    on 10.x; MXFP8 keeps row- and column-wise copies with scales; --fp8-param-gather stores the weight in FP8."""
    from sweeper.estimate.memory import fp8_weight_bytes

    c, lm, bridge = EstimatorConstants(), RunSettings(), RunSettings(framework="megatron-bridge")
    assert fp8_weight_bytes("fp8", c, "9.0") == (2.0, 2.0)  # delayed: BF16 weight + FP8 copy + transpose
    assert fp8_weight_bytes("fp8", c, "12.0") == (2.0, 2.0)  # tensorwise, TN-only GEMMs on sm120
    assert fp8_weight_bytes("fp8", c, "10.0") == (2.0, 1.0)  # tensorwise, any layout on sm100
    assert fp8_weight_bytes("mxfp8", c, "10.0") == (2.0, pytest.approx(2 * 33 / 32))
    gather = RunSettings(fp8_param_gather=True)
    assert fp8_weight_bytes("fp8", c, "9.0", gather) == (1.0, 1.0)
    assert fp8_weight_bytes("fp8", c, "10.0", gather) == (1.0, 0.0)
    # Bridge's FP8 recipes gather FP8 params by default (not blockwise); Megatron-LM's default does not.
    assert fp8_weight_bytes("fp8", c, "9.0", bridge) == (1.0, 1.0)
    assert fp8_weight_bytes("fp8", c, "9.0", lm) == (2.0, 2.0)
    assert fp8_weight_bytes("fp8", c, "9.0", RunSettings(framework="megatron-bridge", fp8_recipe="blockwise")
                            ) == (2.0, 2.0)
    lo = Layout(world_size=8, mbs=1, gbs=64, precision="fp8")
    plain, gathered = estimate(LLAMA, lo, H100, 4096), estimate(LLAMA, lo, H100, 4096, run=gather)
    layer_params = stage_params(LLAMA, 1, 1)[0].layers.total
    saved = (plain.breakdown["weights"] + plain.breakdown["fp8_weights"]
             - gathered.breakdown["weights"] - gathered.breakdown["fp8_weights"])
    assert saved == pytest.approx(2 * layer_params / (1 << 30))


# The reference campaign (docs/MISSION.md): layouts that built, trained and saved a distributed checkpoint on one node
# of 8 x 96 GB RTX PRO 6000 (compute capability 12.0) at seq 4096, mbs 1, no recompute.
RTX_PRO_NODE = ClusterConfig(nodes=1, gpus_per_node=8, gpu_memory_gib=96, compute_capability="12.0",
                             gpu_kind="rtx-pro-6000", intra_node_bandwidth_gbs=50, inter_node_bandwidth_gbs=25)
_UNEVEN = dict(tp=2, pp=2, ep=2, sp=True, first_stage_layers=14, last_stage_layers=13)
CAMPAIGN = [
    ("nemotron-3-nano-30b-a3b", dict(ep=8), "bf16"),
    ("nemotron-3-nano-30b-a3b", dict(pp=2, ep=4), "bf16"),
    ("nemotron-3-nano-30b-a3b", dict(tp=2, ep=4, sp=True), "bf16"),
    ("deepseek-v2-lite", dict(ep=8), "bf16"),
    ("deepseek-v2-lite", _UNEVEN, "bf16"),
    ("deepseek-v2-lite", dict(ep=8), "fp8"),
    ("deepseek-v2-lite", _UNEVEN, "fp8"),
]
# The campaign's grad buffers were BF16 (megatron-core's DistributedDataParallelConfig default): with FP32 main
# grads, Nemotron TP2·EP4·SP holds 91 GiB of exact model state per GPU (7.3B expert parameters x (2 + 4 + 12/2)
# bytes plus the dense part), which cannot have run on a 96 GB card.
CAMPAIGN_RUN = RunSettings(framework="megatron-bridge", grad_reduce_in_fp32=False)  # search_spaces/ say so too


def _campaign(name: str, sizes: dict[str, Any], precision: str) -> Estimate:
    lo = Layout(world_size=8, mbs=1, gbs=64, precision=precision, **sizes)
    return estimate(preset(name), lo, RTX_PRO_NODE, 4096, headroom=0.0, run=CAMPAIGN_RUN)


@pytest.mark.parametrize(("name", "sizes", "precision"), CAMPAIGN, ids=[f"{n}:{s}:{p}" for n, s, p in CAMPAIGN])
def test_reference_campaign_layouts_fit_a_96gb_card(name: str, sizes: dict[str, Any], precision: str) -> None:
    assert _campaign(name, sizes, precision).fits


def test_reference_campaign_headroom_ordering() -> None:
    """PP2·EP4 ran with a production run's headroom; TP2·EP4·SP ran but was too tight to choose."""
    pp2 = _campaign("nemotron-3-nano-30b-a3b", dict(pp=2, ep=4), "bf16")
    tp2 = _campaign("nemotron-3-nano-30b-a3b", dict(tp=2, ep=4, sp=True), "bf16")
    assert pp2.memory_gib + pp2.breakdown["non_torch"] <= 0.9 * RTX_PRO_NODE.gpu_memory_gib
    assert pp2.memory_gib < tp2.memory_gib


def test_fits_uses_headroom_and_non_torch_memory() -> None:
    e = _est()
    limit = e.memory_gib + e.breakdown["non_torch"]
    small = H100.model_copy(update={"gpu_memory_gib": limit / 0.9 - 0.01})
    big = H100.model_copy(update={"gpu_memory_gib": limit / 0.9 + 0.01})
    lo = Layout(8, tp=2, sp=True, gbs=64)
    assert not estimate(LLAMA, lo, small, 4096).fits
    assert estimate(LLAMA, lo, big, 4096).fits


def test_to_json_has_the_contract_keys() -> None:
    out = _est().to_json()
    assert set(out) == {"memory_gib", "allocated_gib", "memory_breakdown_gib", "fits", "step_time_s", "tokens_per_s",
                        "memory_band_gib", "may_fit", "step_time_terms_s"}
    # The components a user compares with torch.cuda: allocated parts + fragmentation = reserved (memory_gib).
    parts = out["memory_breakdown_gib"]
    assert {"weights", "grads", "optimizer", "activations", "fragmentation", "non_torch"} <= set(parts)
    assert out["allocated_gib"] + parts["fragmentation"] == pytest.approx(out["memory_gib"], abs=2e-3)
    assert out["allocated_gib"] < out["memory_gib"]


def test_step_time_prefers_tp_inside_a_node_and_counts_the_bubble() -> None:
    # TP 16 spans both nodes -> inter-node TP traffic; TP 8 stays inside.
    inside = _est(world_size=16, tp=8, gbs=64)
    across = _est(world_size=16, tp=16, gbs=64)
    assert inside.tokens_per_s and across.tokens_per_s and inside.tokens_per_s > across.tokens_per_s
    few = _est(world_size=8, tp=2, pp=4, gbs=4)  # 4 micro-batches on PP4: bubble 3/4
    many = _est(world_size=8, tp=2, pp=4, gbs=64)
    assert few.step_time_s and many.step_time_s
    assert few.step_time_s / 4 > many.step_time_s / 64


def test_invalid_layouts_raise_value_error() -> None:
    with pytest.raises(ValueError):
        estimate(LLAMA, Layout(8, tp=3), H100, 4096)  # dp == 0
    with pytest.raises(ValueError):
        estimate(LLAMA, Layout(10, pp=5, gbs=10), H100, 4096)  # 32 layers over 5 stages


def test_calibration_factors_apply() -> None:
    lo = Layout(8, tp=2, sp=True, gbs=64)
    base = estimate(LLAMA, lo, H100, 4096)
    cal = estimate(LLAMA, lo, H100, 4096, calibration=Calibration(activation_factor=2.0, step_time_factor=1.5))
    assert cal.breakdown["activations"] == pytest.approx(2 * base.breakdown["activations"])
    assert cal.step_time_s == pytest.approx(1.5 * (base.step_time_s or 0))


def test_estimator_imports_no_torch() -> None:
    code = "import sys, sweeper.estimate; print(any(m in sys.modules for m in ('torch', 'ray', 'megatron')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_every_valid_layout_of_the_nemotron_space_is_estimated() -> None:
    """The 2x8 Nemotron space: every layout the rules accept gets a finite prediction. (How fast is measured by
    benchmarks/plan_speed.py, not asserted here: a timed assertion fails on a busy machine, not on slow code.)"""
    from sweeper.config.load import load_config
    from sweeper.plan.rules import check
    from sweeper.plan.space import enumerate_layouts

    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    valid = [lo for lo in enumerate_layouts(cfg) if not check(cfg.model, lo, cfg.cluster, cfg.training.seq_length)]
    assert len(valid) > 500
    for lo in valid:
        e = estimate(cfg.model, lo, cfg.cluster, cfg.training.seq_length, constants=cfg.estimate)
        assert math.isfinite(e.memory_gib) and e.step_time_s is not None and e.step_time_s > 0


# -- calibration -------------------------------------------------------------------------------------------------
def _sample(lo: Layout, true_factor: float, true_offset: float, true_step: float, true_state: float = 1.0):
    from sweeper.estimate.calibration import DYNAMIC_KEYS, STATE_KEYS, Sample

    e = estimate(LLAMA, lo, H100, 4096)
    frag = EstimatorConstants().allocator_fragmentation
    state = sum(e.breakdown[k] for k in STATE_KEYS)
    dynamic = sum(e.breakdown[k] for k in DYNAMIC_KEYS)
    # The allocator's slack applies to the dynamic part only (the state is a few tensors made once).
    measured = true_state * state + frag * true_factor * dynamic + true_offset
    return Sample(e.breakdown, frag, e.step_time_s, measured, true_step * (e.step_time_s or 0))


LAYOUT_MIX = [Layout(8, tp=t, sp=t > 1, mbs=m, gbs=64) for t in (1, 2, 4) for m in (1, 2)]


def test_fit_recovers_known_factors_and_reports_error() -> None:
    from sweeper.estimate.calibration import fit

    # A run whose model state is 15% below the prediction (say BF16 moments the YAML did not mention).
    report = fit([_sample(lo, 0.7, 1.5, 1.3, true_state=0.85) for lo in LAYOUT_MIX])
    cal = report.calibration
    assert cal.state_factor == pytest.approx(0.85, rel=1e-6)
    assert cal.activation_factor == pytest.approx(0.7, rel=1e-6)
    assert cal.overhead_gib == pytest.approx(1.5, abs=1e-6)
    assert cal.step_time_factor == pytest.approx(1.3)
    assert report.memory_error_before and report.memory_error_before > 0.01
    assert report.memory_error_after == pytest.approx(0.0, abs=1e-9)
    assert report.step_error_after == pytest.approx(0.0, abs=1e-9)
    assert len(report.lines()) == 3
    # The calibrated estimate reproduces a measurement it was fitted on.
    lo = LAYOUT_MIX[3]
    calibrated = estimate(LLAMA, lo, H100, 4096, calibration=cal)
    assert calibrated.memory_gib == pytest.approx(_sample(lo, 0.7, 1.5, 1.3, true_state=0.85).measured_peak_gib)


def test_fit_with_three_samples_splits_state_and_activations_without_an_offset() -> None:
    from sweeper.estimate.calibration import fit

    cal = fit([_sample(lo, 1.3, 0.0, 1.0, true_state=0.8) for lo in LAYOUT_MIX[:3]]).calibration
    assert (cal.state_factor, cal.activation_factor, cal.overhead_gib) == (
        pytest.approx(0.8), pytest.approx(1.3), 0.0)


def test_fit_with_one_sample_scales_the_whole_prediction() -> None:
    """One measurement cannot tell the state from the activations: one ratio lowers (or raises) both."""
    from sweeper.estimate.calibration import fit

    sample = _sample(Layout(8, tp=2, sp=True, gbs=64), 1.0, 0.0, 1.0, true_state=0.8)
    cal = fit([sample]).calibration
    ratio = sample.measured_peak_gib / sample.predicted_memory(Calibration())
    assert ratio < 0.95
    assert cal.state_factor == pytest.approx(ratio) and cal.activation_factor == pytest.approx(ratio)
    assert cal.overhead_gib == 0.0
    assert sample.predicted_memory(cal) == pytest.approx(sample.measured_peak_gib)


def test_fit_clamps_implausible_factors() -> None:
    from sweeper.estimate.calibration import MAX_STATE_FACTOR, fit

    cal = fit([_sample(Layout(8, tp=2, sp=True, gbs=64), 1.0, 0.0, 1.0, true_state=3.0)]).calibration
    assert cal.state_factor == MAX_STATE_FACTOR


def test_calibration_roundtrip(tmp_path: Path) -> None:
    from sweeper.estimate.calibration import calibration_key, load, save

    path = tmp_path / "calibration.json"
    key = calibration_key("2x8-rtx-pro-6000", "nemotron-3-nano-30b-a3b")
    assert load(path, key) is None
    cal = Calibration(activation_factor=0.9, overhead_gib=0.4, step_time_factor=1.7, state_factor=0.9,
                      moe_hot_rank_factor=1.6, samples=5)
    save(path, key, cal)
    save(path, "other/model", Calibration())
    assert load(path, key) == cal
    assert load(path, "missing/model") is None


def test_published_peak_memory_within_the_goal() -> None:
    """Issue #3's goal on the published measurements (tests/data/measured_memory.json): peak memory within 10%
    median and 20% worst, model state within 6% median, and the measured peaks' order predicted."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "estimate_accuracy.py"), "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    summary = json.loads(out)["summary"]
    assert summary["peak"]["n"] >= 10
    assert summary["peak"]["median"] <= 0.10 and summary["peak"]["max"] <= 0.20, summary["peak"]
    assert summary["goal_met"]
    # Model state is exact up to ~0.1 GiB of fixed buffers (cuBLAS/TE workspaces) that weigh 3-7% in the small CI
    # models, not modelled; the big runs' state is within 1%.
    assert summary["state"]["median"] <= 0.06, summary["state"]
    order = summary["order"]
    assert order["same_order"] >= 0.9 * order["pairs"], order
    # Issue 13: the headline holds on the runs of 7B+ parameters apart from the small models, and no modelled
    # published layout (every one of them ran) is predicted out of memory on its GPU.
    large = summary["peak_7b_plus"]
    assert large["n"] >= 8 and large["median"] <= 0.10 and large["max"] <= 0.20, large
    assert summary["published_layouts_predicted_oom"] == [] and summary["published_layouts_pruned"] == []


def test_step_time_ranks_published_layouts_as_measured() -> None:
    """Published MFU of several layouts of one model (tests/data/measured_throughput.json): the predicted
    throughput orders them as measured, and a layout the source reports out of memory is predicted not to fit."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_time_ranking.py"), "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    summary = json.loads(out)["summary"]
    assert summary["pairs"] >= 7
    assert summary["same_order"] >= 0.85 * summary["pairs"], summary
    assert summary["oom"] >= 1 and summary["oom_predicted"] == summary["oom"], summary


def test_accuracy_benchmark_prints_the_table() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "estimate_accuracy.py")], capture_output=True,
                         text=True, cwd=ROOT, check=True).stdout
    assert "peak allocated GiB" in out and "goal (peak median" in out


# -- the probe (runs in a subprocess: python tests/estimate/test_estimate.py CASES_JSON) ------------------------------------
def _stub_core_attention(spec: Any) -> None:
    # megatron-core 0.16's local DotProductAttention does not accept MLA's k_channels/v_channels (MLA expects
    # TE's attention); the core has no parameters, so a parameterless stand-in keeps the count exact.
    import torch
    class _Core(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = _Core


def _probe(cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Build every pipeline stage of every case (rank 0 of the stage) and report its parameters and DDP buffers."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore
    try:
        from sweeper.backends.megatron.cpu import compat
        compat.install()
    except ImportError:
        pass
    import megatron.core.transformer.multi_latent_attention as mla_module
    if not isinstance(mla_module.TELinear, type):
        # Without Transformer Engine the module still reports HAVE_TE (the extension imports stand-ins) but TELinear is a mock
        # and an isinstance() on it fails; the branch it guards is FP8-only.
        mla_module.HAVE_TE = False
    out = []
    for case in cases:
        m, lo = case["model"], case["layout"]
        W, tp, pp, ep, etp, vpp = lo["world_size"], lo["tp"], lo["pp"], lo["ep"], lo["etp"], lo["vpp"]
        res = []
        for stage in range(pp):
            rank = stage * (W // pp)
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=W)
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                create_gloo_process_groups=False)
            mla = m.get("multi_latent_attention", False)
            kw = dict(num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
                num_attention_heads=m["num_attention_heads"], use_cpu_initialization=True,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, pipeline_dtype=torch.float32,
                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                num_layers_in_first_pipeline_stage=lo.get("first_stage_layers"),
                num_layers_in_last_pipeline_stage=lo.get("last_stage_layers"),
                gated_linear_unit=m.get("gated_linear_unit", True), normalization=m.get("normalization", "RMSNorm"),
                add_bias_linear=m.get("add_bias_linear", False), add_qkv_bias=m.get("add_qkv_bias", False),
                qk_layernorm=m.get("qk_layernorm", False))
            if m.get("num_query_groups"):
                kw["num_query_groups"] = m["num_query_groups"]
            if m.get("kv_channels"):
                kw["kv_channels"] = m["kv_channels"]
            if m.get("num_moe_experts"):
                kw.update(num_moe_experts=m["num_moe_experts"], moe_router_topk=m.get("moe_router_topk", 2),
                          moe_ffn_hidden_size=m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"],
                          moe_shared_expert_intermediate_size=m.get("moe_shared_expert_intermediate_size"))
                if m.get("moe_first_k_dense"):
                    kw["moe_layer_freq"] = [0] * m["moe_first_k_dense"] + [1] * (m["num_layers"] - m["moe_first_k_dense"])
            if mla:
                kw.update(multi_latent_attention=True, q_lora_rank=m.get("q_lora_rank"), kv_lora_rank=m["kv_lora_rank"],
                          qk_head_dim=m["qk_head_dim"], qk_pos_emb_head_dim=m["qk_pos_emb_head_dim"], v_head_dim=m["v_head_dim"],
                          rope_type="rope")
                cfg = MLATransformerConfig(**kw)
            else:
                cfg = TransformerConfig(**kw)
            spec = get_gpt_layer_local_spec(num_experts=m.get("num_moe_experts"), qk_layernorm=m.get("qk_layernorm", False),
                                            multi_latent_attention=mla, normalization=m.get("normalization", "RMSNorm"))
            if m.get("moe_first_k_dense"):
                from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
                spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=m.get("normalization", "RMSNorm"))
            if mla:
                _stub_core_attention(spec)
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
            total = 0
            buffers = []
            for v in range(vpp):
                model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=m["vocab_size"],
                    max_sequence_length=m.get("max_position_embeddings", 128),
                    position_embedding_type=m.get("position_embedding_type", "rope"),
                    share_embeddings_and_output_weights=not m.get("untie_embeddings_and_output_weights", True),
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                    vp_stage=v if vpp > 1 else None)
                total += sum(p.numel() for p in model.parameters())
                ddp = DistributedDataParallel(cfg, ddp_config, model)
                for b in ddp.buffers + ddp.expert_parallel_buffers:
                    buffers.append({"expert": b in ddp.expert_parallel_buffers, "grad_bytes": b.grad_data.numel() * b.grad_data.element_size(),
                                    "tensors": len(b.params), "buckets": len(b.buckets), "dp": b.data_parallel_world_size})
            res.append({"params": total, "buffers": buffers})
            ps.destroy_model_parallel()
            dist.destroy_process_group()
        out.append(res)
    return out

if __name__ == "__main__":
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(json.dumps(_probe(json.loads(sys.argv[1]))))


def test_trials_router_statistics_raise_the_hot_rank_factor_on_any_backend(tmp_path: Path) -> None:
    """A CPU trial measures host memory (no memory calibration) but its router's load is real megatron-core:
    the calibrator keeps the largest measured hot-rank factor and never lowers it. (Hand-written measurements.)"""
    from sweeper.config.load import load_config
    from sweeper.estimate.calibrator import Calibrator, Measured

    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    calibrator = Calibrator(cfg, tmp_path)
    lo = Layout(world_size=2, ep=2, gbs=8)
    update = calibrator.add(lo, Measured(passed=True, peak_memory_gib=0.7, moe_hot_rank_factor=1.7))
    assert update.fit is None  # host RSS does not calibrate memory...
    assert calibrator.current is not None and calibrator.current.moe_hot_rank_factor == 1.7  # ...routing does
    assert update.changed
    update = calibrator.add(lo, Measured(passed=True, peak_memory_gib=0.7, moe_hot_rank_factor=1.3))
    assert calibrator.current.moe_hot_rank_factor == 1.7 and not update.changed


def test_estimator_of_a_space_equals_estimate_layout_by_layout() -> None:
    # The Estimator keeps stage parameters, state and activations per value of the axes they depend on; layouts
    # sharing them must still get exactly what a lone estimate() gives (same floats, not merely close). Imported
    # here: this file also runs as a script (the Megatron probe), where `sweeper` may be another checkout's.
    from sweeper.estimate import Estimator

    model, cluster = preset("nemotron-3-nano-30b-a3b"), ClusterConfig(nodes=2, gpus_per_node=8, gpu_memory_gib=96)
    calibration = Calibration(activation_factor=1.1, overhead_gib=0.5, state_factor=0.9, step_time_factor=1.2)
    layouts = [Layout(world_size=w, tp=tp, pp=pp, ep=ep, mbs=mbs, recompute=rc, sp=tp > 1)
               for w in (8, 16) for tp in (1, 2) for pp in (1, 2) for ep in (1, 8) for mbs in (1, 2)
               for rc in ("none", "full")]
    estimator = Estimator(model, cluster, 4096, calibration=calibration)
    for lo in (lo for lo in layouts if lo.dp and lo.edp):  # sizes that divide
        assert estimator(lo) == estimate(model, lo, cluster, 4096, calibration=calibration)


def test_stage_memory_is_the_memory_estimate_reports() -> None:
    """``stage_memory`` and ``estimate`` share one path: the worst stage's parts are the estimate's breakdown, the
    calibration (its measured hot-rank factor included) applied alike."""
    lo = Layout(world_size=16, pp=2, ep=8, mbs=1, gbs=64)
    calibration = Calibration(activation_factor=1.1, state_factor=0.9, moe_hot_rank_factor=2.0)
    e = estimate(NEMOTRON, lo, H100, 4096, calibration=calibration)
    stages = stage_memory(NEMOTRON, lo, 4096, calibration=calibration, compute_capability=H100.compute_capability)
    worst = stages[int(e.breakdown["pipeline_rank"])]
    assert {k: e.breakdown[k] for k in worst.parts} == worst.parts
    assert stages != stage_memory(NEMOTRON, lo, 4096, calibration=replace(calibration, moe_hot_rank_factor=None),
                                  compute_capability=H100.compute_capability)


def test_estimator_memos_are_keyed_by_every_field_they_read() -> None:
    # The Estimator's memos (stage activations, parameters, state, links, per-block and slowest-stage seconds) are
    # keyed by the layout fields each reads. A field missing from a key would hand one layout another's value, so
    # every layout, met in an order that shares the memos as much as possible, must get what a lone estimate() gives.
    # Two GPUs a node put every group size on its own link; a short sequence makes kernel launches (CUDA graphs) count.
    from sweeper.estimate import Estimator

    cluster = ClusterConfig(nodes=8, gpus_per_node=2, gpu_memory_gib=96, compute_capability="12.0")
    calibration, seq = Calibration(moe_hot_rank_factor=1.5), 256
    layouts = [Layout(world_size=w, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sp=tp > 1, mbs=1, gbs=64,
                      precision=precision, recompute=recompute, moe_token_dispatcher=dispatcher,
                      moe_a2a_overlap=overlap, cuda_graph=graph, offload_layers=offload)
               for w in (8, 16) for tp, cp in ((1, 1), (2, 1), (1, 2)) for pp, vpp in ((1, 1), (2, 1), (2, 2))
               for ep, etp in ((1, 1), (2, 1), (2, 2), (4, 1)) for precision, recompute in (("bf16", "none"), ("fp8", "full"))
               for dispatcher in (None, "allgather") for overlap in (False, True) for graph in ("none", "local")
               for offload in ((0, 1) if pp == 1 else (0,))]
    for model in (NEMOTRON, LLAMA):
        estimator = Estimator(model, cluster, seq, calibration=calibration)
        for lo in layouts:
            try:
                expected = estimate(model, lo, cluster, seq, calibration=calibration)
            except ValueError:  # sizes that do not divide
                continue
            assert estimator(lo) == expected, lo.short()


def test_a_stored_calibration_is_keyed_by_what_moves_the_measurements(tmp_path):
    """Issue 43: a calibration learnt at another sequence length, with other run settings, attention backend or
    Megatron release does not price this sweep's layouts; issue 46: nor one learnt under other estimator constants
    (the factors correct those constants' predictions), which is in the cluster's part of the key too."""
    from sweeper.config.load import load_config
    from sweeper.estimate.calibrator import key

    base = (Path(__file__).resolve().parents[2] / "search_spaces" / "quickstart.yaml").read_text()
    keys = []
    for text in (base, base.replace("seq_length: 64", "seq_length: 128"), base + "run: {overlap_grad_reduce: true}\n",
                 base + "estimate: {attention_backend: local}\n", base + "estimate: {achievable_mfu: 0.4}\n"):
        path = tmp_path / f"s{len(keys)}.yaml"
        path.write_text(text)
        keys.append(key(load_config(path)))
    assert len(set(keys)) == 5, keys
    assert all("mcore" in k and "@seq" in k for k in keys)
    assert keys[4].split("/")[0] != keys[0].split("/")[0]  # the cluster's shared calibration follows the constants


def test_concurrent_saves_of_the_calibration_cache_lose_no_key(tmp_path):
    import threading

    from sweeper.estimate.calibration import Calibration, load, save

    path = tmp_path / "calibration.json"
    threads = [threading.Thread(target=save, args=(path, f"cluster/model-{i}", Calibration(samples=i)))
               for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(load(path, f"cluster/model-{i}") is not None for i in range(16))
