"""Per-rank memory: parameters placed by the pipeline split, model-state bytes and activations per micro-batch.

Parameters are exact (``sweeper.models.params`` mirrors Megatron-Core's modules). Model state follows
Megatron's mixed-precision recipe and the run settings (``sweeper.config.run_settings``, the YAML's ``run:``): BF16/FP16
weights in the DDP parameter buffer, main gradients in the DDP grad buffer (FP32 or BF16: ``grad_reduce_in_fp32``),
FP32 master weights and two Adam moments (FP32, or the precision-aware optimizer's dtypes) in the optimizer, sharded
by the distributed optimizer over DP*CP (dense) and EDP (experts), less what is offloaded to the host. Under FP8 and
MXFP8, Transformer Engine's quantised weight copies are counted per recipe and device (``fp8_weight_bytes``).

Activations count the tensors autograd keeps per micro-batch and block (the accounting of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", adapted to flash attention, GQA/MLA, MoE token
replication and Megatron's fused Mamba path), with the TP/SP/CP divisors that apply to each tensor. Megatron's
selective recompute modules (core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts) drop what they
recompute; the layer being rebuilt in backward is a transient. Checked against published runs by
``benchmarks/estimate_accuracy.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from types import MappingProxyType
from typing import TypeVar

from sweeper.config.estimator import EstimatorConstants
from sweeper.config.run_settings import RunSettings
from sweeper.models.params import (
    ShardParams,
    block_params,
    embedding_params,
    mtp_extra_params,
    output_params,
    padded_vocab_size,
)
from sweeper.models.spec import Block, ModelSpec
from sweeper.space.axes import QUANTIZED, SCOPE_BLOCK, precision_dtype
from sweeper.space.layout import PipelineSplit, graphed_scopes, recompute_modules
from sweeper.space.pipeline import LayerKind, mtp_rank, stage_layer_kinds

T = TypeVar("T")

BF16_BYTES = 2
FP32_BYTES = 4
# Flash attention keeps one FP32 log-sum-exp per head and token for its backward.
FLASH_LSE_BYTES = FP32_BYTES
# NVFP4: a 4-bit E2M1 value plus one E4M3 scale byte per 16-element block (TE's NVFP4BlockScaling).
NVFP4_BYTES = 0.5 + 1 / 16
# The router keeps FP32 logits and FP32 probabilities per token and expert.
ROUTER_BYTES_PER_SCORE = 2 * FP32_BYTES


# -- parameters per pipeline rank --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds (summed over its virtual stages)."""

    layers: ShardParams
    embedding: int  # word (+ position) embedding, first stage only
    output: int  # final norm + output layer (or the tied copy), last stage only
    largest_layer: int = 0  # the biggest decoder layer's parameters on this rank (Megatron-FSDP's unit)

    @property
    def dense(self) -> int:
        return self.layers.dense + self.embedding + self.output

    @property
    def expert(self) -> int:
        return self.layers.expert

    @property
    def total(self) -> int:
        return self.dense + self.expert


@lru_cache(maxsize=4096)
def stage_params(
    spec: ModelSpec,
    tp: int,
    pp: int,
    vpp: int = 1,
    ep: int = 1,
    etp: int = 1,
    first: int | None = None,
    last: int | None = None,
    local_spec: bool = False,
    split: PipelineSplit | None = None,
) -> tuple[StageParams, ...]:
    """Parameters of one rank of each pipeline stage (all TP/EP ranks of a stage hold the same count).
    ``split`` (``Layout.split``) replaces ``first``/``last`` with all of Megatron's pipeline-split options."""
    out = []
    holder = mtp_rank(spec, pp, split)
    per_kind: dict[tuple, ShardParams] = {}  # one layer of each kind (integers: the sum is the same however kept)
    for rank, kinds in enumerate(stage_layer_kinds(spec, pp, vpp, first, last, split)):
        layers, largest = ShardParams(), 0
        for kind, n in kinds:
            layer = per_kind.get(kind)
            if layer is None:
                layer = ShardParams()
                for block in kind:
                    layer = layer + block_params(spec, block, tp, ep, etp, local_spec)
                per_kind[kind] = layer
            layers = layers + layer.scaled(n)
            largest = max(largest, layer.total if n else 0)
        if rank == holder:  # MTP's own norms and eh_proj; its stage builds an embedding copy unless it is the first
            layers = layers + ShardParams(dense=spec.mtp_num_layers * mtp_extra_params(spec, tp))
        out.append(
            StageParams(
                layers=layers,
                embedding=embedding_params(spec, tp) if rank == 0 or (rank == holder and pp > 1) else 0,
                output=output_params(spec, tp, pp) if rank == pp - 1 else 0,
                largest_layer=largest,
            )
        )
    return tuple(out)


