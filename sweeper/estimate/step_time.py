"""Step time: FLOPs by Megatron's per-architecture formulas, device peak x MFU, communication priced per link.

Good enough to *rank* layouts (the sweep measures the real numbers): compute per micro-batch of the slowest
pipeline stage, plus the tensor/context/expert-parallel traffic on the critical path, times the pipeline
schedule's length (M + (PP-1)/VPP micro-batch slots), plus pipeline point-to-point and the once-per-step
data-parallel gradient reduce / parameter gather. A process group counts as intra-node when its ranks fit
inside one node in Megatron's rank order (tp -> cp -> ep/dp -> pp; expert side etp -> ep -> edp -> pp). The MoE
token exchange is priced by what its dispatcher moves inside a node (NVLink) and across nodes (the NIC) from the
expert-parallel group's placement (``expert_dispatch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from sweeper.config.estimator import EstimatorConstants
from sweeper.estimate.devices import Device
from sweeper.estimate.memory import PipelineStages, StageRole
from sweeper.models.params import padded_vocab_size
from sweeper.models.spec import Block, ModelSpec
from sweeper.space.axes import SCOPE_BLOCK, precision_dtype
from sweeper.space.layout import PipelineSplit, graphed_scopes, recompute_modules
from sweeper.space.pipeline import stage_layer_kinds

GB = 1e9
TFLOP = 1e12
# Causal attention computes half of the score matrix (Megatron's FLOPs formula applies the same factor).
CAUSAL_FRACTION = 0.5
# SSD scan FLOPs per token and (state x inner) element: the recurrent form's state update, output and
# decay products (the count Megatron's hybrid FLOPs formula uses).
MAMBA_SCAN_FLOPS_PER_STATE = 7
# Forward + backward = 3 forward passes (backward computes input and weight gradients).
FWD_BWD_FACTOR = 3
# Tensor-parallel collectives per block and micro-batch: forward all-gather + reduce-scatter (SP) or one
# all-reduce (= 2 ring passes), and the same again in backward.
TP_RING_PASSES_PER_BLOCK = 4
# Expert all-to-alls per MoE block and micro-batch: dispatch + combine, forward and backward.
EP_ALL_TO_ALLS_PER_BLOCK = 4
# Kernels one block launches per micro-batch, forward and backward, by CUDA graph scope (Megatron's CudaGraphScope):
# a rough count of eager Megatron-Core with Transformer Engine (norms, GEMMs, attention, rotary, casts, the router's
# top-k and aux loss, permute/unpermute, the grouped expert GEMMs, dispatch/combine). Each costs the host
# ``kernel_launch_us``; a block whose kernels launch slower than the GPU runs them is host-bound, which CUDA graphs
# remove (one graph launch replaces a scope's kernels).
KERNELS_PER_SCOPE: dict[str, int] = {"attn": 30, "mlp": 15, "moe_router": 10, "moe_preprocess": 15, "moe": 35,
                                     "mamba": 40}


@dataclass(frozen=True)
class BlockFlops:
    gemm: float  # forward FLOPs per token in GEMMs (run at the FP8 rate under FP8)
    other: float  # forward FLOPs per token in attention cores / scans (BF16 rate)
    routed: float = 0.0  # of ``gemm``, the routed experts' grouped GEMMs (their own FP8 efficiency)


def block_flops(spec: ModelSpec, block: Block, seq_length: int, chunk_size: int = 128) -> BlockFlops:
    """Forward FLOPs per token of one block (2 x multiply-adds)."""
    h = spec.hidden_size
    if block == "attention":
        a = spec.num_attention_heads
        if spec.multi_latent_attention:
            q_head = spec.qk_head_dim + spec.qk_pos_emb_head_dim
            q = h * a * q_head if spec.q_lora_rank is None else h * spec.q_lora_rank + spec.q_lora_rank * a * q_head
            kv = h * (spec.kv_lora_rank + spec.qk_pos_emb_head_dim)
            kv += spec.kv_lora_rank * a * (spec.qk_head_dim + spec.v_head_dim)
            gemm = 2 * (q + kv + a * spec.v_head_dim * h)
            core = 2 * seq_length * a * (q_head + spec.v_head_dim) * CAUSAL_FRACTION
        else:
            d, g = spec.head_dim, spec.query_groups
            gemm = 2 * h * (a * d + 2 * g * d) + 2 * a * d * h
            core = 2 * 2 * seq_length * a * d * CAUSAL_FRACTION
        return BlockFlops(gemm, core)
    mlp_factor = 3 if spec.gated_linear_unit else 2
    if block == "mlp":
        return BlockFlops(2 * h * spec.ffn_hidden_size * mlp_factor, 0.0)
    if block == "moe":
        assert spec.num_moe_experts is not None
        routed = spec.moe_router_topk * 2 * h * spec.expert_ffn_hidden_size * mlp_factor
        gemm = 2 * h * spec.num_moe_experts + routed  # the router's and the routed experts'
        if spec.moe_shared_expert_intermediate_size:
            gemm += 2 * h * spec.moe_shared_expert_intermediate_size * mlp_factor
        return BlockFlops(gemm, 0.0, routed)
    heads, groups, state = spec.mamba_heads, spec.mamba_num_groups, spec.mamba_state_dim
    d_inner = heads * spec.mamba_head_dim
    gemm = 2 * h * (2 * d_inner + 2 * groups * state + heads) + 2 * d_inner * h
    scan = MAMBA_SCAN_FLOPS_PER_STATE * state * d_inner + 2 * min(chunk_size, seq_length) * d_inner
    return BlockFlops(gemm, scan)


def model_flops_per_token(spec: ModelSpec, seq_length: int, vocab_size: int | None = None) -> float:
    """Forward + backward FLOPs per token of the whole model (Megatron's TFLOP/s/GPU numerator / tokens).

    The one FLOPs model of sweeper: the estimator prices step time with it and trials report TFLOP/s per GPU
    with it. ``vocab_size``: the padded vocabulary the model was built with (default: padded for TP 1)."""
    total = 0.0
    for blocks in spec.layer_blocks:
        for b in blocks:
            f = block_flops(spec, b, seq_length)
            total += f.gemm + f.other
    total += 2 * spec.hidden_size * (vocab_size or padded_vocab_size(spec))
    return FWD_BWD_FACTOR * total


@dataclass(frozen=True)
class Links:
    """Achieved bandwidth (bytes/s) of each process group of a layout."""

    tp: float
    cp: float
    dp: float
    pp: float
    etp: float
    edp: float
    host: float  # device <-> host copies (activation offload; cluster.host_link_gbs)
    latency: float = 0.0  # seconds per hop of a ring collective or a point-to-point send (link_latency_us)
    # What the expert dispatch reads (``expert_dispatch``): one GPU's NVLink and NIC bandwidth (bytes/s, at the
    # collective's efficiency), and how many ranks of one expert-parallel group share a node (an NVLink domain).
    intra: float = 0.0
    inter: float = 0.0
    ep_ranks_per_node: int = 1


def group_bandwidth(span: int, gpus_per_node: int, intra: float, inter: float) -> float:
    """A group whose consecutive-rank span fits in a node talks over the intra-node link."""
    return intra if span <= gpus_per_node else inter


def ep_ranks_per_node(ep: int, etp: int, gpus_per_node: int) -> int:
    """Ranks of one expert-parallel group on one node. Megatron's expert rank order puts ETP fastest, then EP: an
    EP group's ranks are ETP apart, so a node holds gpus_per_node / ETP of them (all EP of them when they fit)."""
    return max(1, min(ep, gpus_per_node // etp))


def ring(size_bytes: float, group: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of one ring reduce-scatter or all-gather (or all-to-all) of ``size_bytes`` over ``group``: its bytes
    over the link and ``latency`` per hop (G - 1 of them). Nothing to send (a dense model's expert gradients) is
    no collective."""
    if group <= 1 or size_bytes <= 0:
        return 0.0
    return (group - 1) / group * size_bytes / bandwidth + (group - 1) * latency


# Not frozen: the Estimator builds one per layout of a space, and a frozen dataclass sets each of these fields through
# object.__setattr__ (twice the time). Never changed after it is built.
@dataclass
class TimeInputs:
    seq_length: int
    mbs: int
    num_microbatches: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    sp: bool
    precision: str
    recompute: str
    distributed_optimizer: bool
    split: PipelineSplit = PipelineSplit()  # Layout.split: Megatron's pipeline-split options
    overlap_grad_reduce: bool = False  # run.overlap_grad_reduce: DP communication hidden behind compute
    dispatcher: str = "alltoall"  # Layout.dispatcher
    a2a_overlap: bool = False  # Layout.moe_a2a_overlap
    cuda_graph: str = "none"  # Layout.cuda_graph
    offload_layers: int = 0  # Layout.offload_layers
    offload_bytes_per_layer: float = 0.0  # one offloaded layer's activations per micro-batch (the estimator's)
    fsdp: str | None = None  # Layout.fsdp: Megatron-FSDP's sharding strategy
    fp8_recipe: str | None = None  # RunSettings.recipe of the precision on this device (None: not FP8)


# What an FP8 recipe adds to its GEMMs, beside the FP8 rate (achievable_mfu_fp8 for the dense GEMMs and
# achievable_mfu_fp8_experts for the routed experts', fitted on published FP8 runs, price delayed scaling: TE casts
# each GEMM input in one fused pass that also records its amax, and the scales come from the amax history, a handful
# of kernels and one all-reduce of every amax per step, not counted).
# - tensorwise ("current scaling", TE's Float8CurrentScaling): a tensor's scale is its own amax, so each quantised
#   GEMM input is read once more for the amax before it is cast (fp8_amax_pass_seconds); under sequence parallelism
#   TE quantises the input before the all-gather, so every rank's amax is all-reduced over the TP group first: one
#   latency-bound all-reduce per column-parallel GEMM input, forward and backward.
# Per block: forward, the column-parallel GEMM's input (QKV, FC1, in_proj) gathered by SP; backward, the
# row-parallel GEMM's output gradient, which SP gathers too.
AMAX_REDUCTIONS_PER_BLOCK = 2
# - blockwise (Float8BlockScaling, DeepSeek-V3's 1x128 activation and 128x128 weight blocks): the scales are per
#   block, found in the cast's own pass (no amax pass, no reduction), but the GEMM promotes its partial sums to FP32
#   every 128-element block of K (DeepSeek-V3 technical report, section 3.3.2, "increasing accumulation precision"),
#   which costs tensor-core issue slots; an assumption, not fitted: 10% (the one timed blockwise run,
#   tests/data/measured_throughput_fp8.json's DeepSeek-V3 on H800, cannot tell it from the FP8 efficiencies).
BLOCKWISE_GEMM_SLOWDOWN = 1.10


def fp8_amax_pass_seconds(flops: float, widths: tuple[float, float], device: Device) -> float:
    """Seconds of current scaling's extra amax read for ``flops`` forward GEMM FLOPs whose GEMMs have inner and outer
    widths ``widths`` (K, N per rank). A [T x K] x [K x N] GEMM does 2TKN FLOPs forward and 4TKN backward; it
    quantises its input (T x K, forward) and the output gradient (T x N, backward), each read once more in BF16 for
    its amax: 2 bytes x T(K + N) over 2TKN forward FLOPs, i.e. (1/K + 1/N) bytes per forward FLOP, read at the
    device's memory bandwidth."""
    k, n = widths
    return flops * (1 / k + 1 / n) / (device.memory_tbs * 1e12)


def _rates(precision: str, device: Device, constants: EstimatorConstants) -> tuple[float, float]:
    """Achieved FLOP/s of BF16 work and of the GEMMs (FP8/FP4 where the precision and the device have them)."""
    bf16_rate = device.bf16_tflops * TFLOP * constants.achievable_mfu
    gemm_rate = bf16_rate
    if precision_dtype(precision) in ("fp8", "mxfp8") and device.fp8_tflops:
        gemm_rate = device.fp8_tflops * TFLOP * constants.achievable_mfu_fp8
    elif precision == "nvfp4" and device.fp4_tflops:
        gemm_rate = device.fp4_tflops * TFLOP * constants.achievable_mfu_fp4
    return bf16_rate, gemm_rate


def _routed_expert_rate(precision: str, device: Device, constants: EstimatorConstants, gemm_rate: float) -> float:
    """Achieved FLOP/s of the routed experts' grouped GEMMs: under FP8 and MXFP8 their own fraction of the FP8 peak
    (achievable_mfu_fp8_experts: each expert's few rows are quantised, padded and multiplied apart), else the
    GEMMs' rate."""
    if precision_dtype(precision) in ("fp8", "mxfp8") and device.fp8_tflops:
        return device.fp8_tflops * TFLOP * constants.achievable_mfu_fp8_experts
    return gemm_rate


# The step-time terms (``StepTerms``), each a named part of a layout's predicted step time that the calibration fits
# with its own efficiency factor (``estimate.step_fit``). Compute is one term per block kind and precision
# ("compute.attention.bf16", "compute.logits.fp8"); the others are one term each.
RECOMPUTE = "recompute"  # forward work repeated by activation recomputation
TP, CP, EP = "tp", "cp", "ep"  # tensor-parallel collectives, ring-attention KV passes, the MoE token exchange (EP+ETP)
LAUNCH = "launch"  # kernel launches the GPU waits for (per-op host overhead)
OFFLOAD = "offload"  # activation offload copies not hidden behind compute
PP_BUBBLE = "pp_bubble"  # the pipeline's fill and drain: (PP-1)/VPP slots of the slowest stage
PP_P2P = "pp_p2p"  # pipeline send/receive of activations and their gradients
DP, EDP = "dp", "edp"  # the data-parallel (dense) and expert-data-parallel gradient reduce and parameter gather
OPTIMIZER = "optimizer"  # the optimizer step (Adam over this rank's parameter shard, memory-bound)
STAGE_TERMS = (RECOMPUTE, TP, CP, EP, LAUNCH, OFFLOAD)  # besides compute: per micro-batch of the slowest stage
STEP_TERMS = (PP_BUBBLE, PP_P2P, DP, EDP, OPTIMIZER)  # once per step
# The terms of the cluster rather than the model (the links and the host's launch overhead): a calibration learnt on
# one model carries these over to another model on the same cluster.
CLUSTER_TERMS = (TP, CP, EP, LAUNCH, OFFLOAD, PP_P2P, DP, EDP)
# Bytes the optimizer step reads and writes per parameter of its shard: Adam reads the FP32 weight, its gradient and
# both moments and writes back the weight and the moments (7 x 4 bytes), then Megatron copies the weight into the
# model's 16-bit parameter (4 read + 2 written).
OPTIMIZER_BYTES_PER_PARAM = 34


def term_factor(term: str, own: dict[str, float] | None, level: float) -> float:
    """A calibrated term's factor: its own where fitted, else the common level; the bubble's 1.0, since it is the
    slowest stage's time, calibrated already."""
    if own and term in own:
        return own[term]
    return 1.0 if term == PP_BUBBLE else level


def compute_term(block: str, precision: str) -> str:
    """The compute term of ``block`` under ``precision``: one per dtype, every FP8 recipe's GEMMs in ``fp8`` (the
    recipes' differences are priced in it: fp8_amax_pass_seconds, BLOCKWISE_GEMM_SLOWDOWN)."""
    return f"compute.{block}.{precision_dtype(precision)}"


@dataclass(frozen=True)
class StepTerms:
    """A layout's predicted step time as named terms, in seconds. ``stage``: per micro-batch of the slowest pipeline
    stage (its compute, recompute, exposed TP/CP/EP traffic, launches, offload copies), run ``microbatches`` times
    plus ``bubble_slots`` = (PP-1)/VPP times for the pipeline's fill and drain; ``step``: once per step (pipeline
    point-to-point, DP and EDP traffic, the optimizer step).

    With efficiency factors ``f`` (term -> factor, 1.0 where absent) the step takes
    ``sum(f[t] * stage[t]) * (microbatches + f[pp_bubble] * bubble_slots) + sum(f[u] * step[u])``: the bubble is
    the slowest stage's calibrated time, with a factor of its own for how the schedule really fills and drains."""

    stage: dict[str, float]
    microbatches: int
    bubble_slots: float
    step: dict[str, float]

    def seconds(self, factors: Callable[[str], float] = lambda _: 1.0) -> float:
        per_microbatch = sum(factors(t) * s for t, s in self.stage.items())
        slots = self.microbatches + factors(PP_BUBBLE) * self.bubble_slots
        return per_microbatch * slots + sum(factors(t) * s for t, s in self.step.items())

    def per_step(self, factors: Callable[[str], float] = lambda _: 1.0) -> dict[str, float]:
        """Seconds per step of each term (the bubble as its own term; zero terms left out): they sum to
        ``seconds(factors)``."""
        stage = {t: factors(t) * s for t, s in self.stage.items()}
        out = {t: s * self.microbatches for t, s in stage.items()}
        out[PP_BUBBLE] = factors(PP_BUBBLE) * self.bubble_slots * sum(stage.values())
        out.update({t: factors(t) * s for t, s in self.step.items()})
        return {t: s for t, s in out.items() if s > 0}

    def scaled(self, k: float) -> StepTerms:
        """Every term ``k`` times longer (the CPU backend's ranks sharing the host's cores)."""
        return self.weighted(lambda t: 1.0 if t == PP_BUBBLE else k)

    def weighted(self, factors: Callable[[str], float]) -> StepTerms:
        """Each term times its factor (the bubble's scales the bubble slots): ``seconds`` of the result with factors
        g equals ``seconds`` of this one with factors f x g."""
        return StepTerms({t: factors(t) * s for t, s in self.stage.items()}, self.microbatches,
                         factors(PP_BUBBLE) * self.bubble_slots, {t: factors(t) * s for t, s in self.step.items()})

    def names(self) -> list[str]:
        """The terms this layout has (non-zero), the bubble included."""
        return list(self.per_step())


def block_seconds(spec: ModelSpec, x: TimeInputs, device: Device, links: Links, constants: EstimatorConstants,
                  ) -> dict[Block, dict[str, float]]:
    """Per block kind, seconds per micro-batch by term: its compute (``compute_term``) and recomputed forward work
    before the TP split, its exposed TP, CP and EP traffic and kernel launches after it. Of ``x`` it reads the sizes
    within a stage (MBS, TP, SP, CP, EP, ETP), the precision, recompute, dispatcher, all-to-all overlap and CUDA
    graphs; of ``links`` TP, CP, EP and ETP."""
    tokens = x.mbs * x.seq_length / x.cp  # per micro-batch on one CP rank
    bf16_rate, gemm_rate = _rates(x.precision, device, constants)
    routed_rate = _routed_expert_rate(x.precision, device, constants, gemm_rate)
    act_bytes = 4 if x.precision == "fp32" else 2
    tp_bytes = tokens * spec.hidden_size * act_bytes  # one block's hidden state, gathered/scattered over TP

    # Recomputation repeats forward work: the whole layer (full), or what the selective modules name: the
    # attention core (core_attn), the dense MLP (mlp), the MoE layer with its dispatch (moe), the shared experts.
    # Elementwise modules (moe_act, layernorm) and MLA's small up-projections cost next to nothing.
    modules = recompute_modules(x.recompute)
    full = x.recompute == "full"
    core_recomputed = full or "core_attn" in modules

    per_block: dict[Block, dict[str, float]] = {}
    # Megatron's combined 1F1B (moe_a2a_overlap) runs one micro-batch's dispatch and combine while another computes:
    # the exchange hides behind that micro-batch's whole layer, its attention too where a layer pairs it with the MoE.
    overlapped = ("attention", "moe") if ("attention", "moe") in spec.layer_blocks else ("moe",)
    layer_work = 0.0
    for b in sorted(spec.block_counts, key=lambda b: b == "moe"):  # the MoE block last: it reads the layer's work
        f = block_flops(spec, b, x.seq_length, constants.mamba_chunk_size)
        # The mlp and moe modules recompute exactly the block of that name.
        recomputed = full or (b in ("mlp", "moe") and b in modules)
        extra_gemm = f.gemm if recomputed else 0.0
        extra_routed = f.routed if recomputed else 0.0
        if b == "moe" and "shared_experts" in modules and not recomputed:
            shared = spec.moe_shared_expert_intermediate_size or 0
            extra_gemm += 2 * spec.hidden_size * shared * (3 if spec.gated_linear_unit else 2)
        # A CP rank attends its tokens to the whole sequence: the core scales with its tokens only.
        gemm_s = tokens * FWD_BWD_FACTOR * ((f.gemm - f.routed) / gemm_rate + f.routed / routed_rate)
        if x.fp8_recipe == "blockwise":
            gemm_s *= BLOCKWISE_GEMM_SLOWDOWN
        elif x.fp8_recipe == "tensorwise":  # times TP: compute terms are divided by TP per stage below
            gemm_s += tokens * fp8_amax_pass_seconds(f.gemm, _gemm_widths(spec, b, x), device) * x.tp
        compute = gemm_s + tokens * FWD_BWD_FACTOR * f.other / bf16_rate
        recompute = tokens * ((extra_gemm - extra_routed) / gemm_rate + extra_routed / routed_rate
                              + (f.other / bf16_rate if core_recomputed else 0.0))
        parts = {compute_term(b, x.precision): compute, RECOMPUTE: recompute, TP: 0.0, CP: 0.0, EP: 0.0}
        if b != "moe" or spec.moe_shared_expert_intermediate_size:
            parts[TP] = TP_RING_PASSES_PER_BLOCK * ring(tp_bytes, x.tp, links.tp, links.latency)
        if x.fp8_recipe == "tensorwise" and x.sp:
            parts[TP] += AMAX_REDUCTIONS_PER_BLOCK * links.latency
        if b == "attention" and x.cp > 1:
            if spec.multi_latent_attention:
                width = spec.num_attention_heads * (spec.qk_head_dim + spec.qk_pos_emb_head_dim + spec.v_head_dim)
            else:
                width = 2 * spec.query_groups * spec.head_dim
            kv = tokens * width * act_bytes / x.tp
            # Ring attention passes every KV block around the CP group; backward also returns dKV.
            parts[CP] = 3 * (x.cp - 1) * (kv / links.cp + links.latency) * (1 - constants.cp_comm_overlap)
        work = (compute + recompute) / x.tp
        if b in overlapped:
            layer_work += work
        if b == "moe":
            exchange = expert_dispatch(spec, x, links, tokens * spec.hidden_size * act_bytes / (x.tp if x.sp else 1),
                                       recomputed, constants)
            if x.a2a_overlap:  # the exchange runs behind another micro-batch's layer, as far as that lasts
                exchange -= min(exchange, layer_work) * constants.moe_a2a_overlap_efficiency
            parts[EP] = exchange
        # Recomputing a block launches its forward kernels again (about a third of its forward + backward ones).
        relaunch = 1 + (1 / FWD_BWD_FACTOR if recomputed else 0.0)
        parts[LAUNCH] = _exposed_launches(b, work + parts[TP] + parts[CP] + parts[EP], x.cuda_graph, constants,
                                          relaunch)
        per_block[b] = parts
    return per_block


def _gemm_widths(spec: ModelSpec, block: str, x: TimeInputs) -> tuple[float, float]:
    """The inner and outer widths of a block's GEMMs on one rank (the hidden size and its FFN or expert FFN width
    split over TP or ETP), for the per-GEMM amax pass of current scaling."""
    if block == "moe":
        return float(spec.hidden_size), spec.expert_ffn_hidden_size / x.etp
    if block == "mlp":
        return float(spec.hidden_size), spec.ffn_hidden_size / x.tp
    return float(spec.hidden_size), spec.hidden_size / x.tp


def slowest_stage(spec: ModelSpec, x: TimeInputs, pipeline: PipelineStages, device: Device, links: Links,
                  constants: EstimatorConstants, per_block: dict[Block, dict[str, float]] | None = None,
                  stages: dict[StageRole, tuple[dict[str, float], float]] | None = None) -> dict[str, float]:
    """Seconds per micro-batch of the slowest stage of ``pipeline`` (``x``'s PP, VPP and split), by term (compute and
    recompute after the TP split): its compute and its exposed tensor/context/expert-parallel communication. Reads
    what ``block_seconds`` reads (``per_block``: its result, when the caller keeps it): not the data-parallel side,
    the micro-batch count or offload. ``stages``: each stage's terms and seconds by its role, kept by the caller for
    every call with the same ``per_block`` (pipelines of other depths repeat stages)."""
    if per_block is None:
        per_block = block_seconds(spec, x, device, links, constants)
    if stages is None:
        stages = {}
    tokens = x.mbs * x.seq_length / x.cp  # per micro-batch on one CP rank
    # The output layer runs in BF16 under every FP8/FP4 recipe: Megatron builds it as tensor_parallel's
    # ColumnParallelLinear, not a Transformer Engine module, so no fp8_autocast reaches it (DeepSeek-V3 keeps its
    # output head in BF16 too, technical report section 3.3.1); the MTP heads' small eh_proj goes with it.
    logits_rate = _rates(x.precision, device, constants)[0]
    slowest: dict[str, float] = {}
    slowest_s = -1.0
    for role in pipeline.roles:  # the first rank's first: the first of the slowest ranks wins a tie
        kept = stages.get(role)
        if kept is None:
            kinds, holder, last = role
            kept = stages[role] = _stage_seconds(spec, x, per_block, kinds, last, holder, tokens, logits_rate)
        stage, seconds = kept
        if seconds > slowest_s:
            slowest, slowest_s = stage, seconds
    return slowest


def _stage_seconds(spec: ModelSpec, x: TimeInputs, per_block: dict[Block, dict[str, float]], kinds: tuple,
                   last: bool, holder: bool, tokens: float, logits_rate: float) -> tuple[dict[str, float], float]:
    """One pipeline stage's terms per micro-batch and their sum (``slowest_stage``): its layers of ``kinds``, and
    the output layer on the ``last`` rank and the MTP heads on their ``holder``."""
    stage: dict[str, float] = {}
    for kind, n in kinds:
        for b in kind:
            for term, s in per_block[b].items():
                stage[term] = stage.get(term, 0.0) + n * s
    # The output layer's GEMM: the model's on the last rank, each MTP layer's again on the MTP rank (with its
    # eh_proj, 2h -> h); the MTP transformer layer itself is one of the rank's kinds (stage_layer_kinds).
    heads = last + (spec.mtp_num_layers if holder else 0)
    if heads:
        logits_flops = 2 * spec.hidden_size * padded_vocab_size(spec, x.tp) * heads
        if holder:
            logits_flops += spec.mtp_num_layers * 2 * 2 * spec.hidden_size * spec.hidden_size
        term = compute_term("logits", x.precision)
        stage[term] = stage.get(term, 0.0) + tokens * logits_flops * FWD_BWD_FACTOR / logits_rate
    for term in stage:
        if term.startswith("compute.") or term == RECOMPUTE:
            stage[term] /= x.tp
    return stage, sum(stage.values())


def step_time(stage: dict[str, float], microbatches: int, pp: int, vpp: int, once: dict[str, float]) -> StepTerms:
    """The terms of one optimizer step (all micro-batches of the global batch; ``.seconds()`` is the step time):
    ``stage``, the slowest stage's (``slowest_stage``, with ``offload_seconds`` where layers are offloaded), run for
    every micro-batch and the pipeline's fill and drain, and ``once``, ``once_per_step``'s. The result holds both
    dicts, which its callers keep per value of the fields each reads and never change."""
    return StepTerms(stage, microbatches, (pp - 1) / vpp, once)


def offload_seconds(spec: ModelSpec, x: TimeInputs, links: Links, stage: dict[str, float]) -> float:
    """Per micro-batch of the slowest stage (its terms ``stage``), the activation offload copies not hidden: each
    offloaded layer's activations go out in forward and come back in backward, behind the next layer's compute."""
    layers = max(1, sum(n for _, n in stage_layer_kinds(spec, x.pp, x.vpp, split=x.split)[0]))
    copy = x.offload_bytes_per_layer / links.host
    busy = sum(stage.values())
    return 2 * x.offload_layers * max(0.0, copy - busy / layers)


def once_per_step(spec: ModelSpec, x: TimeInputs, device: Device, links: Links, dense: int, expert: int,
                  constants: EstimatorConstants) -> dict[str, float]:
    """The terms paid once per step (``StepTerms.step``): pipeline point-to-point, the DP and EDP gradient reduce
    and parameter gather, the optimizer step; ``dense`` and ``expert``: the largest stage's parameters of each kind.
    Of ``x`` it reads the micro-batches and their size, PP, VPP, TP, SP, CP, DP, EDP, the precision, the distributed
    optimizer, FSDP and the grad-reduce overlap; of ``links`` PP, DP and EDP."""
    tokens = x.mbs * x.seq_length / x.cp  # per micro-batch on one CP rank
    act_bytes = 4 if x.precision == "fp32" else 2
    step: dict[str, float] = {}
    if x.pp > 1:
        p2p = tokens * spec.hidden_size * act_bytes / (x.tp if x.sp else 1)
        # forward activations + backward gradients, one send per micro-batch and model chunk each way
        step[PP_P2P] = 2 * x.num_microbatches * x.vpp * (p2p / links.pp + links.latency)

    grad_bytes = 2 if x.precision == "fp16" else 4
    param_bytes = 4 if x.precision == "fp32" else 2
    dense_group = x.dp * x.cp

    def sharded(nbytes: int) -> tuple[float, float]:  # one reduce-scatter or all-gather of every parameter, DP / EDP
        return (ring(dense * nbytes, dense_group, links.dp, links.latency),
                ring(expert * nbytes, x.edp, links.edp, links.latency))

    if x.fsdp in ("optim_grads", "optim_grads_params"):
        # Megatron-FSDP reduce-scatters the gradients after every micro-batch's backward (grad_reduce_every_bprop);
        # optim_grads_params also all-gathers each layer's weights before its forward and again before its backward,
        # optim_grads once after the optimizer step.
        gathers = 2 * x.num_microbatches if x.fsdp == "optim_grads_params" else 1
        passes = [(x.num_microbatches, grad_bytes), (gathers, param_bytes)]
    elif x.distributed_optimizer:  # reduce-scatter grads + all-gather updated params (Megatron-FSDP's optim too)
        passes = [(1, grad_bytes), (1, param_bytes)]
    else:  # all-reduce = reduce-scatter + all-gather of the grads
        passes = [(2, grad_bytes)]
    exposed = 1 - (constants.dp_comm_overlap if x.overlap_grad_reduce else 0.0)
    for count, nbytes in passes:
        dense_s, expert_s = sharded(nbytes)
        step[DP] = step.get(DP, 0.0) + count * dense_s * exposed
        step[EDP] = step.get(EDP, 0.0) + count * expert_s * exposed
    sharded_params: float = dense + expert
    if x.distributed_optimizer or x.fsdp:
        sharded_params = dense / max(1, dense_group) + expert / max(1, x.edp)
    step[OPTIMIZER] = sharded_params * OPTIMIZER_BYTES_PER_PARAM / (device.memory_tbs * 1e12)
    return step


def expert_dispatch(spec: ModelSpec, x: TimeInputs, links: Links, local: float, recomputed: bool,
                    constants: EstimatorConstants) -> float:
    """Seconds per micro-batch one MoE block spends exchanging tokens: dispatch and combine, forward and backward
    (recomputing the layer exchanges them once more), ``local`` bytes of hidden states entering the dispatcher on
    each rank. What crosses a node goes at the NIC's bandwidth while what stays in it goes over NVLink at the same
    time; routing is taken as uniform over the experts (what the load-balancing loss aims at).

    - alltoall (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher): permutes one copy of
      a token per selected expert (num_out_tokens = tokens x top-k, no merging of experts on one rank) and sends each
      copy to its expert's EP rank; the ETP ranks then all-gather what arrived and reduce-scatter it back.
    - flex (MoEFlexTokenDispatcher over the ETP x EP group; fused_a2a.py, DeepEP / HybridEP): sends a token once to
      each rank holding one of its experts (DeepEP's is_token_in_rank) and, across nodes, once to each node (its
      num_tokens_per_rdma_rank), where the receiving GPU forwards it over NVLink; the kernels reach
      ``flex_comm_efficiency`` of the link instead of NCCL's ``comm_efficiency``.
    - allgather (MoEAllGatherTokenDispatcher): every token of the ETP x EP group to every rank of it (NCCL's
      all-gather) and a reduce-scatter back."""
    passes = EP_ALL_TO_ALLS_PER_BLOCK + (2 if recomputed else 0)
    intra, inter = dispatch_copies(x.dispatcher, spec.num_moe_experts or 1, spec.moe_router_topk, x.ep, x.etp,
                                   links.ep_ranks_per_node)
    group = x.ep * x.etp if x.dispatcher == "allgather" else x.ep
    one_pass = (max(intra * local / links.intra if intra else 0.0, inter * local / links.inter if inter else 0.0)
                + (group - 1) * links.latency)
    if x.dispatcher == "allgather":
        return passes * one_pass
    if x.dispatcher == "flex":
        return passes * one_pass * constants.comm_efficiency / constants.flex_comm_efficiency
    routed = spec.moe_router_topk * local  # what the ETP ranks gather: the routed copies this rank's EP rank received
    return passes * one_pass + TP_RING_PASSES_PER_BLOCK * ring(routed * x.etp, x.etp, links.etp, links.latency)


def dispatch_copies(dispatcher: str, experts: int, topk: int, ep: int, etp: int, per_node: int,
                    ) -> tuple[float, float]:
    """Copies of one token a rank moves per dispatch (or combine) pass, as (over NVLink, over its NIC).
    ``per_node``: ranks of the EP group on one node (``ep_ranks_per_node``); the group spans EP / per_node nodes, each
    holding experts / nodes of the experts."""
    nodes = max(1, math.ceil(ep / per_node))
    group_per_node = min(per_node * etp, ep * etp)  # ranks of the ETP x EP group on one node
    if dispatcher == "allgather":
        # A ring all-gather brings each other rank's tokens once. NCCL runs one ring per NIC, each entering a node
        # through its own NIC, so every token from another node crosses into this one once, spread over its NICs;
        # the rest of the ring's traffic is NVLink.
        group = ep * etp
        across = (group - group_per_node) / group_per_node
        return group - 1 - across, across
    if dispatcher != "flex":  # one copy per selected expert, to the rank holding it
        return topk * (per_node - 1) / ep, topk * (ep - per_node) / ep
    # One copy per rank holding a selected expert (each of its ETP ranks), one per other node holding any.
    ranks_hit = ep * etp * (1 - _unselected(experts, topk, experts // ep))
    nodes_hit = (nodes - 1) * (1 - _unselected(experts, topk, experts // nodes))
    # By symmetry a rank forwards over NVLink as many copies as it receives from other nodes: its NVLink traffic is
    # every selected rank's share that is on its node and not itself.
    return ranks_hit * (group_per_node - 1) / group_per_node, nodes_hit


@lru_cache(maxsize=256)
def _unselected(experts: int, topk: int, held: int) -> float:
    """Probability that none of a token's top-k experts (distinct, uniform) is among ``held`` given ones."""
    return math.comb(experts - held, topk) / math.comb(experts, topk)


def _exposed_launches(block: str, gpu_s: float, cuda_graph: str, constants: EstimatorConstants,
                      relaunch: float = 1.0) -> float:
    """Seconds per micro-batch the GPU waits for the host to launch one block's kernels: the launch time beyond the
    block's own GPU time. CUDA graphs launch their scopes' kernels as one: local and full-iteration graphs every
    block's, TE graphs the scopes they name."""
    return max(0.0, relaunch * _launched_kernels(block, cuda_graph) * constants.kernel_launch_us * 1e-6 - gpu_s)


@lru_cache(maxsize=256)
def _launched_kernels(block: str, cuda_graph: str) -> int:
    """Launches the host makes for one block per micro-batch: its ungraphed scopes' kernels, one per graph."""
    graphed = graphed_scopes(cuda_graph)
    scopes = [scope for scope, owner in SCOPE_BLOCK.items() if owner == block]
    kernels = sum(KERNELS_PER_SCOPE[scope] for scope in scopes if scope not in graphed)
    return kernels + any(scope in graphed for scope in scopes)  # the graph's own launch
