"""Layout: one parallel layout of one trial, the value every part of sweeper passes around.

A frozen dataclass in the manner of torchtitan's ParallelDims: the sizes a user chooses are fields, the sizes
Megatron derives (DP, EDP) are properties. A Layout can be invalid for a model (``sweeper.plan.rules`` says why), so
construction only checks that every size is a positive integer. It serialises to the ``--layout`` string, to
Megatron-LM command-line flags and to Megatron-Bridge overrides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Literal

from sweeper.errors import LayoutError
from sweeper.space.axes import (
    AUTO_LAYOUT,
    AXES,
    AXIS,
    CONTRACT_KEYS,
    CUDA_GRAPH_SCOPES,
    DISPATCHERS,
    FSDP_STRATEGIES,
    PARALLEL_SIZES,
    PARSED,
    PIPELINE_SPLIT,
    PRECISIONS,
    QUANTIZED,
    precision_dtype,
)

Precision = Literal["fp32", "fp16", "bf16", "fp8", "fp8:delayed", "fp8:tensorwise", "fp8:blockwise", "mxfp8", "nvfp4"]
# Recompute granularities. "selective" recomputes Megatron's default module (core_attn); "selective:a+b" names
# the modules (Megatron's --recompute-modules), e.g. "selective:moe_act+layernorm".
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
# Megatron-Core's recompute_modules choices, in the order the canonical "selective:..." spelling lists them.
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn",)



@dataclass(frozen=True)
class PipelineSplit:
    """Megatron's pipeline-split options of one layout: even (all default), uneven first/last stage sizes, the
    embedding/loss accounted as layers, or an explicit pipeline_model_parallel_layout string."""

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    layout: str | None = None

    @property
    def even(self) -> bool:
        return self == PipelineSplit()


@dataclass(frozen=True, order=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    sp: bool = False
    mbs: int = 1
    gbs: int = 1
    precision: str = "bf16"
    recompute: str = "none"
    distributed_optimizer: bool = True
    # Uneven pipeline split (Megatron's num_layers_in_first/last_pipeline_stage); None = even split.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    # Megatron's account_for_embedding/loss_in_pipeline_split: the embedding and the loss each count as one layer
    # when the layers are split over pipeline ranks (126 layers + 2 on PP8: 16 slots per rank).
    account_for_embedding: bool = False
    account_for_loss: bool = False
    # Megatron's pipeline_model_parallel_layout, e.g. "Et|(tt|)*62tL": every (virtual) stage's layers, "|" between
    # stages, stage i = vpp_rank * PP + pp_rank (megatron/core/transformer/pipeline_parallel_layer_layout.py).
    pipeline_layout: str | None = None
    # Issue 18. The MoE token dispatcher (DISPATCHERS; None: alltoall, the value every trial used before it was an
    # axis, and nothing exported); the expert all-to-all overlapped with another micro-batch's compute
    # (overlap_moe_expert_parallel_comm); CUDA graphs (canonical_cuda_graph); decoder layers whose activations
    # live on the host between forward and backward (cpu_offloading_num_layers).
    moe_token_dispatcher: str | None = None
    moe_a2a_overlap: bool = False
    cuda_graph: str = "none"
    offload_layers: int = 0
    # Megatron-FSDP's data_parallel_sharding_strategy (FSDP_STRATEGIES); None: Megatron's DDP.
    fsdp: str | None = None

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "mbs", "gbs"):
            _check_size(name, getattr(self, name))
        if self.precision not in PRECISIONS:
            raise LayoutError(f"precision: must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        object.__setattr__(self, "recompute", canonical_recompute(self.recompute))
        object.__setattr__(self, "cuda_graph", canonical_cuda_graph(self.cuda_graph))
        if self.moe_token_dispatcher is not None and self.moe_token_dispatcher not in DISPATCHERS:
            raise LayoutError(f"moe_token_dispatcher: must be one of {', '.join(DISPATCHERS)}, "
                              f"got {self.moe_token_dispatcher!r}")
        if self.fsdp is not None and self.fsdp not in FSDP_STRATEGIES:
            raise LayoutError(f"fsdp: must be one of {', '.join(FSDP_STRATEGIES)}, got {self.fsdp!r}")
        if isinstance(self.offload_layers, bool) or not isinstance(self.offload_layers, int) or self.offload_layers < 0:
            raise LayoutError(f"offload_layers: must be 0 or a positive integer, got {self.offload_layers!r}")
        if self.pipeline_layout == AUTO_LAYOUT:  # sweeper picks the split: space.pipeline.with_pipeline_split
            object.__setattr__(self, "pipeline_layout", None)
        if self.pipeline_layout is not None and (not self.pipeline_layout.strip() or "," in self.pipeline_layout):
            raise LayoutError(f"pipeline_layout: must be a Megatron layout string without commas, e.g. "
                              f"'Et|(tt|)*62tL', got {self.pipeline_layout!r}")

    def __hash__(self) -> int:
        """The fields' hash (those ``==`` compares), computed once and kept: the driver hashes every candidate layout
        several times per event (dict and set lookups over DeepSeek-V3's 9,435 launchable layouts were a fifth of its
        time, issue 54). A pickled Layout leaves it behind: another process hashes strings with another seed."""
        kept: int | None = self.__dict__.get("_hash")
        if kept is None:
            kept = self.__dict__["_hash"] = hash(_compared(self))
        return kept

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @classmethod
    def from_checked(cls, fields: dict[str, Any]) -> Layout:
        """The Layout of every field's value, each one already checked and canonical (a value that went through the
        constructor once): ``enumerate_layouts`` checks each axis value once, not once per layout of the product.
        ``fields`` becomes the layout's own and must not be used afterwards."""
        layout = object.__new__(cls)
        object.__setattr__(layout, "__dict__", fields)
        return layout

    def resized(self, world_size: int, gbs: int) -> Layout:
        """This layout on ``world_size`` GPUs with a global batch of ``gbs``: ``dataclasses.replace`` of the two
        without checking every other field again (a replan scales some 14,000 layouts to the production run)."""
        _check_size("world_size", world_size)
        _check_size("gbs", gbs)
        fields = self.__getstate__()
        fields.update(world_size=world_size, gbs=gbs)
        return Layout.from_checked(fields)

    @property
    def split(self) -> PipelineSplit:
        """How the decoder layers are split over pipeline ranks (``sweeper.space.pipeline`` places them)."""
        return PipelineSplit(self.first_stage_layers, self.last_stage_layers, self.account_for_embedding,
                             self.account_for_loss, self.pipeline_layout)

    # -- derived sizes -------------------------------------------------------------------------------------------
    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size (0 when the world size does not divide; rules report that)."""
        model_parallel = self.model_parallel
        return self.world_size // model_parallel if self.world_size % model_parallel == 0 else 0

    @property
    def edp(self) -> int:
        """Expert data-parallel size: W = ETP * EP * EDP * PP (MoE parallel folding; CP folds into EDP)."""
        expert = self.etp * self.ep * self.pp
        return self.world_size // expert if self.world_size % expert == 0 else 0

    @property
    def num_microbatches(self) -> int:
        per_step = self.mbs * self.dp
        return self.gbs // per_step if per_step and self.gbs % per_step == 0 else 0

    @property
    def is_fp8(self) -> bool:
        """FP8 GEMMs (any FP8 recipe, MXFP8 included); NVFP4 is not."""
        return precision_dtype(self.precision) in ("fp8", "mxfp8")

    @property
    def quantized(self) -> bool:
        """GEMMs in a Transformer Engine low-precision recipe (FP8, MXFP8 or NVFP4): BF16 weights, TE's copies."""
        return self.precision in QUANTIZED

    @property
    def recompute_granularity(self) -> str:
        """Megatron's recompute_granularity: none, selective or full."""
        return self.recompute.partition(":")[0]

    @property
    def dispatcher(self) -> str:
        """Megatron's moe_token_dispatcher_type this layout runs (alltoall unless the axis says otherwise)."""
        return (self.moe_token_dispatcher or "alltoall").partition(":")[0]

    @property
    def flex_backend(self) -> str | None:
        """moe_flex_dispatcher_backend (deepep, hybridep) of a flex dispatcher; None otherwise."""
        return (self.moe_token_dispatcher or "").partition(":")[2] or None

    @property
    def cuda_graph_impl(self) -> str:
        """Megatron's cuda_graph_impl: none, local or transformer_engine."""
        return {"none": "none", "local": "local", "full_iteration": "local"}.get(self.cuda_graph, "transformer_engine")

    @property
    def cuda_graph_scope(self) -> tuple[str, ...]:
        """Megatron's cuda_graph_scope (empty: whole layers)."""
        if self.cuda_graph == "full_iteration":
            return ("full_iteration",)
        if self.cuda_graph_impl != "transformer_engine":
            return ()
        return tuple(s for s in CUDA_GRAPH_SCOPES if s in graphed_scopes(self.cuda_graph))

    def cuda_graph_fields(self, graph_modules: bool) -> dict[str, Any]:
        """cuda_graph_impl and the graphed parts of a layer under megatron-core's names: ``cuda_graph_scope`` up to
        0.16; with ``graph_modules`` (0.19 on) ``cuda_graph_modules``, full-iteration graphs then an impl of their
        own (transformer/cuda_graph_config.py; 0.19 still migrates the old names, with a deprecation warning)."""
        if not graph_modules:
            return {"cuda_graph_impl": self.cuda_graph_impl, "cuda_graph_scope": list(self.cuda_graph_scope)}
        if self.cuda_graph == "full_iteration":
            return {"cuda_graph_impl": "full_iteration", "cuda_graph_modules": []}
        return {"cuda_graph_impl": self.cuda_graph_impl, "cuda_graph_modules": list(self.cuda_graph_scope)}

    @property
    def recompute_modules(self) -> tuple[str, ...]:
        """Megatron's recompute_modules under selective granularity (empty for none and full)."""
        return recompute_modules(self.recompute)

    # -- serialisation -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The contract's JSON layout object (plus the fields it needs to be rebuilt)."""
        out = _contract_dict(self)
        if self.account_for_embedding or self.account_for_loss or self.pipeline_layout:
            out.update(account_for_embedding=self.account_for_embedding, account_for_loss=self.account_for_loss,
                       pipeline_layout=self.pipeline_layout)
        if _knob_values(self) != _KNOB_DEFAULT_VALUES:  # most layouts set none
            out.update(self._knobs())
        return out

    def _knobs(self) -> dict[str, Any]:
        """The issue-18 knobs that differ from their defaults, under their axis keys (the defaults are left out, so
        a layout that sets none reads and writes exactly as before the knobs existed)."""
        values = _knob_values(self)
        if values == _KNOB_DEFAULT_VALUES:  # most layouts: nothing to add
            return {}
        return {name: value for name, value in zip(KNOBS, values) if value != _KNOB_DEFAULTS[name]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["world_size"] = data.get("gpus", data.get("world_size"))
        return cls(**kwargs)

    def short(self) -> str:
        """A compact name for tables and MLflow tags, e.g. ``TP2-PP2-EP4-bf16``."""
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp > 1:
            parts.append(f"VPP{self.vpp}")
        for name in ("cp", "ep", "etp"):
            if getattr(self, name) > 1:
                parts.append(f"{name.upper()}{getattr(self, name)}")
        parts.append(f"DP{self.dp}")
        if self.sp:
            parts.append("SP")
        parts.append(f"MBS{self.mbs}")
        if self.recompute != "none":
            parts.append(f"RC-{self.recompute}")
        if self.account_for_embedding or self.account_for_loss:
            parts.append("ACC-" + "+".join(n for n, on in (("E", self.account_for_embedding),
                                                           ("L", self.account_for_loss)) if on))
        if self.pipeline_layout:
            parts.append(f"PPL[{self.pipeline_layout}]")
        if not self.distributed_optimizer:
            parts.append("noDO")
        if self.moe_token_dispatcher is not None:
            parts.append({"alltoall": "A2A", "allgather": "AG"}.get(self.moe_token_dispatcher,
                                                                     (self.flex_backend or "").upper()))
        if self.moe_a2a_overlap:
            parts.append("A2AOVL")
        if self.cuda_graph != "none":
            parts.append(f"CG-{self.cuda_graph.replace('te:', 'te-')}")
        if self.offload_layers:
            parts.append(f"OFF{self.offload_layers}")
        if self.fsdp:
            parts.append(f"FSDP-{self.fsdp}")
        parts.append(self.precision)
        return "-".join(parts)

    def to_string(self) -> str:
        """The ``--layout`` form; ``parse_layout(layout.to_string(), ...)`` gives the same Layout back."""
        items = [
            f"gpus={self.world_size}",
            f"tp={self.tp}",
            f"pp={self.pp}",
            f"vpp={self.vpp}",
            f"cp={self.cp}",
            f"ep={self.ep}",
            f"etp={self.etp}",
            f"sp={str(self.sp).lower()}",
            f"mbs={self.mbs}",
            f"gbs={self.gbs}",
            f"precision={self.precision}",
            f"recompute={self.recompute}",
            f"distributed_optimizer={str(self.distributed_optimizer).lower()}",
        ]
        if self.account_for_embedding or self.account_for_loss:
            items += [f"account_for_embedding={str(self.account_for_embedding).lower()}",
                      f"account_for_loss={str(self.account_for_loss).lower()}"]
        if self.pipeline_layout:
            items.append(f"pipeline_layout={self.pipeline_layout}")
        items += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self._knobs().items()]
        return ",".join(items)

    def parallel_sizes(self) -> dict[str, int | None]:
        """The parallel sizes under Megatron-Core's names (``initialize_model_parallel`` / ``TransformerConfig``)."""
        return {AXIS[n].megatron or n: _unless(AXIS[n].value(self), AXIS[n].omit) for n in PARALLEL_SIZES}

    def pipeline_split_config(self) -> dict[str, Any]:
        """The pipeline split under Megatron-Core's TransformerConfig names (transformer_config.py)."""
        return {AXIS[n].megatron or n: AXIS[n].value(self) for n in PIPELINE_SPLIT}

    def recompute_config(self) -> dict[str, Any]:
        """Recompute settings under Megatron-Core's TransformerConfig names (empty without recompute)."""
        if self.recompute_granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.recompute_modules)}
        if self.recompute == "full":
            return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        return {}

    def megatron_args(self, graph_modules: bool = False) -> list[str]:
        """Megatron-LM ``pretrain_gpt.py`` / ``pretrain_mamba.py`` flags for this layout; ``graph_modules`` as in
        ``cuda_graph_fields`` (Megatron-LM of megatron-core 0.19 names the flag ``--cuda-graph-modules``)."""
        args: list[str] = []
        for axis in AXES:
            value = axis.value(self)
            if axis.flag is None or value is None or value is False or value == axis.omit:
                continue
            if axis.name == "vpp" and self.pipeline_layout:  # the layout sets the virtual stages itself
                continue
            args.append(f"--{axis.flag}" if value is True else f"--{axis.flag}={value}")
        args += _PRECISION_FLAGS[precision_dtype(self.precision)]
        if self.recompute_granularity == "selective":
            args.append("--recompute-granularity=selective")
            if self.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
                args += ["--recompute-modules", *self.recompute_modules]
        elif self.recompute == "full":
            args += ["--recompute-granularity=full", "--recompute-method=uniform", "--recompute-num-layers=1"]
        if self.moe_token_dispatcher is not None:
            args.append(f"--moe-token-dispatcher-type={self.dispatcher}")
            if self.flex_backend:  # DeepEP asserts FP32 router probabilities (token_dispatcher.py)
                args += [f"--moe-flex-dispatcher-backend={self.flex_backend}", "--moe-router-dtype=fp32"]
        if self.cuda_graph != "none":
            graphs = self.cuda_graph_fields(graph_modules)
            args.append(f"--cuda-graph-impl={graphs['cuda_graph_impl']}")
            parts = "cuda_graph_modules" if graph_modules else "cuda_graph_scope"
            if graphs[parts]:
                args += [f"--{parts.replace('_', '-')}", *graphs[parts]]
            # Megatron-LM's validate_args asserts both (arguments.py, core_v0.16.1 and 0.17.1). From 0.18 (the
            # megatron-core wheels' megatron/training/arguments.py, 0.18.2 and 0.19.2) it asserts the first only:
            # padding experts is an inference-only TransformerConfig field the trial does not set, so the export
            # leaves it out there (0.18 is also where CUDA graphs' parts became cuda_graph_modules).
            if self.cuda_graph == "full_iteration":
                args.append("--no-check-for-nan-in-loss-and-grad")
            if self.cuda_graph_impl == "local" and self.ep > 1 and not graph_modules:
                args.append("--moe-pad-experts-for-cuda-graph-inference")
        if self.fsdp:  # validate_args: "Megatron FSDP only supports fsdp_dtensor checkpoint format"
            args += ["--use-megatron-fsdp", "--ckpt-format=fsdp_dtensor"]
        return args

    def bridge_overrides(self, graph_modules: bool = False) -> list[str]:
        """Megatron-Bridge recipe overrides (Hydra-style ``section.field=value``); ``graph_modules`` as in
        ``cuda_graph_fields``."""
        out: list[str] = []
        for axis in AXES:
            value = axis.value(self)
            if not axis.bridge or value is None or (value is False and not axis.bridge_always):
                continue
            if value == axis.bridge_null:
                text = "null"
            elif isinstance(value, bool):
                text = str(value).lower()
            elif isinstance(value, str):
                text = f'"{value}"'
            else:
                text = str(value)
            out += [f"{key}={text}" for key in axis.bridge]
        out.append(f"mixed_precision={_BRIDGE_PRECISION[self.precision]}")
        if self.recompute != "none":
            out.append(f"model.recompute_granularity={self.recompute_granularity}")
        if self.recompute_granularity == "selective" and self.recompute_modules != DEFAULT_RECOMPUTE_MODULES:
            out.append(f"model.recompute_modules=[{','.join(self.recompute_modules)}]")
        if self.recompute == "full":
            out += ["model.recompute_method=uniform", "model.recompute_num_layers=1"]
        if self.moe_token_dispatcher is not None:
            out.append(f"model.moe_token_dispatcher_type={self.dispatcher}")
            if self.flex_backend:
                out += [f"model.moe_flex_dispatcher_backend={self.flex_backend}", "model.moe_router_dtype=fp32"]
        if self.cuda_graph != "none":
            # Bridge's GPTModelProvider.provide() asserts TE's RNG tracker under graphs (Megatron-LM's validate_args
            # turns it on itself); the trial sets it (gpu.run_config_kwargs).
            out += [f"model.{name}=[{','.join(value)}]" if isinstance(value, list) else f"model.{name}={value}"
                    for name, value in self.cuda_graph_fields(graph_modules).items()]
            out.append("model.use_te_rng_tracker=true")
        if self.offload_layers:  # Megatron-LM's flag turns cpu_offloading on itself; Bridge's config does not
            out += ["model.cpu_offloading=true", f"model.cpu_offloading_num_layers={self.offload_layers}"]
        if self.fsdp:  # Bridge's ConfigContainer asserts fsdp_dtensor whenever a run saves or loads
            out += ["ddp.use_megatron_fsdp=true", "checkpoint.ckpt_format=fsdp_dtensor"]
        return out

    def knob_config(self, graph_modules: bool = False) -> dict[str, Any]:
        """The issue-18 knobs under Megatron-Core's TransformerConfig names (the MoE dispatcher is the MoE
        section's: ``moe_config``); ``graph_modules``: the graphs under the names of megatron-core 0.19
        (``cuda_graph_fields``)."""
        out: dict[str, Any] = {}
        if self.moe_a2a_overlap:
            out["overlap_moe_expert_parallel_comm"] = True
        if self.cuda_graph != "none":
            out.update(self.cuda_graph_fields(graph_modules))
        if self.offload_layers:
            out.update(cpu_offloading=True, cpu_offloading_num_layers=self.offload_layers)
        return out

    def moe_config(self) -> dict[str, Any]:
        """The token dispatcher under TransformerConfig's names (a MoE model's)."""
        out: dict[str, Any] = {"moe_token_dispatcher_type": self.dispatcher}
        if self.flex_backend:
            out.update(moe_flex_dispatcher_backend=self.flex_backend, moe_router_dtype="fp32")
        return out