# -- model state ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    weights: float
    grads: float
    optimizer: float
    fp8_weights: float
    # FP32 copies of the main grads the optimizer makes for its step when the grad buffer is BF16/FP16
    # (``optimizer_grad_copy_bytes``): alive from the step to the next zero_grad, not during forward/backward.
    grad_copies: float = 0.0


def weight_bytes_per_param(precision: str) -> int:
    return FP32_BYTES if precision == "fp32" else BF16_BYTES


def _columnwise_copy(recipe: str, compute_capability: str | None) -> bool:
    """Whether TE keeps a second (transposed / column-wise) FP8 copy of a weight for the backward GEMMs.

    Per-tensor scaling (delayed, tensorwise) needs a transpose only where FP8 GEMMs take the TN layout alone:
    TE 2.9 transformer_engine/pytorch/utils.py ``is_non_tn_fp8_gemm_supported`` is true for compute capability
    10.x-11.x and >= 13.0, so Hopper/Ada (9.0, 8.9) and the 12.x Blackwell parts (RTX PRO 6000, 5090) keep one
    (csrc/quantizer.cpp: ``with_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported()``).
    Blockwise and MXFP8 scale along rows and columns separately, so a column-wise copy always exists."""
    if recipe in ("blockwise", "mxfp8"):
        return True
    if compute_capability is None:
        return True  # unknown device: the conservative (Hopper) answer
    major, _, minor = compute_capability.partition(".")
    cc = (int(major), int(minor or 0))
    return not ((10, 0) <= cc < (12, 0) or cc >= (13, 0))


def fp8_weight_bytes(precision: str, constants: EstimatorConstants, compute_capability: str | None,
                     run: RunSettings = RunSettings(), *, distributed_optimizer: bool = True) -> tuple[float, float]:
    """(bytes of the model weight, bytes of TE's extra quantised copies) per linear-layer parameter under FP8.

    Without --fp8-param-gather the weight stays BF16 in DDP's param buffer and TE caches its FP8 workspace across
    the micro-batches of a step: Megatron's TE wrappers pass ``is_first_microbatch`` (megatron/core/extensions/
    transformer_engine.py TELinear.forward; reset by schedules.py ``set_is_first_microbatch``), so TE 2.9
    module/base.py ``get_weight_workspace`` keeps the quantised weight in ``self._fp8_workspaces`` with row-wise
    (forward) and column-wise (dgrad) usage: 1 byte, plus 1 for the column-wise copy where one exists
    (``_columnwise_copy``). MXFP8 adds one E8M0 scale per 32 elements to each copy. Blockwise's 128x128 weight
    scales and delayed scaling's amax histories (1024 FP32 values x 5 per GEMM: ~20 KiB per linear, ~15 MiB for
    a 30B MoE on EP8) are below 0.1% and not counted.
    With --fp8-param-gather the parameter itself is the FP8 tensor (DDP's param buffer is uint8,
    distributed_data_parallel.py: ``param_dtype = torch.uint8`` for Float8Tensor) and there is no separate cache:
    1 byte plus the column-wise copy TE adds to the parameter. MXFP8 parameters with Megatron's
    reuse_grad_buf_for_mxfp8_param_ag (which Bridge requires for them) keep their BF16 all-gather copy in the grad
    buffer (param_and_grad_buffer.py ``shared_buffer``), so only the MXFP8 row-wise and column-wise data remain."""
    if constants.fp8_weight_cache_bytes_per_param is not None:
        return float(BF16_BYTES), constants.fp8_weight_cache_bytes_per_param
    if precision == "nvfp4":
        # Megatron-Bridge's bf16_with_nvfp4_mixed keeps BF16 parameters (fp4_param off); TE caches the NVFP4 weight
        # row-wise and column-wise, each 0.5 byte plus one E4M3 scale per 16 elements.
        return float(BF16_BYTES), 2 * NVFP4_BYTES
    recipe = run.recipe(precision, compute_capability) or "delayed"
    scales = 1 / 32 if recipe == "mxfp8" else 0.0
    copy = 1.0 + scales
    second = copy if _columnwise_copy(recipe, compute_capability) else 0.0
    if not run.fp8_params(precision, compute_capability, distributed_optimizer=distributed_optimizer):
        return float(BF16_BYTES), copy + second
    if recipe == "mxfp8":
        return 0.0, copy + second
    return copy, second


