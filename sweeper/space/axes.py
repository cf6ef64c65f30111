"""The axis table: every axis of a layout, written once, with the names each consumer knows it by.

One ``Axis`` per entry: its key (in ``space:``, ``--layout``, ``--only``, the Optuna parameters and the layout JSON),
its kind, its default values in a search space, and its Megatron names: Megatron-Core's (``TransformerConfig`` /
``initialize_model_parallel``; also the MLflow parameter), the Megatron-LM flag and the Megatron-Bridge override keys.
The YAML schema of ``space:`` (``config.schema``), ``--layout`` parsing (``space.layout.parse_assignments``),
enumeration (``plan.space``), Optuna's parameters (``search.propose.study``), MLflow's parameters
(``record.tracking``), the report's per-axis figure and the Megatron-LM / Bridge exports (``Layout.megatron_args`` /
``bridge_overrides``) are all derived from it. Adding an axis is one entry here, its ``Layout`` field and its rules
(``plan.rules``).

Precision and recompute are exported through their own tables in ``space.layout`` (one value sets several flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["int", "int0", "bool", "precision", "recompute", "text", "choice"]
# Megatron's --fp8-recipe values of per-tensor and per-block FP8 (E4M3/E5M2 with FP32 scales): delayed scaling
# (scales from an amax history), tensorwise ("current scaling": each tensor's own amax, every GEMM) and blockwise
# (DeepSeek-V3's 1x128 activation / 128x128 weight blocks). MXFP8 and NVFP4 are precisions of their own.
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "blockwise")
# "fp8" alone is FP8 in the sweep's run.fp8_recipe (auto: by compute capability); "fp8:<recipe>" names the recipe,
# so one space compares recipes like any other axis value.
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", *(f"fp8:{r}" for r in FP8_RECIPES), "mxfp8", "nvfp4")
# Precisions whose GEMMs run in a Transformer Engine quantisation recipe (BF16 parameters, TE's quantised copies):
# FP8 (delayed / tensorwise / blockwise), MXFP8 and NVFP4 (Megatron's --fp4-format e2m1 --fp4-recipe nvfp4).
QUANTIZED: tuple[str, ...] = tuple(p for p in PRECISIONS if p.startswith(("fp8", "mxfp8", "nvfp4")))


def precision_dtype(precision: str) -> str:
    """The precision without its recipe: ``fp8`` for ``fp8`` and every ``fp8:<recipe>``; others unchanged."""
    return precision.partition(":")[0]


def named_fp8_recipe(precision: str) -> str | None:
    """The FP8 recipe a precision value names (``fp8:tensorwise`` -> tensorwise); None for bare ``fp8`` (the run's
    recipe) and every other precision."""
    return precision.partition(":")[2] or None
# Megatron's MoE token dispatchers (moe_token_dispatcher_type); "flex:<backend>" also sets moe_flex_dispatcher_backend.
DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather", "flex:deepep", "flex:hybridep")
# CUDA graphs: none; "local" (Megatron's own graphs of whole layers, cuda_graph_impl=local, scope empty);
# "full_iteration" (local, the whole forward-backward step); "te:<scope>+<scope>" (cuda_graph_impl=transformer_engine
# with those cuda_graph_scope parts of each layer, e.g. te:attn+moe_router+moe_preprocess).
CUDA_GRAPH_SCOPES: tuple[str, ...] = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
# The block (sweeper.models.spec.Block) each scope captures part of: the moe block's router, preprocess and experts
# are separate scopes.
SCOPE_BLOCK: dict[str, str] = {"attn": "attention", "mlp": "mlp", "moe": "moe", "moe_router": "moe",
                               "moe_preprocess": "moe", "mamba": "mamba"}
# Megatron-FSDP's data_parallel_sharding_strategy values that shard something: the optimizer state (ZeRO-1), also
# the gradients (ZeRO-2), also the parameters (ZeRO-3, gathered per decoder layer). Its "no_shard" is left out: it
# replicates everything as Megatron's DDP does, and fails with the distributed optimizer Megatron-FSDP asks for.
FSDP_STRATEGIES: tuple[str, ...] = ("optim", "optim_grads", "optim_grads_params")
# The pipeline_layout value that leaves the split to sweeper (a Layout holds it as None).
AUTO_LAYOUT = "auto"


@dataclass(frozen=True)
class Axis:
    name: str
    kind: Kind
    doc: str
    # A search-space axis (a ``space:`` key Optuna suggests) and its default values there; None for ``gpus``
    # means every GPU of the cluster.
    searched: bool = False
    space_default: tuple[Any, ...] | None = None
    parse: bool = True  # accepted by --layout / --only
    attr: str | None = None  # the Layout attribute or property; None = the name
    megatron: str | None = None  # Megatron-Core's name; the MLflow parameter
    megatron_attr: str | None = None  # the Layout attribute holding the value under that name; None = attr
    flag: str | None = None  # Megatron-LM flag: --flag=VALUE for numbers and text, --flag for a true bool
    omit: Any = None  # a value the Megatron-LM flag is left out for (besides None / false)
    bridge: tuple[str, ...] = ()  # Megatron-Bridge override keys
    bridge_null: Any = None  # a value Bridge is given as null (None: none; a None value is never exported)
    bridge_always: bool = False  # a bool Bridge is always given (true/false), not only when true
    choices: tuple[str, ...] = ()  # the values of a "choice" axis

    @property
    def field(self) -> str:
        return self.attr or self.name

    @property
    def param(self) -> str:
        """The axis's parameter name in MLflow and Optuna: its Megatron name, else its key."""
        return self.megatron or self.name

    def value(self, layout: Any) -> Any:
        return getattr(layout, self.field)

    def megatron_value(self, layout: Any) -> Any:
        return getattr(layout, self.megatron_attr or self.field)