_compared = attrgetter(*(f.name for f in fields(Layout) if f.compare))


def _unless(value: Any, omit: Any) -> Any:
    return None if value == omit else value


_PRECISION_FLAGS: dict[str, list[str]] = {
    "fp32": [],
    "fp16": ["--fp16"],
    "bf16": ["--bf16"],
    # Every FP8 recipe: the format and recipe flags follow the resolved recipe (RunSettings.megatron_args).
    "fp8": ["--bf16"],
    "mxfp8": ["--bf16", "--fp8-format=e4m3", "--fp8-recipe=mxfp8"],
    "nvfp4": ["--bf16", "--fp4-format=e2m1", "--fp4-recipe=nvfp4"],
}
# Megatron-Bridge's mixed-precision recipe names (megatron/bridge/training/mixed_precision.py).
_BRIDGE_PRECISION: dict[str, str] = {
    "fp32": "null",
    "fp16": "fp16_mixed",
    "bf16": "bf16_mixed",
    # Bare fp8: delayed scaling's recipe, and the run settings name the recipe they resolve to (as before recipes
    # were precision values); a named recipe takes Bridge's recipe of that name.
    "fp8": "bf16_with_fp8_delayed_scaling_mixed",
    "fp8:delayed": "bf16_with_fp8_delayed_scaling_mixed",
    "fp8:tensorwise": "bf16_with_fp8_current_scaling_mixed",
    "fp8:blockwise": "bf16_with_fp8_subchannel_scaling_mixed",
    "mxfp8": "bf16_with_mxfp8_mixed",
    "nvfp4": "bf16_with_nvfp4_mixed",
}


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name}: must be a positive integer, got {value!r}")