def optimizer_grad_copy_bytes(precision: str, run: RunSettings = RunSettings()) -> int:
    """Bytes per optimizer-owned parameter of the FP32 gradient the optimizer step allocates.

    megatron/core/optimizer/distrib_optimizer.py ``_copy_model_grads_to_main_grads`` (and optimizer.py's
    Float16OptimizerWithFloat16Params likewise) sets ``shard_main_param.grad = shard_model_grad.float()``: a new
    FP32 tensor when the grad buffer is BF16/FP16, the buffer itself (no copy) when it is FP32. ``zero_grad``
    (set_to_none) frees them at the start of the next iteration, so they are alive between steps and in the
    step, never together with activations. The precision-aware optimizer reads ``decoupled_grad``, a view."""
    if run.precision_aware_optimizer:
        return 0
    return 0 if run.grad_buffer_fp32(precision) else FP32_BYTES


def optimizer_bytes_per_param(precision: str, run: RunSettings = RunSettings()) -> float:
    """Adam's two moments (``run.moment_bytes``: FP32 unless the precision-aware optimizer says otherwise), plus the
    FP32 master weights whenever the model weights are not FP32 already. The precision-aware optimizer's master
    weights are counted as FP32 (megatron-core keeps them so on every path but TE FusedAdam's int16 remainders under
    the delayed recipe, which saves 2 bytes: the conservative side)."""
    return run.moment_bytes + (0 if precision == "fp32" else FP32_BYTES)


# Megatron-FSDP's unsharded decoder layers alive at once: the one computing and the one its all-gather pipeline
# prefetches (or, for gradients, the one reduce-scattering while the next is produced).
FSDP_LAYERS_IN_FLIGHT = 2


@lru_cache(maxsize=65536)  # plan: the same stage state for every micro-batch, recompute and SP choice
def model_state_bytes(
    params: StageParams,
    precision: str,
    distributed_optimizer: bool,
    dense_shards: int,
    expert_shards: int,
    constants: EstimatorConstants,
    compute_capability: str | None = None,
    run: RunSettings = RunSettings(),
    fsdp: str | None = None,
) -> StateBytes:
    """Bytes of weights, grads and optimizer state on one rank (device memory). ``dense_shards`` is DP*CP and
    ``expert_shards`` is EDP: the groups the distributed optimizer (and Megatron-FSDP) shard over.
    ``compute_capability`` decides TE's FP8 weight copies (None: a Hopper-like device). The offloaded fraction of the
    optimizer shard (``run.offloaded_fraction``) and of its FP32 grad copies lives on the host.

    ``fsdp`` (Layout.fsdp): Megatron-FSDP's sharding strategy. ``optim`` shards what the distributed optimizer
    does. ``optim_grads`` also shards the grad buffer: gradients are reduce-scattered after every backward
    (megatron_fsdp.py ``grad_reduce_every_bprop``), so only the layers being reduced are whole. ``optim_grads_params``
    also shards the weights: each decoder layer (its FSDP unit, mcore_fsdp_adapter.py) is all-gathered before it
    runs and released after; the embedding and output layer are not units and are counted whole (the conservative
    side). TE's quantised weight copies are counted whole as without FSDP."""
    total = params.total
    sharded = params.dense / dense_shards + params.expert / expert_shards
    owned = sharded if distributed_optimizer else total
    on_device = owned * (1.0 - run.offloaded_fraction)
    optimizer = optimizer_bytes_per_param(precision, run) * on_device
    in_flight = FSDP_LAYERS_IN_FLIGHT * params.largest_layer
    layers = float(params.layers.total)  # decoder-layer weights resident on the device
    if fsdp == "optim_grads_params":
        layers = min(layers, params.layers.dense / dense_shards + params.layers.expert / expert_shards + in_flight)
    grad_params = min(total, sharded + in_flight) if fsdp in ("optim_grads", "optim_grads_params") else total
    weights = float(weight_bytes_per_param(precision) * (layers + params.embedding + params.output))
    fp8 = 0.0
    if precision in QUANTIZED:
        # Transformer Engine quantises linear-layer weights only: embeddings, output layer and norms stay BF16.
        weight_bytes, extra = fp8_weight_bytes(precision, constants, compute_capability, run,
                                               distributed_optimizer=distributed_optimizer)
        weights += (weight_bytes - BF16_BYTES) * layers
        fp8 = extra * params.layers.total
    return StateBytes(
        weights=weights,
        grads=(FP32_BYTES if run.grad_buffer_fp32(precision) else BF16_BYTES) * grad_params,
        optimizer=optimizer,
        fp8_weights=fp8,
        grad_copies=optimizer_grad_copy_bytes(precision, run) * on_device,
    )


