"""``estimate``: predicted peak per-GPU memory and step time of one Layout, the library call ``plan`` uses.

Memory is evaluated for one rank of every pipeline stage (TP/CP/EP ranks of a stage are symmetric) and the worst
is reported. ``memory_gib`` is what torch's caching allocator would reserve at the peak (the contract's
``peak_memory_gib`` is ``max_memory_reserved``): the model state (weights, grads, optimizer state, FP8 weight
copies) as allocated, plus the dynamic memory (in-flight activations, the last stage's logits, per-layer
transients) times the allocator fragmentation factor. Megatron allocates the state as a few large tensors made
once at start-up (DDP's ``_ParamAndGradBuffer`` holds every parameter and main gradient of a dtype in one
``torch.zeros(numel)`` each, megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBuffer.__init__``;
the distributed optimizer's FP32 main params and Adam moments are one tensor per parameter shard, made once and
kept, megatron/core/optimizer/distrib_optimizer.py ``_build_model_and_main_param_groups``), so the caching
allocator's slack lives among the many short-lived tensors of forward/backward only. ``fits`` also charges the
memory that lives outside torch's allocator (CUDA context, NCCL buffers), because the GPU must hold it too.

What each figure includes (and which the sources report): ``torch.cuda.max_memory_allocated`` is the peak of bytes
in live tensors; ``max_memory_reserved`` the peak of the segments the caching allocator holds from cudaMalloc
(allocated plus its cached free blocks; close to allocated with ``expandable_segments``); nvidia-smi shows reserved
plus what lives outside torch's allocator (the CUDA context and loaded kernels, NCCL's communicator buffers,
library workspaces not allocated through torch) and any other process on the GPU. Megatron's ``report_memory``
prints allocated / max allocated / reserved / max reserved; Megatron-LM's CI golden values log allocated and max
allocated; sweeper's GPU smoke run reports max reserved. ``benchmarks/estimate_accuracy.py`` keeps them apart.

Layouts whose sizes do not divide (dp == 0, layers not splitting over stages, heads not splitting over TP)
raise ValueError naming the problem; ``plan`` only calls ``estimate`` for layouts the rules accept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from operator import attrgetter
from typing import Any, Concatenate, NamedTuple, ParamSpec, cast

import numpy as np

from sweeper.config.estimator import CPU_RANK_EFFICIENCIES, EstimatorConstants
from sweeper.config.run_settings import RunSettings
from sweeper.config.schema import ClusterConfig, SweepConfig, memory_limit_gib
from sweeper.config.units import GIB
from sweeper.estimate.calibration import STATE_KEYS, STEP_KEYS, Calibration, dynamic_gib
from sweeper.estimate.devices import device_for
from sweeper.estimate.memory import (
    ActivationShape,
    LayerActivations,
    PipelineStages,
    StageActivations,
    StageParams,
    StageRole,
    StateBytes,
    in_flight_microbatches,
    layer_activations,
    model_state_bytes,
    pipeline_stages,
    stage_activations,
    stage_params,
)
from sweeper.estimate.rounding import rounded
from sweeper.estimate.step_time import (
    OFFLOAD,
    Links,
    StepTerms,
    TimeInputs,
    block_seconds,
    ep_ranks_per_node,
    group_bandwidth,
    offload_seconds,
    once_per_step,
    slowest_stage,
    step_time,
)
from sweeper.models.spec import Block, ModelSpec
from sweeper.space.layout import Layout


@dataclass(frozen=True)
class Estimate:
    memory_gib: float  # predicted peak per-GPU reserved memory, max over ranks
    fits: bool  # memory_gib + non-torch overhead <= (1 - headroom) * gpu_memory_gib
    step_time_s: float | None
    tokens_per_s: float | None
    breakdown: dict[str, float] = field(default_factory=dict)  # GiB per component on the worst rank
    # Where the measured peak may lie given the estimator's measured error (EstimatorConstants.memory_*_prediction)
    memory_band_gib: tuple[float, float] = (0.0, 0.0)
    may_fit: bool = True  # the band's lower end + non-torch overhead fits: never pruned as out of memory
    # The step time's terms before calibration (seconds = step_terms.seconds(step_factor)) and each term's calibrated
    # efficiency factor (1.0 uncalibrated)
    step_terms: StepTerms | None = None
    step_factor: Callable[[str], float] = field(default=lambda _: 1.0, repr=False, compare=False)

    @property
    def step_time_terms_s(self) -> dict[str, float]:
        """Seconds per step of each term of the (calibrated) step time: they sum to ``step_time_s``."""
        return self.step_terms.per_step(self.step_factor) if self.step_terms else {}

    @property
    def uncertain(self) -> bool:
        """Predicted over the limit, but inside the estimator's error band: launched as a calibration probe."""
        return self.may_fit and not self.fits

    def to_json(self) -> dict[str, Any]:
        """``memory_gib`` is torch's reserved peak; ``allocated_gib`` what ``torch.cuda.max_memory_allocated`` would
        show; ``memory_breakdown_gib`` the worst rank's components (its allocated parts, the allocator's
        fragmentation, and ``non_torch``: the CUDA context and NCCL buffers outside torch), as users compare them
        with their own torch.cuda figures."""
        sizes = [k for k in self.breakdown if k not in _NOT_GIB]
        values = [self.breakdown[k] for k in sizes]
        allocated = sum(v for k, v in zip(sizes, values) if k not in _NOT_ALLOCATED)
        terms = self.step_time_terms_s
        return estimates_json(
            memory=[self.memory_gib], breakdown=rounded_rows(sizes, [values], GIB_DIGITS), allocated=[allocated],
            fits=[self.fits], step_time=[self.step_time_s], terms=rounded_rows(list(terms), [list(terms.values())]),
            tokens=[self.tokens_per_s], band_low=[self.memory_band_gib[0]], band_high=[self.memory_band_gib[1]],
            may_fit=[self.may_fit])[0]