# The issue-18 knobs (axis keys, Layout fields) and the value each takes when it is not set (the field's default).
KNOBS: tuple[str, ...] = ("moe_token_dispatcher", "moe_a2a_overlap", "cuda_graph", "offload_layers", "fsdp")
_KNOB_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Layout) if f.name in KNOBS}
_KNOB_DEFAULT_VALUES: tuple[Any, ...] = tuple(_KNOB_DEFAULTS[name] for name in KNOBS)
# Read with one call each: plan serialises every layout of a space.
_knob_values = attrgetter(*(AXIS[name].field for name in KNOBS))


def _dict_display(attributes: dict[str, str]) -> Callable[[Layout], dict[str, Any]]:
    """``lambda lo: {key: lo.attribute, ...}`` of ``attributes`` (key: attribute), made as the dataclass module makes
    its methods: a dict display reads and builds in half the CPU of ``dict(zip(keys, attrgetter(...)(lo)))``, and
    ``plan --json`` writes every layout of a space (issue 54)."""
    if not all(key.isidentifier() and name.isidentifier() for key, name in attributes.items()):
        raise ValueError(f"not identifiers: {attributes}")
    return eval("lambda lo: {" + ", ".join(f"{k!r}: lo.{a}" for k, a in attributes.items()) + "}")