# -- activations ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationShape:
    """Everything activation sizes depend on besides the model."""

    tokens: int  # micro-batch tokens on this CP rank: mbs * seq / CP
    mbs: int
    tp: int
    sp: bool
    cp: int
    ep: int
    etp: int
    precision: str
    recompute: str
    seq_length: int  # whole sequence (the keys each query attends to)
    unfused_attention: bool = False
    softmax_in_fp32: bool = False  # unfused attention's torch softmax (no fused kernel) keeps an FP32 output too
    hidden_dropout: bool = False
    attention_dropout: bool = False
    hot_rank_factor: float = 1.0  # busiest EP rank's routed tokens over the mean (EstimatorConstants, calibration)
    dispatcher: str = "alltoall"  # Megatron's moe_token_dispatcher_type (Layout.dispatcher)
    cuda_graph: str = "none"  # Layout.cuda_graph
    fp8_recipe: str | None = None  # RunSettings.recipe of the precision on this device (None: not FP8)

    @property
    def modules(self) -> tuple[str, ...]:
        """Megatron's selective recompute modules (empty for none and full)."""
        return recompute_modules(self.recompute)

    @property
    def seq_div(self) -> int:
        """Divisor of tensors outside the TP region: sharded by SP, replicated without it."""
        return self.tp if self.sp else 1

    @property
    def act_bytes(self) -> int:
        return FP32_BYTES if self.precision == "fp32" else BF16_BYTES

    @property
    def linear_input_bytes(self) -> float:
        """Tensors kept only as a linear layer's input are kept quantised by TE for the weight-gradient GEMM: 1 byte
        under FP8, NVFP4's 0.5 byte and block scale under NVFP4."""
        if self.precision == "nvfp4":
            return NVFP4_BYTES
        if precision_dtype(self.precision) not in ("fp8", "mxfp8"):
            return float(self.act_bytes)
        # The block-scaled recipes keep a scale per block of the saved (column-wise) copy: MXFP8 one E8M0 byte per
        # 32 elements, blockwise one FP32 per 1x128 block; per-tensor scaling one scale for the whole tensor.
        return 1.0 + {"mxfp8": 1 / 32, "blockwise": FP32_BYTES / 128}.get(self.fp8_recipe or "", 0.0)


def _norm_and_linear_input(spec: ModelSpec, s: ActivationShape, separate_norm: bool = False) -> float:
    """A block's input (kept for the norm's backward) and the norm's output (kept for the first linear).

    ``separate_norm``: the norm is its own module (TE fuses it into the first linear elsewhere), so the
    ``layernorm`` recompute module discards its output and recomputes it in backward."""
    kept = s.act_bytes + (0.0 if separate_norm and "layernorm" in s.modules else s.linear_input_bytes)
    return s.tokens * spec.hidden_size * kept / s.seq_div