# Decimal places of an Estimate's JSON figures: GiB to the MiB, the step time to 0.1 ms and each of its terms to the
# microsecond, throughput to 0.1 token/s.
GIB_DIGITS, STEP_DIGITS, TERM_DIGITS, TOKENS_DIGITS = 3, 4, 6, 1


def _rounded(values: Column, digits: int) -> list[float | None]:
    if isinstance(values, np.ndarray):
        return rounded(values, digits)
    return [v if v is None else round(v, digits) for v in values]


def rounded_rows(names: Sequence[str], rows: Sequence[Sequence[float]] | np.ndarray,
                 digits: int = TERM_DIGITS) -> list[dict[str, float]]:
    """Each row of figures (one per name) as a dict of them rounded to ``digits``: an Estimate's memory breakdown,
    its ``step_time_terms_s`` (the default) as its JSON holds them."""
    width = len(names)
    flat = rows.ravel() if isinstance(rows, np.ndarray) else [v for row in rows for v in row]
    values = cast(list[float], _rounded(flat, digits))  # sizes and seconds, never NaN
    return [dict(zip(names, values[i * width:(i + 1) * width])) for i in range(len(rows))]


# A column of figures: a list, or a numpy array (``rounded`` then rounds it whole).
Column = Sequence[float | None] | np.ndarray


def estimates_json(memory: Column, breakdown: Sequence[dict[str, float]], allocated: Column, fits: Sequence[bool],
                   step_time: Column, terms: Sequence[dict[str, float]], tokens: Column, band_low: Column,
                   band_high: Column, may_fit: Sequence[bool]) -> list[dict[str, Any]]:
    """``Estimate.to_json`` of many Estimates from their figures given a column at a time (lists, or numpy arrays
    with NaN for a figure an Estimate has not got; ``breakdown`` and ``terms`` rounded already, ``rounded_rows``):
    a plan writes it for every valid layout from the term table's arrays (``Predictions.json_of``, issue 54).
    Rounded as Python's ``round`` rounds, whichever path calls it."""
    return [{"memory_gib": m, "allocated_gib": a, "memory_breakdown_gib": b, "fits": f, "step_time_s": s,
             "step_time_terms_s": t, "tokens_per_s": tps, "memory_band_gib": [lo, hi], "may_fit": may}
            for m, a, b, f, s, t, tps, lo, hi, may in zip(
                _rounded(memory, GIB_DIGITS), _rounded(allocated, GIB_DIGITS), breakdown, fits,
                _rounded(step_time, STEP_DIGITS), terms, _rounded(tokens, TOKENS_DIGITS),
                _rounded(band_low, GIB_DIGITS), _rounded(band_high, GIB_DIGITS), may_fit, strict=True)]


# The memory parts of a stage, in the order a breakdown lists them: the model state's first (``_state_rows``), then
# forward/backward's (``_dynamic_rows``).
PARTS = ("weights", "grads", "optimizer", "fp8_weights", "workspaces", "grad_copies", "activations", "transient",
         "logits")
# Breakdown entries that are not sizes: which pipeline rank is the worst one, its micro-batches in flight.
_NOT_GIB = ("pipeline_rank", "in_flight_microbatches")
_NOT_ALLOCATED = (*_NOT_GIB, "fragmentation", "non_torch")  # and the parts outside allocated memory


# Everything non_torch_gib reads of a layout: the sizes of its groups follow from these.
NON_TORCH_SIZES = attrgetter("world_size", "tp", "pp", "cp", "ep", "etp")


def _nccl_groups(layout: Layout) -> int:
    """Process groups with more than one rank that this rank communicates in (world group included)."""
    sizes = (layout.tp, layout.pp, layout.cp, layout.dp * layout.cp, layout.ep, layout.etp, layout.edp)
    return 1 + sum(1 for s in sizes if s > 1)


def memory_band(reserved_gib: float, constants: EstimatorConstants) -> tuple[float, float]:
    """Where a measured peak may lie around the predicted ``reserved_gib``, given the estimator's measured error."""
    return (reserved_gib / (1 + constants.memory_over_prediction),
            reserved_gib / (1 - constants.memory_under_prediction))


def non_torch_gib(layout: Layout, constants: EstimatorConstants) -> float:
    """Memory outside torch's allocator that the GPU must hold too: the CUDA context and NCCL's buffers."""
    return constants.cuda_context_gib + constants.nccl_buffer_gib_per_group * _nccl_groups(layout)