# to_dict's keys that every layout writes, in order: the contract's, then what rebuilding the layout needs.
_contract_dict = _dict_display({**{key: key for key in CONTRACT_KEYS}, "gpus": "world_size",
                                **{name: name for name in ("distributed_optimizer", "first_stage_layers",
                                                           "last_stage_layers")}})

_PARSED = {a.name: a for a in PARSED}


def parse_assignments(text: str, what: str = "--layout") -> dict[str, Any]:
    """Parse ``"tp=2,pp=2,sp=true"`` into typed values; raises LayoutError naming the bad item."""
    out: dict[str, Any] = {}
    if not text.strip():
        raise LayoutError(f"{what}: empty; expected key=value pairs such as 'tp=2,pp=2'")
    for item in text.split(","):
        key, sep, raw = (part.strip() for part in item.partition("="))
        key = key.lower()
        if not sep or not key or not raw:
            raise LayoutError(f"{what}: '{item.strip()}' is not key=value")
        if key not in _PARSED:
            raise LayoutError(f"{what}: unknown key '{key}' (known: {', '.join(_PARSED)})")
        if key in out:
            raise LayoutError(f"{what}: '{key}' given twice")
        out[key] = _parse_value(key, raw, what)
    return out


def _parse_value(key: str, raw: str, what: str) -> Any:
    kind = _PARSED[key].kind
    if kind == "int":
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:  # "²".isdigit() is true, int("²") fails
            raise LayoutError(f"{what}: {key} must be a positive integer, got '{raw}'")
        return int(raw)
    if kind == "bool":
        low = raw.lower()
        if key == "sp" and low == "auto":
            return "auto"
        if low not in ("true", "false", "1", "0", "on", "off", "yes", "no"):
            raise LayoutError(f"{what}: {key} must be true or false, got '{raw}'")
        return low in ("true", "1", "on", "yes")
    if kind == "int0":
        if not (raw.isascii() and raw.isdigit()):
            raise LayoutError(f"{what}: {key} must be 0 or a positive integer, got '{raw}'")
        return int(raw)
    if kind == "choice":
        choices = _PARSED[key].choices
        if raw.lower() not in choices:
            raise LayoutError(f"{what}: {key} must be one of {', '.join(choices)}, got '{raw}'")
        return raw.lower()
    if key == "cuda_graph":
        try:
            return canonical_cuda_graph(raw.lower())
        except LayoutError as exc:
            raise LayoutError(f"{what}: {exc}") from None
    if kind == "text":
        return raw  # case matters (E, L, t, m); Layout checks it is not empty
    if kind == "recompute":
        try:
            return canonical_recompute(raw.lower())
        except LayoutError as exc:
            raise LayoutError(f"{what}: {exc}") from None
    if raw.lower() not in PRECISIONS:
        raise LayoutError(f"{what}: {key} must be one of {', '.join(PRECISIONS)}, got '{raw}'")
    return raw.lower()