def attention_activation(spec: ModelSpec, s: ActivationShape) -> float:
    t, a, tp = s.tokens, spec.num_attention_heads, s.tp
    b = s.act_bytes
    # MLA's input norm is a separate TENorm (its down projections are plain linears); GQA's is fused.
    out = _norm_and_linear_input(spec, s, separate_norm=spec.multi_latent_attention)
    if spec.multi_latent_attention:
        q_head = spec.qk_head_dim + spec.qk_pos_emb_head_dim
        # Latents are computed whole on every TP rank (TE keeps the down projections unsplit): kv latent
        # (norm input) and its normalised copy (up-projection input); the same for the query latent.
        latent = spec.kv_lora_rank + spec.qk_pos_emb_head_dim
        out += t * (b * latent + s.linear_input_bytes * spec.kv_lora_rank)
        if spec.q_lora_rank is not None:
            out += t * (b + s.linear_input_bytes) * spec.q_lora_rank
        # kv up-projection output (V is a view of it), the assembled Q and K with RoPE (discarded and recomputed
        # under the mla_up_proj module), attention output.
        if "mla_up_proj" not in s.modules:
            out += t * b * a * ((spec.qk_head_dim + spec.v_head_dim) + 2 * q_head) / tp
        out += t * b * a * spec.v_head_dim / tp
    else:
        d, g = spec.head_dim, spec.query_groups
        # Q, K, V as the attention core keeps them (unfused attention repeats K and V to every head first), and
        # its output (also the projection's input).
        kv_heads = a if s.unfused_attention else g
        out += t * b * (a * d + 2 * kv_heads * d + a * d) / tp
    if "core_attn" not in s.modules:  # the core_attn recompute module re-runs the attention core instead
        if s.unfused_attention:
            # The softmax output for the score-times-V GEMM; with attention dropout also its mask and output. The
            # torch softmax in FP32 keeps its FP32 output for its own backward beside the copy the GEMM keeps.
            per_score = b + (FP32_BYTES if s.softmax_in_fp32 else 0) + (1 + b if s.attention_dropout else 0)
            out += t * a / tp * s.seq_length * per_score
        else:
            out += t * a * FLASH_LSE_BYTES / tp
    return out


def _mlp_activation(spec: ModelSpec, s: ActivationShape, ffn: float, tokens: float, parts: int) -> float:
    """fc1 output (the activation's input) and the activation's output (fc2's input)."""
    fc1 = ffn * (2 if spec.gated_linear_unit else 1)
    return tokens * (s.act_bytes * fc1 + s.linear_input_bytes * ffn) / parts


def mlp_activation(spec: ModelSpec, s: ActivationShape) -> float:
    """The mlp recompute module checkpoints the MLP: only its input (the norm's output) is kept."""
    out = _norm_and_linear_input(spec, s)
    if "mlp" not in s.modules:
        out += _mlp_activation(spec, s, spec.ffn_hidden_size, s.tokens, s.tp)
    return out


def routed_tokens(spec: ModelSpec, s: ActivationShape) -> float:
    """Token copies this rank's experts process per micro-batch: its own (SP-sharded) tokens times top-k, gathered
    across the ETP group, times how much more the busiest EP rank receives than the mean (``hot_rank_factor``)."""
    return s.tokens / s.seq_div * spec.moe_router_topk * s.etp * hot_rank_factor(spec, s)


def hot_rank_factor(spec: ModelSpec, s: ActivationShape) -> float:
    """Routed tokens on the busiest EP rank over the mean. Dropless MoE sizes its buffers by what a rank receives,
    so the peak follows the hottest rank, not the mean. Bounded by physics: a rank's E/EP local experts take each
    token at most min(top-k, E/EP) times, from all EP ranks. With EP 1 every expert is local: no imbalance."""
    if s.ep == 1 or spec.num_moe_experts is None:
        return 1.0
    k, local = spec.moe_router_topk, spec.num_moe_experts // s.ep
    return min(s.hot_rank_factor, s.ep * min(k, local) / k)