def _links(layout: Layout, cluster: ClusterConfig, efficiency: float, latency_us: float = 0.0) -> Links:
    intra = cluster.intra_node_bandwidth_gbs * 1e9 * efficiency
    inter = cluster.inter_node_bandwidth_gbs * 1e9 * efficiency

    def bw(span: int) -> float:
        return group_bandwidth(span, cluster.gpus_per_node, intra, inter)

    tp, cp, dp = layout.tp, layout.cp, layout.dp
    return Links(
        tp=bw(tp),
        cp=bw(tp * cp),
        dp=bw(tp * cp * dp),
        pp=bw(layout.world_size),
        etp=bw(layout.etp),
        edp=bw(layout.etp * layout.ep * layout.edp),
        host=cluster.host_link_gbs * 1e9,
        latency=latency_us * 1e-6,
        intra=intra,
        inter=inter,
        ep_ranks_per_node=ep_ranks_per_node(layout.ep, layout.etp, cluster.gpus_per_node),
    )


@dataclass(frozen=True)
class StageMemory:
    """Predicted allocated memory of one rank of a pipeline stage, in GiB per component (no fragmentation, no
    memory outside torch's allocator): what ``torch.cuda.max_memory_allocated`` would report at its peak."""

    # weights, grads, optimizer, fp8_weights, workspaces (state); activations, transient, logits (forward/backward);
    # grad_copies (the optimizer step)
    parts: dict[str, float]
    in_flight_microbatches: float
    params: StageParams  # the parameters this rank holds
    layer_activation_bytes: float = 0.0  # one decoder layer's activations per micro-batch (what offload moves)

    # Cached: ``estimate`` reads both several times for every stage of every layout of a space; the term table, which
    # sums the parts itself over a whole space, never (issue 54).
    @cached_property
    def state_gib(self) -> float:
        """Weights, grads and optimizer state: made once, kept for the whole run."""
        return sum(self.parts[k] for k in STATE_KEYS)

    @cached_property
    def dynamic_gib(self) -> float:
        """What the peak holds beyond the state: forward/backward's activations, transients and logits, or the
        optimizer step's grad copies, whichever is larger."""
        return dynamic_gib(self.parts)

    @property
    def between_steps_gib(self) -> float:
        """Allocated between two steps (what Megatron's report_memory prints after an iteration): the state and
        the optimizer's FP32 grad copies, which live from the optimizer step until the next zero_grad."""
        return self.state_gib + sum(self.parts[k] for k in STEP_KEYS)

    @property
    def allocated_gib(self) -> float:
        return self.state_gib + self.dynamic_gib

    def reserved_gib(self, fragmentation: float) -> float:
        """What ``torch.cuda.max_memory_reserved`` would report: the state as allocated (a few large tensors
        made once), the dynamic part times the caching allocator's fragmentation."""
        return self.state_gib + fragmentation * self.dynamic_gib


# Layout.split's fields: memo keys hold them as a plain tuple, which hashes faster than the PipelineSplit.
_split_fields = attrgetter("first_stage_layers", "last_stage_layers", "account_for_embedding", "account_for_loss",
                           "pipeline_layout")


class _Sizes(NamedTuple):
    """What the memo keys read of a layout besides its fields, worked out once per layout (``_checked``)."""

    dp: int
    edp: int
    vpp: int  # as the pipeline runs it: 1 without one
    microbatches: int
    split: tuple  # _split_fields