def recompute_modules(recompute: str) -> tuple[str, ...]:
    """The modules a (canonical) recompute value recomputes under selective granularity."""
    granularity, _, modules = recompute.partition(":")
    if granularity != "selective":
        return ()
    return tuple(modules.split("+")) if modules else DEFAULT_RECOMPUTE_MODULES


def canonical_recompute(value: str) -> str:
    """``none``, ``full``, ``selective`` or ``selective:m1+m2`` with Megatron's module names, modules in
    RECOMPUTE_MODULES order; ``selective:core_attn`` is ``selective``. Raises LayoutError naming the problem."""
    if not isinstance(value, str):
        raise LayoutError(f"recompute: must be a string such as 'selective', got {value!r}")
    granularity, sep, listed = value.partition(":")
    if granularity not in RECOMPUTES or (sep and granularity != "selective"):
        raise LayoutError(
            f"recompute: must be one of {', '.join(RECOMPUTES)} or selective:<modules> "
            f"(e.g. selective:moe_act+layernorm), got {value!r}"
        )
    if not sep:
        return granularity
    names = [m.strip() for m in listed.split("+")]
    unknown = [m for m in names if m not in RECOMPUTE_MODULES]
    if unknown:
        raise LayoutError(
            f"recompute: unknown module {unknown[0]!r} in {value!r} "
            f"(Megatron's recompute modules: {', '.join(RECOMPUTE_MODULES)})"
        )
    modules = tuple(m for m in RECOMPUTE_MODULES if m in names)
    return "selective" if modules == DEFAULT_RECOMPUTE_MODULES else "selective:" + "+".join(modules)