def moe_activation(spec: ModelSpec, s: ActivationShape) -> float:
    assert spec.num_moe_experts is not None
    h = spec.hidden_size
    # The pre-MLP norm of a MoE layer is a separate module (nothing to fuse it into).
    out = _norm_and_linear_input(spec, s, separate_norm=True)
    if "moe" in s.modules:  # the whole MoE layer is checkpointed: its input is all it keeps
        return out
    out += s.tokens / s.seq_div * spec.num_moe_experts * ROUTER_BYTES_PER_SCORE
    routed = routed_tokens(spec, s)
    # Permuted expert input, expert MLP internals, expert output kept for the combine's probability gradient.
    out += routed * h * (s.linear_input_bytes + s.act_bytes)
    ffn = spec.expert_ffn_hidden_size
    fc1 = ffn * (2 if spec.gated_linear_unit else 1)
    # moe_act discards the activation's output (fc2's input) and recomputes it in backward.
    act_out = 0.0 if "moe_act" in s.modules else s.linear_input_bytes * ffn
    out += routed * (s.act_bytes * fc1 + act_out) / s.etp
    if spec.moe_shared_expert_intermediate_size and "shared_experts" not in s.modules:
        out += _mlp_activation(spec, s, spec.moe_shared_expert_intermediate_size, s.tokens, s.tp)
    return out


def mamba_activation(spec: ModelSpec, s: ActivationShape) -> float:
    """Megatron's fused Mamba path keeps the in_proj output (z, x, B, C, dt), the scan output before the gated
    norm and the norm's output (out_proj input); convolution and chunk states are recomputed in backward."""
    heads, groups, state = spec.mamba_heads, spec.mamba_num_groups, spec.mamba_state_dim
    d_inner = heads * spec.mamba_head_dim
    out = _norm_and_linear_input(spec, s)
    out += s.tokens * s.act_bytes * (2 * d_inner + 2 * groups * state + heads) / s.tp
    out += s.tokens * (s.act_bytes + s.linear_input_bytes) * d_inner / s.tp
    return out


_BLOCK_ACTIVATION = {
    "attention": attention_activation,
    "mlp": mlp_activation,
    "moe": moe_activation,
    "mamba": mamba_activation,
}


def block_activation(spec: ModelSpec, block: Block, s: ActivationShape) -> float:
    """Bytes one block keeps for backward per micro-batch, without recomputation of the whole layer."""
    out = _BLOCK_ACTIVATION[block](spec, s)
    if s.hidden_dropout:  # the bias-dropout-add's mask, one byte per element of the block's output
        out += s.tokens * spec.hidden_size / s.seq_div
    return out


def layer_input_bytes(spec: ModelSpec, s: ActivationShape) -> float:
    """What full recomputation keeps per layer: the layer's input (the recompute checkpoint)."""
    return s.tokens * spec.hidden_size * s.act_bytes / s.seq_div


def dispatch_buffer_bytes(spec: ModelSpec, s: ActivationShape, constants: EstimatorConstants) -> float:
    """What a MoE layer's token dispatcher holds while the layer runs. alltoall and flex send each token's routed
    copies: the permuted send buffer and the received buffer (``moe_dispatch_buffer_copies`` of the routed tokens).
    allgather (MoEAllGatherTokenDispatcher) gathers every token of the expert-tensor x expert-parallel group's
    ranks before picking its experts' (token_dispatcher.py ``gather_from_sequence_parallel_region`` over
    ``tp_ep_group``): the gathered hidden states, then the permuted copy of the routed ones."""
    routed = routed_tokens(spec, s) * spec.hidden_size * s.act_bytes
    if s.dispatcher == "allgather":
        gathered = s.tokens / s.seq_div * s.ep * s.etp * spec.hidden_size * s.act_bytes
        return gathered + routed
    return constants.moe_dispatch_buffer_copies * routed