def _checked(layout: Layout, seq_length: int) -> _Sizes:
    """``layout``'s derived sizes; ValueError where they do not divide."""
    lo = layout
    dp, edp = lo.dp, lo.edp
    if dp == 0:
        raise ValueError(f"world size {lo.world_size} is not divisible by TP*PP*CP = {lo.model_parallel}")
    if edp == 0:
        raise ValueError(f"world size {lo.world_size} is not divisible by ETP*EP*PP = {lo.etp * lo.ep * lo.pp}")
    if seq_length % lo.cp:
        raise ValueError(f"seq_length {seq_length} is not divisible by CP {lo.cp}")
    # Micro-batches: Layout.num_microbatches where the global batch divides, as many as fit otherwise (one at least).
    return _Sizes(dp, edp, lo.vpp if lo.pp > 1 else 1, max(1, lo.gbs // (lo.mbs * dp)), _split_fields(lo))


def _activation_shape(
    model: ModelSpec, layout: Layout, seq_length: int, constants: EstimatorConstants,
    calibration: Calibration | None = None, fp8_recipe: str | None = None,
) -> ActivationShape:
    ep, etp = (layout.ep, layout.etp) if model.is_moe else (1, 1)
    return ActivationShape(
        tokens=layout.mbs * seq_length // layout.cp, mbs=layout.mbs, tp=layout.tp, sp=layout.sp and layout.tp > 1,
        cp=layout.cp, ep=ep, etp=etp, precision=layout.precision, recompute=layout.recompute,
        seq_length=seq_length, unfused_attention=constants.attention_backend != "flash",
        softmax_in_fp32=constants.attention_backend == "local",
        hidden_dropout=constants.hidden_dropout > 0, attention_dropout=constants.attention_dropout > 0,
        hot_rank_factor=effective_hot_rank(constants, calibration),
        dispatcher=layout.dispatcher, cuda_graph=layout.cuda_graph, fp8_recipe=fp8_recipe,
    )


def stage_memory(
    model: ModelSpec,
    layout: Layout,
    seq_length: int,
    constants: EstimatorConstants = EstimatorConstants(),
    calibration: Calibration | None = None,
    compute_capability: str | None = None,
    run: RunSettings = RunSettings(),
) -> tuple[StageMemory, ...]:
    """Predicted allocated memory of one rank of every pipeline stage (index = pipeline rank).
    ``compute_capability`` (e.g. "9.0") decides TE's FP8 weight copies; None is a Hopper-like device."""
    sizes = _checked(layout, seq_length)
    return _Stages(model, seq_length, constants, calibration, compute_capability, run)(layout, sizes)[1]


class _Stages:
    """``stage_memory`` for the many layouts of one model and settings. The parts that depend on fewer axes than the
    whole layout (a stage's parameters, its model state, its activations per micro-batch) are kept per value of
    those axes, so ``plan`` computes each a few hundred times instead of once per layout. The memos are dicts keyed
    by plain tuples of layout fields in front of the module's lru_caches, which would hash the model spec and the
    frozen dataclasses on every lookup. The kept values are tuples of frozen dataclasses, never mutated."""

    def __init__(self, model: ModelSpec, seq_length: int, constants: EstimatorConstants,
                 calibration: Calibration | None, compute_capability: str | None, run: RunSettings) -> None:
        self.model, self.seq_length, self.constants, self.run = model, seq_length, constants, run
        self.calibration, self.compute_capability = calibration, compute_capability
        self._factors = calibration or Calibration()  # the memory factors (1.0 when uncalibrated)
        self._moe = model.is_moe
        self._params: dict[tuple, tuple[StageParams, ...]] = {}  # by (tp, pp, vpp, ep, etp, split fields)
        self._states: dict[tuple, tuple[StateBytes, ...]] = {}  # by those, precision, distributed optimizer, shards
        # by the shape's axes and the pipeline: the shape, its stages' activations, and their parameters with their key
        self._activations: dict[tuple, tuple[ActivationShape, tuple[StageActivations, ...], tuple,
                                             tuple[StageParams, ...]]] = {}
        # By the shape's axes: the shape, one layer's activations of each kind and stage_activations' stages by role.
        self._shapes: dict[tuple, tuple[ActivationShape, LayerActivations, dict[StageRole, StageActivations]]] = {}
        self._pipelines: dict[tuple, PipelineStages] = {}  # by (PP, VPP, split fields)
        # Under this calibration's factors: the state parts by states key; the dynamic ones (``_dynamic_rows``) by
        # activations key, micro-batches, A2A overlap and offload. Layouts of other world sizes share both halves.
        self._state_rows: dict[tuple, tuple[tuple[float, ...], ...]] = {}
        self._dynamic_rows: dict[tuple, tuple[tuple[float, ...], ...]] = {}

    def __call__(self, lo: Layout, sizes: _Sizes) -> tuple[ActivationShape, tuple[StageMemory, ...]]:
        """The activation shape of ``lo`` (of ``sizes``, ``_checked``'s) and its stages' memory."""
        shape, params, state_rows, dynamic_rows = self.rows(lo, sizes)
        return shape, tuple(StageMemory(dict(zip(PARTS, (*state, *dynamic[2:]))), dynamic[0], p, dynamic[1])
                            for p, state, dynamic in zip(params, state_rows, dynamic_rows))

    def rows(self, lo: Layout, sizes: _Sizes) -> tuple[ActivationShape, tuple[StageParams, ...],
                                                       tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
        """``__call__``'s stages as plain rows: per stage its parameters, its model-state parts (``PARTS``' first
        six, GiB) and ``(in-flight micro-batches, one layer's activations in bytes, activations, transient, logits
        in GiB)``."""
        model, constants = self.model, self.constants
        acts_key, shape, acts, params_key, params = self._shape_and_params(lo, sizes)
        states_key = (*params_key, lo.precision, lo.distributed_optimizer, sizes.dp * lo.cp, sizes.edp, lo.fsdp)
        state_rows = self._state_rows.get(states_key)
        if state_rows is None:
            states = self._states.get(states_key)
            if states is None:
                states = self._states[states_key] = _stage_states(params, lo, constants, self.compute_capability,
                                                                  self.run)
            state_rows = self._state_rows[states_key] = _state_rows(states, constants, self._factors.state_factor)
        microbatches = sizes.microbatches
        dynamic_key = (acts_key, microbatches, lo.moe_a2a_overlap, lo.offload_layers)
        dynamic_rows = self._dynamic_rows.get(dynamic_key)
        if dynamic_rows is None:
            dynamic_rows = self._dynamic_rows[dynamic_key] = _dynamic_rows(
                model, lo, microbatches, acts, self._factors.activation_factor)
        return shape, params, state_rows, dynamic_rows

    def step_inputs(self, lo: Layout, sizes: _Sizes) -> tuple[ActivationShape, tuple[StageParams, ...], float]:
        """What the step time reads of the stages: the activation shape, each stage's parameters and, for
        offloading, the first stage's layer's activations in bytes (``rows`` without the memory parts)."""
        if lo.offload_layers:
            shape, params, _, dynamic_rows = self.rows(lo, sizes)
            return shape, params, dynamic_rows[0][1]
        _, shape, _, _, params = self._shape_and_params(lo, sizes)
        return shape, params, 0.0

    def _shape_and_params(self, lo: Layout, sizes: _Sizes) -> tuple[tuple, ActivationShape,
                                                                    tuple[StageActivations, ...], tuple,
                                                                    tuple[StageParams, ...]]:
        """The layout's activation shape and its stages' activations per micro-batch, and its stages' parameters,
        each with its memo key. The activations' key holds the parameters' fields: its entry keeps them too."""
        vpp, split = sizes.vpp, sizes.split
        ep, etp = (lo.ep, lo.etp) if self._moe else (1, 1)
        # The shape's axes (the dispatcher field as given: a finer key than Layout.dispatcher), then the pipeline's.
        acts_key = (lo.mbs, lo.tp, lo.sp, lo.cp, ep, etp, lo.precision, lo.recompute, lo.moe_token_dispatcher,
                    lo.cuda_graph, lo.pp, vpp, split)
        kept = self._activations.get(acts_key)
        if kept is None:
            model = self.model
            shape, per_layer, stages = self._shape(lo, acts_key[:10])
            params_key = (lo.tp, lo.pp, vpp, ep, etp, split)
            params = self._params.get(params_key)
            if params is None:
                params = self._params[params_key] = stage_params(model, lo.tp, lo.pp, vpp, ep, etp, split=lo.split)
            kept = self._activations[acts_key] = shape, stage_activations(
                model, shape, per_layer, self.pipeline(lo, vpp, split), self.constants, stages), params_key, params
        return acts_key, *kept

    def _shape(self, lo: Layout, shape_axes: tuple,
               ) -> tuple[ActivationShape, LayerActivations, dict[StageRole, StageActivations]]:
        kept = self._shapes.get(shape_axes)
        if kept is None:
            shape = _activation_shape(self.model, lo, self.seq_length, self.constants, self.calibration,
                                      self.run.recipe(lo.precision, self.compute_capability))
            kept = self._shapes[shape_axes] = shape, layer_activations(self.model, shape, self.constants), {}
        return kept

    def pipeline(self, lo: Layout, vpp: int, split: tuple) -> PipelineStages:
        """The stages of ``lo``'s pipeline (``vpp``: its VPP, 1 without a pipeline; ``split``: ``_split_fields``)."""
        kept = self._pipelines.get((lo.pp, vpp, split))
        if kept is None:
            kept = self._pipelines[lo.pp, vpp, split] = pipeline_stages(self.model, lo.pp, vpp, lo.split)
        return kept

    def recalibrated(self, calibration: Calibration | None) -> _Stages:
        """The same stages under another calibration, keeping what it does not change: the parameters and model
        state always (the factors scale them when combined), the activations while the MoE hot-rank factor, which
        sizes them, is the same."""
        other = _Stages(self.model, self.seq_length, self.constants, calibration, self.compute_capability, self.run)
        other._params, other._states, other._pipelines = self._params, self._states, self._pipelines
        if _hot_rank(self.calibration) == _hot_rank(calibration):
            other._activations, other._shapes = self._activations, self._shapes
        return other


def effective_hot_rank(constants: EstimatorConstants, calibration: Calibration | None) -> float:
    """The MoE hot-rank factor the activations are sized with (``_activation_shape``)."""
    return max(constants.moe_hot_rank_factor, (calibration and calibration.moe_hot_rank_factor) or 1.0)


def _hot_rank(calibration: Calibration | None) -> float | None:
    return calibration.moe_hot_rank_factor if calibration else None


def _stage_states(params: tuple[StageParams, ...], lo: Layout, constants: EstimatorConstants,
                  compute_capability: str | None, run: RunSettings) -> tuple[StateBytes, ...]:
    return tuple(model_state_bytes(p, lo.precision, lo.distributed_optimizer, lo.dp * lo.cp, lo.edp, constants,
                                   compute_capability, run, lo.fsdp) for p in params)


def _state_rows(states: tuple[StateBytes, ...], constants: EstimatorConstants, s: float,
                ) -> tuple[tuple[float, ...], ...]:
    """Each stage's model state in GiB, times the calibrated state factor ``s``: ``PARTS``' first six."""
    return tuple((s * state.weights / GIB, s * state.grads / GIB, s * state.optimizer / GIB,
                  s * state.fp8_weights / GIB, s * constants.workspace_gib, s * state.grad_copies / GIB)
                 for state in states)


@lru_cache(maxsize=65536)
def _in_flight(pp: int, vpp: int, microbatches: int, ranks: int) -> tuple[float, ...]:
    """``in_flight_microbatches`` of each of a pipeline's ``ranks``: the same for every shape on it."""
    return tuple(in_flight_microbatches(rank, pp, vpp, microbatches) for rank in range(ranks))


def _dynamic_rows(model: ModelSpec, lo: Layout, microbatches: int, acts: tuple[StageActivations, ...], f: float,
                  ) -> tuple[tuple[float, ...], ...]:
    """Each stage's activations times its micro-batches in flight: ``(in flight, one layer's activations in bytes,
    activations, transient, logits)``, the last three in GiB times the calibrated activation factor ``f``. Reads of
    ``lo`` PP, VPP, the A2A overlap and offload."""
    vpp = lo.vpp if lo.pp > 1 else 1
    a2a_overlap = lo.moe_a2a_overlap and model.is_moe
    out = []
    for a, in_flight in zip(acts, _in_flight(lo.pp, vpp, microbatches, len(acts)), strict=True):
        activations = a.per_microbatch * in_flight
        per_layer = a.per_microbatch / max(a.layers, 1)
        if a2a_overlap:
            # Megatron's combined 1F1B pairs each layer's forward of the next micro-batch with a layer's backward of
            # this one: the backward frees a layer as the forward builds one, so the peak holds one layer more.
            activations += per_layer
        if lo.offload_layers:
            # cpu_offloading_num_layers (PP 1, the rules): those layers' activations wait on the host between
            # forward and backward; the one being copied out or back in is still on the device.
            activations -= per_layer * min(lo.offload_layers, a.layers) * in_flight
            activations += per_layer
        out.append((in_flight, per_layer, f * (activations + a.graph_static * in_flight) / GIB,
                    f * a.transient / GIB, f * a.logits / GIB))
    return tuple(out)


# A layout's blocks' step-time terms (block_seconds) and the pipeline stages made of them (slowest_stage's stages).
_Blocks = tuple[dict[Block, dict[str, float]], dict[tuple, tuple[dict[str, float], float]]]


# ``Estimator.for_config``'s estimators, by config object and host cores: the config held keeps its id from reuse.
_FOR_CONFIG: dict[tuple[int, int | None], tuple[SweepConfig, Estimator]] = {}
_FOR_CONFIG_MAX = 4


class Estimator:
    """``estimate`` for the many layouts of one model, cluster and settings (a space): stage memory through one
    ``_Stages`` (its memos serve every layout), step time through the module's caches."""

    def __init__(
        self,
        model: ModelSpec,
        cluster: ClusterConfig,
        seq_length: int,
        constants: EstimatorConstants = EstimatorConstants(),
        headroom: float = 0.10,
        calibration: Calibration | None = None,
        run: RunSettings = RunSettings(),
        host_cores: int | None = None,
        kept: Estimator | None = None,
    ) -> None:
        """``host_cores``: the layouts run as CPU processes on one host of that many cores (the CPU backend on a
        simulated cluster), whose ranks share them: every step-time term of a layout with more ranks than cores is
        that many times longer, and priced with ``CPU_RANK_EFFICIENCIES`` where ``constants`` leaves them unset.
        ``kept``: an estimator of the same space whose memos this one shares (``recalibrated``)."""
        self.host_cores, self.headroom = host_cores, headroom
        if host_cores:
            constants = constants.model_copy(update={k: v for k, v in CPU_RANK_EFFICIENCIES.items()
                                                     if k not in constants.model_fields_set})
        self.model, self.cluster, self.seq_length = model, cluster, seq_length
        self.constants, self.calibration, self.run = constants, calibration, run
        self._limit = memory_limit_gib(cluster.gpu_memory_gib, headroom)
        self._device = device_for(cluster.gpu_kind, cluster.compute_capability)
        self._links: dict[tuple, Links]  # by the sizes that set each group's span
        # block_seconds and slowest_stage's stages of those blocks (its ``stages``), by the fields block_seconds reads
        self._blocks: dict[tuple, _Blocks]
        self._slowest: dict[tuple, dict[str, float]]  # slowest_stage, by the fields it reads
        self._once: dict[tuple, dict[str, float]]  # once_per_step, by the fields it reads
        # step_terms by layout: a plan's production layouts repeat (every world size of a layout's family scales to
        # the same production layout). Uncalibrated, they depend on a calibration only through the MoE hot-rank
        # factor (an offloaded layer's activations): estimators of other calibrations share them otherwise.
        self._step_terms_of: dict[Layout, StepTerms]
        if kept is None:
            self._stages = _Stages(model, seq_length, constants, calibration, cluster.compute_capability, run)
            self._links, self._blocks, self._slowest, self._once = {}, {}, {}, {}
            self._step_terms_of = {}
        else:  # the same space under another calibration (``recalibrated``)
            stages, self._links, self._blocks, self._slowest, self._once, step_terms_of = kept.memos()
            self._stages = stages.recalibrated(calibration)
            self._step_terms_of = step_terms_of if _hot_rank(kept.calibration) == _hot_rank(calibration) else {}
        self._factor = (calibration or Calibration()).step_factor  # a step-time term's calibrated efficiency factor
        self._moe = model.is_moe
        self._unit: _Stages | None = None  # the stages at memory factors 1 (unit_stages)

    @classmethod
    def for_config(cls, cfg: SweepConfig, calibration: Calibration | None = None,
                   host_cores: int | None = None) -> Estimator:
        """The estimator of a sweep's model, cluster and settings (the YAML's ``estimate:``, ``run:`` and memory
        headroom). Estimators of one config object share their memos (``recalibrated``): a plan, its production
        runs' step times and a sweep's calibrations each ask for one, and price the same stages (issue 54). A loaded
        config never changes (a change is ``model_copy``'s new object), so the object itself is the key."""
        key = (id(cfg), host_cores)
        held = _FOR_CONFIG.get(key)
        if held is not None and held[0] is cfg:
            return held[1] if calibration is held[1].calibration else held[1].recalibrated(calibration)
        made = cls.new_for_config(cfg, calibration, host_cores)
        if len(_FOR_CONFIG) >= _FOR_CONFIG_MAX:  # the oldest config's memos go (a test run loads hundreds)
            del _FOR_CONFIG[next(iter(_FOR_CONFIG))]
        _FOR_CONFIG[key] = (cfg, made)
        return made

    @classmethod
    def new_for_config(cls, cfg: SweepConfig, calibration: Calibration | None = None,
                       host_cores: int | None = None) -> Estimator:
        """``for_config``'s estimator made afresh, with memos of its own (what the tests compare shared ones with)."""
        return cls(cfg.model, cfg.cluster, cfg.training.seq_length, constants=cfg.estimate,
                   headroom=cfg.search.memory_headroom, calibration=calibration, run=cfg.run, host_cores=host_cores)

    def recalibrated(self, calibration: Calibration | None) -> Estimator:
        """This estimator under another calibration (a sweep's calibrator learnt from a trial): it keeps the memos
        no calibration changes (links, each block's and the slowest stage's step-time terms, the stages' parameters
        and state), so re-assessing a space after each measured trial re-does only the calibrated sums."""
        return Estimator(self.model, self.cluster, self.seq_length, self.constants, self.headroom, calibration,
                         self.run, self.host_cores, kept=self)

    @property
    def limit_gib(self) -> float:
        """What a layout's reserved peak plus the memory outside torch may reach (the GPU less the headroom)."""
        return self._limit

    def hot_rank_factor(self, calibration: Calibration | None) -> float:
        """The MoE hot-rank factor this estimator's activations would be sized with under ``calibration``."""
        return effective_hot_rank(self.constants, calibration)

    def memos(self) -> tuple[_Stages, dict[tuple, Links], dict[tuple, _Blocks], dict[tuple, dict[str, float]],
                             dict[tuple, dict[str, float]], dict[Layout, StepTerms]]:
        """What ``recalibrated`` keeps: the stages' memos, the links, the blocks', slowest stages' and once-per-step
        terms, and each layout's step terms (``step_terms``) while the MoE hot-rank factor is the same."""
        return self._stages, self._links, self._blocks, self._slowest, self._once, self._step_terms_of

    def __call__(self, layout: Layout) -> Estimate:
        lo, constants, calibration, seq_length = layout, self.constants, self.calibration, self.seq_length
        sizes = _checked(lo, seq_length)
        shape, stages = self._stages(lo, sizes)
        non_torch = non_torch_gib(lo, constants)

        worst: dict[str, float] = {}
        worst_reserved = -1.0
        for rank, stage in enumerate(stages):
            allocated = stage.allocated_gib
            reserved = stage.reserved_gib(constants.allocator_fragmentation)
            if calibration:
                reserved += calibration.overhead_gib  # fitted against measured max_memory_reserved
            if reserved > worst_reserved:
                worst_reserved = reserved
                worst = {
                    **stage.parts,
                    "fragmentation": reserved - allocated,
                    "non_torch": non_torch,
                    "pipeline_rank": float(rank),
                    "in_flight_microbatches": stage.in_flight_microbatches,
                }

        terms = self._step_terms(lo, sizes, shape, tuple(st.params for st in stages),
                                 stages[0].layer_activation_bytes)
        seconds = terms.seconds(self._factor)
        tokens = lo.gbs * seq_length
        band = memory_band(worst_reserved, constants)
        return Estimate(
            memory_gib=worst_reserved,
            fits=worst_reserved + non_torch <= self._limit,
            step_time_s=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else None,
            breakdown=worst,
            memory_band_gib=band,
            may_fit=band[0] + non_torch <= self._limit,
            step_terms=terms,
            step_factor=self._factor,
        )

    def step_terms(self, layout: Layout) -> StepTerms:
        """``self(layout).step_terms`` without the memory verdict: the layout's uncalibrated step-time terms, which
        ``.seconds(factors)`` prices under a calibration (the production run's larger data parallelism over its
        trial's, ``objective.extra_step_s``, for every layout of a plan; the refit's own factors)."""
        kept = self._step_terms_of.get(layout)
        if kept is None:
            sizes = _checked(layout, self.seq_length)
            shape, params, layer_activation_bytes = self._stages.step_inputs(layout, sizes)
            kept = self._step_terms_of[layout] = self._step_terms(layout, sizes, shape, params, layer_activation_bytes)
        return kept

    def step_time_s(self, layout: Layout) -> float:
        """``self(layout).step_time_s`` without the memory verdict."""
        return self.step_terms(layout).seconds(self._factor)

    def terms(self, layout: Layout) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...], StepTerms]:
        """What a calibration scales (``term_table``): ``layout``'s stages at memory factors 1, as each stage's model
        state (``PARTS``' first six, GiB) and ``(in-flight micro-batches, one layer's activations in bytes,
        activations, transient, logits in GiB)`` (``_Stages.rows``), and its uncalibrated step terms. The rows are
        the memos' own, shared by the layouts that share them: the caller must not change them."""
        sizes = _checked(layout, self.seq_length)
        if self._unit is None:
            hot = self.calibration.moe_hot_rank_factor if self.calibration else None
            self._unit = self._stages.recalibrated(Calibration(moe_hot_rank_factor=hot))
        shape, params, state_rows, dynamic_rows = self._unit.rows(layout, sizes)
        return state_rows, dynamic_rows, self._step_terms(layout, sizes, shape, params, dynamic_rows[0][1])

    def _step_terms(self, lo: Layout, sizes: _Sizes, shape: ActivationShape, params: tuple[StageParams, ...],
                    layer_activation_bytes: float) -> StepTerms:
        """The layout's step time as uncalibrated terms (of the stages it reads their parameters and, for
        offloading, the first stage's layer's activations, which no calibration factor changes)."""
        _, _, vpp, microbatches, split = sizes
        # Everything block_seconds reads (its first eleven): the sizes within a stage (and so their links), the
        # precision, recompute and the MoE and CUDA-graph knobs (as given: finer than what it reads of them for a
        # dense model); slowest_stage also the pipeline and its split. Neither reads the DP side.
        stage_key = (lo.mbs, lo.tp, lo.cp, lo.ep, lo.etp, shape.sp, lo.precision, lo.recompute, lo.moe_token_dispatcher,
                     lo.moe_a2a_overlap, lo.cuda_graph, lo.pp, vpp, split)
        # Everything once_per_step reads: the sizes that set the groups and their links, the pipeline (its stages'
        # parameters), the micro-batches and the DP-side options.
        once_key = (lo.world_size, lo.tp, lo.pp, lo.cp, lo.ep, lo.etp, vpp, split, lo.mbs, shape.sp, lo.precision,
                    microbatches, lo.distributed_optimizer, lo.fsdp)
        stage = self._slowest.get(stage_key)
        once = self._once.get(once_key)
        if stage is None or once is None or lo.offload_layers:  # the layout's TimeInputs, only on a miss
            model, constants, device, moe = self.model, self.constants, self._device, self._moe
            spans = (lo.world_size, lo.tp, lo.pp, lo.cp, lo.ep, lo.etp)  # all _links reads (DP and EDP follow)
            links = self._links.get(spans)
            if links is None:
                links = self._links[spans] = _links(lo, self.cluster, constants.comm_efficiency,
                                                    constants.link_latency_us)
            inputs = TimeInputs(
                seq_length=self.seq_length, mbs=lo.mbs, num_microbatches=microbatches, tp=lo.tp, pp=lo.pp, vpp=vpp,
                cp=lo.cp, dp=sizes.dp, ep=shape.ep, etp=shape.etp, edp=sizes.edp, sp=shape.sp, precision=lo.precision,
                recompute=lo.recompute, distributed_optimizer=lo.distributed_optimizer, split=lo.split,
                overlap_grad_reduce=self.run.overlaps_grad_reduce, dispatcher=lo.dispatcher if moe else "alltoall",
                a2a_overlap=lo.moe_a2a_overlap and moe,
                cuda_graph=lo.cuda_graph, offload_layers=lo.offload_layers, fsdp=lo.fsdp,
                offload_bytes_per_layer=layer_activation_bytes if lo.offload_layers else 0.0,
                fp8_recipe=shape.fp8_recipe,  # RunSettings.recipe of the precision on this cluster's device
            )
            if stage is None:
                blocks = self._blocks.get(stage_key[:11])
                if blocks is None:
                    blocks = self._blocks[stage_key[:11]] = block_seconds(model, inputs, device, links, constants), {}
                stage = self._slowest[stage_key] = slowest_stage(
                    model, inputs, self._stages.pipeline(lo, vpp, split), device, links, constants, *blocks)
            if once is None:
                once = self._once[once_key] = once_per_step(
                    model, inputs, device, links, max(p.dense for p in params), max(p.expert for p in params),
                    constants)
            if lo.offload_layers:
                stage = {**stage, OFFLOAD: offload_seconds(model, inputs, links, stage)}
        terms = step_time(stage, microbatches, lo.pp, vpp, once)
        if self.host_cores and lo.world_size > self.host_cores:
            terms = terms.scaled(lo.world_size / self.host_cores)
        return terms


P = ParamSpec("P")


def _for_one_layout(
    make: Callable[Concatenate[ModelSpec, ClusterConfig, int, P], Estimator],
) -> Callable[Concatenate[ModelSpec, Layout, ClusterConfig, int, P], Estimate]:
    """``estimate`` from the ``Estimator`` class: its arguments with the layout second, listed once (in
    ``Estimator.__init__``) and type-checked against it."""

    def estimate(model: ModelSpec, layout: Layout, cluster: ClusterConfig, seq_length: int, /,
                 *args: P.args, **kwargs: P.kwargs) -> Estimate:
        """Predict peak per-GPU memory and step time of ``layout`` for ``model`` on ``cluster``. The further
        arguments are ``Estimator``'s: ``constants``, ``headroom`` (0.10), ``calibration`` and ``run`` (the YAML's
        ``run:``). For many layouts of one model and cluster, build one ``Estimator`` and call it per layout."""
        return make(model, cluster, seq_length, *args, **kwargs)(layout)

    return estimate


estimate = _for_one_layout(Estimator)