def canonical_cuda_graph(value: str) -> str:
    """``none``, ``local``, ``full_iteration`` or ``te:<scope>+<scope>`` with Megatron's CudaGraphScope names in
    CUDA_GRAPH_SCOPES order. Raises LayoutError naming the problem."""
    if not isinstance(value, str):
        raise LayoutError(f"cuda_graph: must be a string such as 'te:attn', got {value!r}")
    if value in ("none", "local", "full_iteration"):
        return value
    impl, sep, listed = value.partition(":")
    names = [m.strip() for m in listed.split("+")] if sep else []
    if impl != "te" or not names or not all(names):
        raise LayoutError(f"cuda_graph: must be none, local, full_iteration or te:<scopes> (e.g. "
                          f"te:attn+moe_router), got {value!r}")
    unknown = [m for m in names if m not in CUDA_GRAPH_SCOPES]
    if unknown:
        raise LayoutError(f"cuda_graph: unknown scope {unknown[0]!r} in {value!r} (Megatron's CUDA graph scopes "
                          f"for transformer_engine graphs: {', '.join(CUDA_GRAPH_SCOPES)})")
    return "te:" + "+".join(m for m in CUDA_GRAPH_SCOPES if m in names)


def graphed_scopes(cuda_graph: str) -> frozenset[str]:
    """The CUDA graph scopes a (canonical) cuda_graph value captures: every one for local and full-iteration
    graphs, the listed ones for ``te:<scopes>``, none for ``none``."""
    if cuda_graph == "none":
        return frozenset()
    if cuda_graph in ("local", "full_iteration"):
        return frozenset(CUDA_GRAPH_SCOPES)
    return frozenset(cuda_graph.partition(":")[2].split("+"))


def resolve_sp(value: str | bool, tp: int) -> bool:
    """Sequence parallelism as a space or ``--only`` gives it: ``auto`` is on whenever TP > 1."""
    return tp > 1 if value == "auto" else bool(value)