@dataclass(frozen=True)
class StageActivations:
    per_microbatch: float  # bytes kept per micro-batch by all of this rank's layers (all virtual stages)
    transient: float  # bytes alive for one layer at a time (full-recompute working set, MoE dispatch buffers)
    logits: float  # last stage: one micro-batch's logits/loss path and the output layer's input
    layers: int = 1  # decoder layers on this rank (all virtual stages)
    graph_static: float = 0.0  # per micro-batch: CUDA graphs' static input/output buffers (graph_static_bytes)


@dataclass(frozen=True)
class LayerActivations:
    """What one layer of each block kind keeps for backward per micro-batch: independent of the pipeline split, so
    the layouts that differ only in PP, VPP or split share it."""

    blocks: Mapping[Block, float]  # bytes each block kind keeps
    rebuilt: Mapping[Block, float]  # what its selective recomputation rebuilds during its backward (empty: none)
    kept_per_layer: float  # what full recomputation keeps per layer
    dispatch: float  # a MoE layer's token dispatcher buffers
    # Each layer kind's (blocks' bytes kept, bytes rebuilt) as its stages ask for them: the stages of every pipeline
    # of this shape are made of a few kinds (``of_kind``)
    kinds: dict[LayerKind, tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def of_kind(self, kind: LayerKind) -> tuple[float, float]:
        """What one layer of ``kind`` keeps for backward, and what its selective recomputation rebuilds."""
        kept = self.kinds.get(kind)
        if kept is None:
            kept = self.kinds[kind] = (sum(self.blocks[b] for b in kind), sum(self.rebuilt.get(b, 0.0) for b in kind))
        return kept


@lru_cache(maxsize=65536)
def layer_activations(spec: ModelSpec, s: ActivationShape, constants: EstimatorConstants) -> LayerActivations:
    kinds_used = spec.block_counts.keys()
    blocks = {b: block_activation(spec, b, s) for b in kinds_used}
    rebuilt = {}
    if s.modules:
        plain = replace(s, recompute="none")
        rebuilt = {b: block_activation(spec, b, plain) - blocks[b] for b in kinds_used}
    dispatch = dispatch_buffer_bytes(spec, s, constants) if spec.is_moe else 0.0
    return LayerActivations(MappingProxyType(blocks), MappingProxyType(rebuilt), layer_input_bytes(spec, s), dispatch)


# A pipeline stage as far as its memory and step time go: its layers of each kind (``stage_layer_kinds``), whether it
# holds the MTP layers, whether it is the last (the output layer).
StageRole = tuple[tuple[tuple[LayerKind, int], ...], bool, bool]


@dataclass(frozen=True)
class PipelineStages:
    """A pipeline's stages: the distinct roles, first rank's first, and the one each rank plays. Ranks of one role
    have the same activations and step time, so each is priced once."""

    roles: tuple[StageRole, ...]
    of_rank: tuple[int, ...]

    def per_rank(self, per_role: list[T]) -> tuple[T, ...]:
        """Each rank's value, of ``per_role``: one value per role."""
        return tuple([per_role[i] for i in self.of_rank])


def pipeline_stages(spec: ModelSpec, pp: int, vpp: int, split: PipelineSplit) -> PipelineStages:
    """The stages of ``spec`` split over ``pp`` ranks of ``vpp`` virtual stages as ``split`` says."""
    holder = mtp_rank(spec, pp, split)
    ranks = [(kinds, rank == holder, rank == pp - 1)
             for rank, kinds in enumerate(stage_layer_kinds(spec, pp, vpp, split=split))]
    roles = list(dict.fromkeys(ranks))
    return PipelineStages(tuple(roles), tuple(roles.index(r) for r in ranks))


# Not cached here: the Estimator keeps each result per value of the layout fields it depends on, so a cache would
# only hash the model spec and the shape again on every call.
def stage_activations(
    spec: ModelSpec,
    s: ActivationShape,
    per_layer: LayerActivations,
    pipeline: PipelineStages,
    constants: EstimatorConstants,
    stages: dict[StageRole, StageActivations] | None = None,
) -> tuple[StageActivations, ...]:
    """Each pipeline rank's activations, of ``per_layer``, ``layer_activations(spec, s, constants)``. ``stages``:
    each stage's by its role, kept by the caller for every call with the same ``s`` (pipelines of other depths
    repeat stages)."""
    if stages is None:
        stages = {}
    per_role = []
    for role in pipeline.roles:
        stage = stages.get(role)
        if stage is None:
            stage = stages[role] = _stage_activations(spec, s, per_layer, constants, *role)
        per_role.append(stage)
    return pipeline.per_rank(per_role)


def _stage_activations(spec: ModelSpec, s: ActivationShape, per_layer: LayerActivations,
                       constants: EstimatorConstants, kinds: tuple, holder: bool, last: bool) -> StageActivations:
    """One stage's activations (``stage_activations``): its layers of ``kinds``, the MTP layers' logits on their
    ``holder`` and the output layer's on the ``last`` rank."""
    per_kind = [(per_layer.of_kind(kind), n) for kind, n in kinds]  # ((kept, rebuilt), layers of the kind)
    layers, moe = _layers_and_moe(kinds)
    if s.recompute == "full":
        kept = layers * per_layer.kept_per_layer
        transient = max((k[0] for k, _ in per_kind), default=0.0)  # one layer rebuilt during its backward
    else:
        kept = sum(k[0] * n for k, n in per_kind)
        transient = max((k[1] for k, _ in per_kind), default=0.0)
    if moe:
        transient += per_layer.dispatch
    logits = 0.0
    if holder:  # each MTP layer's own logits and loss, kept for backward beside the model's
        logits += spec.mtp_num_layers * s.tokens * padded_vocab_size(spec, s.tp) / s.tp \
            * constants.logits_bytes_per_element
    if last:
        logits += s.tokens * padded_vocab_size(spec, s.tp) / s.tp * constants.logits_bytes_per_element
        # Final norm input and output (the output layer's input, gathered over SP for the vocab GEMM).
        logits += s.tokens * spec.hidden_size * s.act_bytes * (1 / s.seq_div + 1)
    return StageActivations(kept, transient, logits, layers, graph_static_bytes(spec, s, kinds, constants))


@lru_cache(maxsize=65536)
def _layers_and_moe(kinds: tuple[tuple[LayerKind, int], ...]) -> tuple[int, bool]:
    """A stage's decoder layers and whether a MoE block is among them (its kinds: the same in every shape)."""
    return sum(n for _, n in kinds), any("moe" in kind for kind, _ in kinds)


def graph_static_bytes(spec: ModelSpec, s: ActivationShape, kinds: tuple, constants: EstimatorConstants) -> float:
    """Per micro-batch, the static buffers CUDA graphs keep: a captured callable's inputs and outputs are tensors
    owned by the graph (TE make_graphed_callables keeps its sample inputs and static outputs; Megatron captures one
    graph per layer and micro-batch), ``cuda_graph_static_copies`` of the block's hidden state per graphed block.
    Counted for the micro-batches in flight (the estimator multiplies), assuming a finished micro-batch's buffers
    are reused as TE's reuse of graph input/output buffers does; local and full-iteration graphs capture every block,
    TE graphs their scopes' blocks."""
    graphed = _graphed_blocks(s.cuda_graph)
    if not graphed:
        return 0.0
    blocks = sum(n * sum(1 for b in kind if b in graphed) for kind, n in kinds)
    return constants.cuda_graph_static_copies * blocks * s.tokens * spec.hidden_size * s.act_bytes / s.seq_div


@lru_cache(maxsize=256)
def _graphed_blocks(cuda_graph: str) -> frozenset[str]:
    """The blocks a cuda_graph value's scopes capture (none without graphs): a handful of values per space."""
    return frozenset(SCOPE_BLOCK[scope] for scope in graphed_scopes(cuda_graph))


def in_flight_microbatches(rank: int, pp: int, vpp: int, num_microbatches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the rank's whole share
    of layers. 1F1B: rank i holds PP - i. Interleaved: Megatron warms up (PP - i - 1) * 2 + (VPP - 1) * PP
    virtual-stage chunks before its first backward, so it holds that many + 1 chunks of 1/VPP of its layers."""
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(pp - rank, num_microbatches))
    chunks = min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, num_microbatches * vpp)
    return chunks / vpp