_PP_SPLIT = "pipeline split (set by sweeper when the layers do not divide by PP x VPP)"
AXES: tuple[Axis, ...] = (
    Axis("gpus", "int", "trial world size (GPUs)", searched=True, space_default=None, attr="world_size",
         megatron="world_size"),
    Axis("tp", "int", "tensor parallel size", searched=True, space_default=(1,),
         megatron="tensor_model_parallel_size", flag="tensor-model-parallel-size",
         bridge=("model.tensor_model_parallel_size",)),
    Axis("pp", "int", "pipeline parallel size", searched=True, space_default=(1,),
         megatron="pipeline_model_parallel_size", flag="pipeline-model-parallel-size",
         bridge=("model.pipeline_model_parallel_size",)),
    Axis("vpp", "int", "virtual pipeline stages per pipeline rank (interleaved schedule); 1 = none",
         searched=True, space_default=(1,), megatron="virtual_pipeline_model_parallel_size",
         flag="num-virtual-stages-per-pipeline-rank", omit=1,
         bridge=("model.virtual_pipeline_model_parallel_size",), bridge_null=1),
    Axis("cp", "int", "context parallel size", searched=True, space_default=(1,),
         megatron="context_parallel_size", flag="context-parallel-size", bridge=("model.context_parallel_size",)),
    Axis("ep", "int", "expert parallel size", searched=True, space_default=(1,),
         megatron="expert_model_parallel_size", flag="expert-model-parallel-size",
         bridge=("model.expert_model_parallel_size",)),
    Axis("etp", "int", "expert tensor parallel size", searched=True, space_default=(1,),
         megatron="expert_tensor_parallel_size", flag="expert-tensor-parallel-size",
         bridge=("model.expert_tensor_parallel_size",)),
    Axis("sp", "bool", "sequence parallelism; auto = on whenever TP > 1", searched=True, space_default=("auto",),
         megatron="sequence_parallel", flag="sequence-parallel", bridge=("model.sequence_parallel",),
         bridge_always=True),
    Axis("mbs", "int", "micro-batch size", searched=True, space_default=(1,), megatron="micro_batch_size",
         flag="micro-batch-size", bridge=("train.micro_batch_size",)),
    Axis("precision", "precision", "compute precision: " + ", ".join(PRECISIONS), searched=True,
         space_default=("bf16",), megatron="precision"),
    Axis("recompute", "recompute", "activation recompute: none | selective | full | selective:<modules>, e.g. "
         "selective:moe_act+layernorm (Megatron's recompute modules)", searched=True, space_default=("none",),
         megatron="recompute_granularity", megatron_attr="recompute_granularity"),
    # Issue 18: the knobs of the memory, communication and compute walls. Each defaults to what sweeper ran before.
    Axis("moe_token_dispatcher", "choice", "MoE token dispatcher: " + " | ".join(DISPATCHERS) + " (unset: alltoall "
         "as before the axis existed; exported only when set)", searched=True, space_default=(None,),
         megatron="moe_token_dispatcher_type", choices=DISPATCHERS),
    Axis("moe_a2a_overlap", "bool", "overlap the expert all-to-all with another micro-batch's compute",
         searched=True, space_default=(False,), megatron="overlap_moe_expert_parallel_comm",
         flag="overlap-moe-expert-parallel-comm",
         bridge=("model.overlap_moe_expert_parallel_comm", "comm_overlap.overlap_moe_expert_parallel_comm")),
    Axis("cuda_graph", "text", "CUDA graphs: none | local | full_iteration | te:<scopes> with scopes from "
         + "+".join(CUDA_GRAPH_SCOPES), searched=True, space_default=("none",)),
    Axis("offload_layers", "int0", "decoder layers whose activations are offloaded to the host "
         "(Megatron's cpu_offloading_num_layers); 0 = none", searched=True, space_default=(0,),
         megatron="cpu_offloading_num_layers", flag="cpu-offloading-num-layers", omit=0),
    Axis("fsdp", "choice", "Megatron-FSDP instead of Megatron's DDP, with its sharding strategy: "
         + " | ".join(FSDP_STRATEGIES) + " (unset: DDP)", searched=True, space_default=(None,),
         megatron="data_parallel_sharding_strategy", flag="data-parallel-sharding-strategy",
         bridge=("ddp.data_parallel_sharding_strategy",), choices=FSDP_STRATEGIES),
    Axis("distributed_optimizer", "bool", "shard the optimizer state over data-parallel ranks", searched=True,
         space_default=(True,), megatron="use_distributed_optimizer", flag="use-distributed-optimizer",
         bridge=("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"), bridge_always=True),
    # Not searched: the global batch comes from training.global_batch_size, DP and EDP follow from the world size.
    Axis("gbs", "int", "global batch size", megatron="global_batch_size", flag="global-batch-size",
         bridge=("train.global_batch_size",)),
    Axis("dp", "int", "data parallel size: W / (TP x PP x CP)", megatron="data_parallel_size"),
    Axis("edp", "int", "expert data parallel size: W / (ETP x EP x PP)", megatron="expert_data_parallel_size"),
    Axis("account_for_embedding", "bool", _PP_SPLIT + ": the embedding counts as a layer",
         megatron="account_for_embedding_in_pipeline_split", flag="account-for-embedding-in-pipeline-split",
         bridge=("model.account_for_embedding_in_pipeline_split",)),
    Axis("account_for_loss", "bool", _PP_SPLIT + ": the loss counts as a layer",
         megatron="account_for_loss_in_pipeline_split", flag="account-for-loss-in-pipeline-split",
         bridge=("model.account_for_loss_in_pipeline_split",)),
    Axis("pipeline_layout", "text", "Megatron's pipeline layout string, e.g. Et|(tt|)*30mL (no commas; it sets "
         "the virtual stages itself), or auto: the split sweeper picks where the layers do not divide by PP x VPP "
         "(uneven first/last stages or the embedding and loss accounted as layers) and, besides it, the balanced "
         "layout string (space.pipeline.balanced_layout)", searched=True, space_default=(AUTO_LAYOUT,),
         megatron="pipeline_model_parallel_layout", flag="pipeline-model-parallel-layout",
         bridge=("model.pipeline_model_parallel_layout",)),
    Axis("first_stage_layers", "int", _PP_SPLIT + ": decoder layers on the first stage", parse=False,
         megatron="num_layers_in_first_pipeline_stage", flag="decoder-first-pipeline-num-layers",
         bridge=("model.num_layers_in_first_pipeline_stage",)),
    Axis("last_stage_layers", "int", _PP_SPLIT + ": decoder layers on the last stage", parse=False,
         megatron="num_layers_in_last_pipeline_stage", flag="decoder-last-pipeline-num-layers",
         bridge=("model.num_layers_in_last_pipeline_stage",)),
)
AXIS: dict[str, Axis] = {a.name: a for a in AXES}
SEARCHED: tuple[Axis, ...] = tuple(a for a in AXES if a.searched)  # the space's axes, in Optuna's order
PARSED: tuple[Axis, ...] = tuple(a for a in AXES if a.parse)  # what --layout / --only accept

# The keys of the contract's JSON "layout" object (docs/ARCHITECTURE.md), in the contract's order.
CONTRACT_KEYS: tuple[str, ...] = ("tp", "pp", "cp", "dp", "ep", "etp", "edp", "vpp", "sp", "mbs", "gbs", "precision",
                                  "recompute")
# Megatron-Core's parallel sizes (initialize_model_parallel / TransformerConfig) and pipeline-split options.
PARALLEL_SIZES: tuple[str, ...] = ("tp", "pp", "vpp", "cp", "ep", "etp")
PIPELINE_SPLIT: tuple[str, ...] = ("first_stage_layers", "last_stage_layers", "account_for_embedding",
                                   "account_for_loss", "pipeline_layout")
