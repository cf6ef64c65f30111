"""Megatron's layout validity rules, checked before launch: one place, every rule with its reason.

Each rule is a function ``(ctx) -> str | None`` returning the reason a layout is invalid in the user's terms,
quoting Megatron-Core 0.16's own wording where it has one (the source is named beside each rule). ``check``
returns every reason that applies, so ``plan`` can group invalid layouts by cause. Rules only depend on the
model, the layout, the cluster and the sequence length; what a backend cannot run (e.g. CP on CPU) is not a
rule: the trial reports it as "unsupported".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from packaging.version import Version

from sweeper.config import megatron_release
from sweeper.config.run_settings import RunSettings
from sweeper.config.schema import ClusterConfig
from sweeper.models.spec import ModelSpec
from sweeper.space.axes import PIPELINE_SPLIT
from sweeper.space.layout import Layout
from sweeper.space.pipeline import accounted_split, check_layout, uneven_split


@dataclass(frozen=True)
class RuleContext:
    model: ModelSpec
    layout: Layout
    cluster: ClusterConfig
    seq_length: int
    # The sweep's run settings: the FP8 recipe of a bare fp8 and the optimizer settings some rules read. One value
    # per sweep, so the Checker's memos stay keyed by layout fields alone.
    run: RunSettings = RunSettings()

    @property
    def fp8_recipe(self) -> str | None:
        """The FP8 recipe this layout runs on the cluster (fp8:<recipe>, or run.fp8_recipe for bare fp8)."""
        return self.run.recipe(self.layout.precision, self.cluster.compute_capability)


Rule = Callable[[RuleContext], "str | None"]
RULES: list[Rule] = []
# The layout fields (or derived sizes) each rule reads; its verdict depends on nothing else of the layout.
READS: dict[Rule, tuple[str, ...]] = {}


def rule(*reads: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES.append(fn)
        READS[fn] = reads
        return fn

    return register


def check(model: ModelSpec, layout: Layout, cluster: ClusterConfig, seq_length: int,
          run: RunSettings = RunSettings()) -> list[str]:
    """Every reason Megatron (or the cluster) would reject this layout under ``run``; empty when it is valid."""
    ctx = RuleContext(model, layout, cluster, seq_length, run)
    return [reason for fn in RULES if (reason := fn(ctx))]


# The layout fields each derived size of READS is computed from (``Layout.dp``, ``Layout.num_microbatches``): the
# Checker keys a rule reading one by these instead, read out of the layout's field dict, where the property would be
# a Python call per layout.
DERIVED_FROM: dict[str, tuple[str, ...]] = {
    "dp": ("world_size", "tp", "pp", "cp"),
    "num_microbatches": ("world_size", "tp", "pp", "cp", "gbs", "mbs"),
}
# Families of fields a space varies together: the parallel grid, the batch over it, one rank's tensor shapes; the
# rule groups inside a family share one memo (the Checker's), every other group the family of the rest.
FAMILIES: tuple[frozenset[str], ...] = (
    frozenset({"world_size", "tp", "pp", "cp", "ep", "etp"}),
    frozenset({"world_size", "tp", "pp", "cp", "vpp", "gbs", "mbs"}),
    frozenset({"tp", "sp", "cp", "etp", "mbs", "precision"}),
)

Verdict = list[tuple[int, str]]  # (the rule's place in RULES, its reason) of each rule that refuses the layout
_Group = tuple[list[tuple[int, Rule]], Callable[[dict[str, Any]], Any], dict[Any, Verdict]]


class Checker:
    """``check`` for the many layouts of one model, cluster and sequence length (a space): each rule's verdict is
    kept per value of the fields it reads (``READS``), and the verdicts of a family of rules per value of all their
    fields, so a space of a hundred thousand layouts costs each rule a handful of evaluations, each family a few
    thousand, and each layout one read of its fields and a lookup per family."""

    def __init__(self, model: ModelSpec, cluster: ClusterConfig, seq_length: int,
                 run: RunSettings = RunSettings()) -> None:
        self.model, self.cluster, self.seq_length, self.run = model, cluster, seq_length, run
        # One memo per group of rules, keyed by the fields the group reads. A rule whose fields are a subset of a
        # larger group's joins that group: keyed by more fields its verdict is still right (the memo only holds more
        # entries, a few hundred at most), and a new key costs one lookup per group: about ten instead of thirty.
        reads = {fn: frozenset(f for name in READS[fn] for f in DERIVED_FROM.get(name, (name,))) for fn in RULES}
        largest_first = sorted(dict.fromkeys(reads.values()), key=len, reverse=True)
        keys: list[frozenset[str]] = []
        for fields in largest_first:
            if not any(fields <= key for key in keys):
                keys.append(fields)
        groups: dict[frozenset[str], list[Rule]] = {key: [] for key in keys}
        for fn in RULES:
            groups[min((key for key in keys if reads[fn] <= key), key=len)].append(fn)
        order = {fn: i for i, fn in enumerate(RULES)}
        families: dict[frozenset[str] | None, list[tuple[frozenset[str], list[Rule]]]] = {}
        for key, fns in groups.items():
            family = next((f for f in FAMILIES if key <= f), None)
            families.setdefault(family, []).append((key, fns))
        # Per family: the key of all its groups' fields, its memo of their combined verdict, and the groups.
        self._families: list[tuple[Callable[[dict[str, Any]], Any], dict[Any, Verdict], list[_Group]]] = [
            (_key_of(frozenset().union(*(key for key, _ in members))), {},
             [([(order[fn], fn) for fn in fns], _key_of(key), {}) for key, fns in members])
            for members in families.values()]

    def __call__(self, layout: Layout) -> list[str]:
        values = vars(layout)  # a frozen dataclass's fields: read by name, cheaper than an attribute read each
        found: Verdict = []
        for key_of, memo, groups in self._families:
            key = key_of(values)
            verdict = memo.get(key)
            if verdict is None:
                verdict = memo[key] = self._judge(layout, values, groups)
            if verdict:
                found += verdict
        if len(found) > 1:
            found.sort()
        return [reason for _, reason in found]

    def _judge(self, layout: Layout, values: dict[str, Any], groups: list[_Group]) -> Verdict:
        """The combined verdict of a family's groups on ``layout`` (its ``values``), each group's from its memo."""
        ctx: RuleContext | None = None
        found: Verdict = []
        for rules, key_of, memo in groups:
            key = key_of(values)
            verdict = memo.get(key)
            if verdict is None:
                if ctx is None:
                    ctx = RuleContext(self.model, layout, self.cluster, self.seq_length, self.run)
                verdict = memo[key] = [(i, r) for i, fn in rules if (r := fn(ctx))]
            found += verdict
        return found


def _key_of(fields: frozenset[str]) -> Callable[[dict[str, Any]], Any]:
    """The values of ``fields`` out of a layout's field dict (in sorted order: one key whatever the set's order)."""
    return itemgetter(*sorted(fields)) if fields else lambda values: ()


# -- sizes (parallel_state.initialize_model_parallel) ------------------------------------------------------------
@rule("world_size", "tp", "pp", "cp")
def world_divides_model_parallel(c: RuleContext) -> str | None:
    lo = c.layout
    if lo.world_size % lo.model_parallel:
        return (
            f"world size ({lo.world_size}) is not divisible by tensor_model_parallel_size ({lo.tp}) x "
            f"pipeline_model_parallel_size ({lo.pp}) x context_parallel_size ({lo.cp})"
        )
    return None


@rule("world_size", "etp", "ep", "pp")
def world_divides_expert_parallel(c: RuleContext) -> str | None:
    lo = c.layout
    if lo.world_size % (lo.etp * lo.ep * lo.pp):
        return (
            f"world size ({lo.world_size}) is not divisible by expert_tensor_parallel_size ({lo.etp}) x "
            f"expert_model_parallel_size ({lo.ep}) x pipeline_model_parallel_size ({lo.pp}) (MoE parallel folding)"
        )
    return None


@rule("world_size")
def within_cluster(c: RuleContext) -> str | None:
    if c.layout.world_size > c.cluster.total_gpus:
        return f"needs {c.layout.world_size} GPUs but the cluster has {c.cluster.total_gpus}"
    return None


# -- topology ----------------------------------------------------------------------------------------------------
@rule("tp", "world_size")
def tp_inside_node(c: RuleContext) -> str | None:
    tp, per_node = c.layout.tp, c.cluster.gpus_per_node
    if tp > per_node or (c.layout.world_size > per_node and per_node % tp):
        return (
            f"a tensor-parallel group of {tp} GPUs cannot stay inside one node of {per_node} GPUs "
            "(TP traffic is the heaviest; across nodes it would run over the inter-node network)"
        )
    return None


@rule("world_size")
def multi_node_trial_fills_nodes(c: RuleContext) -> str | None:
    w, per_node = c.layout.world_size, c.cluster.gpus_per_node
    if w > per_node and w % per_node:
        return f"a {w}-GPU trial spans nodes but is not a whole number of {per_node}-GPU nodes"
    return None


# -- virtual pipeline ----------------------------------------------------------------------------------------------
@rule("vpp", "pp")
def vpp_needs_pp(c: RuleContext) -> str | None:
    if c.layout.vpp > 1 and c.layout.pp == 1:
        return "virtual pipeline (interleaved schedule) needs pipeline_model_parallel_size > 1"
    return None


@rule("vpp")
def vpp_not_hybrid(c: RuleContext) -> str | None:
    if c.layout.vpp > 1 and c.model.is_hybrid:
        # 0.16: MambaModel has no virtual stages; 0.19: HybridModel's automatic split raises with VPP
        # (models/hybrid/hybrid_layer_allocation.py), accepting it only from a pattern with "|" stage marks.
        return ("hybrid Mamba models do not support the interleaved (virtual pipeline) schedule without explicit "
                "pipeline stage marks in the layer pattern (megatron-core 0.16 not at all)")
    return None


@rule("vpp", "pp", "num_microbatches")
def interleaved_microbatches(c: RuleContext) -> str | None:
    lo = c.layout
    m = lo.num_microbatches
    if lo.vpp > 1 and lo.pp > 1 and m and (m < lo.pp or m % lo.pp):
        return (
            f"interleaved schedule needs the number of micro-batches ({m}) to be >= and a multiple of "
            f"pipeline_model_parallel_size ({lo.pp}) (pipeline_parallel/schedules.py)"
        )
    return None


# -- sequence parallel ---------------------------------------------------------------------------------------------
@rule("sp", "tp")
def sp_needs_tp(c: RuleContext) -> str | None:
    if c.layout.sp and c.layout.tp == 1:
        return "Cannot use sequence parallelism without tensor parallelism"
    return None


@rule("tp", "sp")
def moe_tp_needs_sp(c: RuleContext) -> str | None:
    if c.model.is_moe and c.layout.tp > 1 and not c.layout.sp:
        return (
            "MoE with tensor parallelism needs sequence parallelism: megatron raises 'During training, performance "
            "may degrade if MoE and tensor parallelism are enabled without also enabling sequence parallelism.'"
        )
    return None


@rule("tp", "sp")
def mla_tp_needs_sp(c: RuleContext) -> str | None:
    # Not a Megatron check but a megatron-core defect in 0.16.1 and 0.19.2 (measured on the CPU backend
    # with TE's layer, FP32: 2-layer MLA, TP2, gradient norm 2.0784 vs 2.11566 unsharded). MLA's shared rotary key
    # k_pos_emb comes out of the duplicated linear_kv_down_proj whole on every TP rank, and each rank feeds it to its
    # own heads only. Under SP its all-gather's backward sums the ranks' shares; without SP nothing does, so each
    # rank keeps its heads' share of that gradient (multi_latent_attention.py get_query_key_value_tensors).
    # Re-checked on 0.19.2: the duplicated branch still gathers k_pos_emb only under SP (multi_latent_attention.py
    # lines 752-754), TELinear's duplicated weights are marked sequence_parallel = config.sequence_parallel
    # (extensions/transformer_engine.py lines 1057-1062), and finalize_model_grads sums such grads over TP only
    # under SP (_allreduce_non_tensor_model_parallel_grads, lines 451-452); test_mla_gradients.py's TP2-without-SP
    # case still loses the gradient there. Open upstream: NVIDIA/Megatron-LM#1699, fix proposed in #6839.
    if c.model.multi_latent_attention and c.layout.tp > 1 and not c.layout.sp:
        return (
            f"multi-latent attention with tensor_model_parallel_size {c.layout.tp} needs sequence parallelism: "
            f"without it megatron-core (0.16.1 and 0.19.2, checked) never sums the shared rotary key's (k_pos_emb) "
            f"gradient over the TP ranks, so each keeps only its own heads' share and the layout trains another "
            f"model (NVIDIA/Megatron-LM#1699, unfixed in any release); use sp=true"
        )
    return None


@rule("sp", "tp", "cp")
def sp_sequence_divisible(c: RuleContext) -> str | None:
    lo = c.layout
    if lo.sp and c.seq_length % (lo.tp * lo.cp):
        return f"sequence parallel needs seq_length ({c.seq_length}) divisible by TP x CP ({lo.tp * lo.cp})"
    return None


# -- attention heads (transformer_config.py __post_init__) ---------------------------------------------------------
@rule("tp")
def heads_divisible_by_tp(c: RuleContext) -> str | None:
    heads, tp = c.model.num_attention_heads, c.layout.tp
    # TransformerConfig checks this for every model, even a hybrid one without attention layers.
    if heads % tp:
        return f"num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp})."
    return None


@rule("tp")
def query_groups_vs_tp(c: RuleContext) -> str | None:
    groups, tp = c.model.query_groups, c.layout.tp
    if not c.model.multi_latent_attention and groups % tp and tp % groups:
        return f"num_query_groups ({groups}) must be a multiple or divisor of tensor_model_parallel_size ({tp})."
    return None


@rule("tp", "etp")
def linear_widths_divisible(c: RuleContext) -> str | None:
    """Tensor-parallel linears split their width with megatron.core.utils.divide, asserted at model build."""
    m, lo = c.model, c.layout
    widths: list[tuple[str, int, str, int]] = []  # (what, width, parallel size name, size)
    if m.has_attention and not m.multi_latent_attention:
        qkv = (m.num_attention_heads + 2 * m.query_groups) * m.head_dim
        widths.append(("the fused QKV projection width", qkv, "tensor_model_parallel_size", lo.tp))
    if m.count("mlp"):
        widths.append(("ffn_hidden_size", m.ffn_hidden_size, "tensor_model_parallel_size", lo.tp))
    if m.is_moe:
        widths.append(("moe_ffn_hidden_size", m.expert_ffn_hidden_size, "expert_tensor_parallel_size", lo.etp))
        if m.moe_shared_expert_intermediate_size:
            shared = m.moe_shared_expert_intermediate_size
            widths.append(("moe_shared_expert_intermediate_size", shared, "tensor_model_parallel_size", lo.tp))
    for what, width, name, size in widths:
        if width % size:
            return f"{what} ({width}) is not divisible by {name} ({size}) (tensor-parallel linear layers)"
    return None


# -- Mamba (ssm/mamba_mixer.py) -----------------------------------------------------------------------------------
@rule("tp", "cp")
def mamba_heads_and_groups(c: RuleContext) -> str | None:
    m, tp, cp = c.model, c.layout.tp, c.layout.cp
    if not m.count("mamba"):
        return None
    heads, groups = m.mamba_heads, m.mamba_num_groups
    if heads % groups:
        return f"Mamba heads ({heads}) must be a multiple of Mamba groups ({groups})"
    if heads % tp:
        return f"Mamba heads ({heads}) must be divisible by tensor_model_parallel_size ({tp})"
    if groups % tp:
        return f"Mamba groups ({groups}) must be divisible by tensor_model_parallel_size ({tp})"
    if cp > 1 and (heads // tp) % cp:
        return f"Mamba heads per TP rank ({heads // tp}) must be divisible by context_parallel_size ({cp})"
    return None


# -- pipeline split (transformer_block.py, transformer_config.py "Uneven PP") -------------------------------------
@rule("pp", *PIPELINE_SPLIT)
def pipeline_split_options(c: RuleContext) -> str | None:
    """transformer_config.py __post_init__: the options exclude each other; hybrid models ignore two of them."""
    lo = c.layout
    accounted = lo.account_for_embedding or lo.account_for_loss
    uneven = lo.first_stage_layers is not None or lo.last_stage_layers is not None
    if lo.pipeline_layout and (accounted or uneven):
        return ("pipeline_model_parallel_layout cannot be set with other pipeline layout arguments "
                "(num_layers_in_first/last_pipeline_stage, account_for_embedding/loss_in_pipeline_split)")
    if accounted and uneven:
        return ("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the same "
                "time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split")
    if (accounted or lo.pipeline_layout) and c.model.is_hybrid:
        return ("a hybrid Mamba model ignores account_for_embedding/loss_in_pipeline_split and "
                "pipeline_model_parallel_layout (megatron-core 0.16's MambaStack._select_layers_for_pipeline_parallel "
                "and 0.19's select_pipeline_segment split the layer pattern alone), so the split would not be the "
                "one asked for")
    if (accounted or lo.pipeline_layout) and lo.pp == 1:
        return "pipeline-split options need pipeline_model_parallel_size > 1"
    return None


@rule("pp", "vpp", *PIPELINE_SPLIT)
def pipeline_split(c: RuleContext) -> str | None:
    lo, layers = c.layout, c.model.num_layers
    if lo.pp == 1:
        return None
    if lo.pipeline_layout:
        try:
            stages = check_layout(lo.pipeline_layout, lo.pp, layers, c.model.mtp_num_layers)
        except ValueError as exc:
            return str(exc)
        if len(stages) // lo.pp != lo.vpp:
            return (f"virtual_pipeline_model_parallel_size ({lo.vpp}) conflicts with pipeline_model_parallel_layout "
                    f"({len(stages)} stages on {lo.pp} pipeline ranks: {len(stages) // lo.pp} per rank)")
        return None
    if lo.account_for_embedding or lo.account_for_loss:
        slots = layers + lo.account_for_embedding + lo.account_for_loss
        if slots % lo.pp:
            return (f"num_layers ({layers}) after enabling account_for_embedding_in_pipeline_split or "
                    f"account_for_loss_in_pipeline_split ({slots}) must be divisible by pipeline_model_parallel_size "
                    f"({lo.pp})")
        if (slots // lo.pp) % lo.vpp:
            return (f"number of layers on each pipeline rank ({slots // lo.pp}, after enabling "
                    f"account_for_embedding/loss_in_pipeline_split) must be divisible by "
                    f"virtual_pipeline_model_parallel_size ({lo.vpp})")
        return None
    if layers < lo.pp:  # (accounting or a layout string may leave a stage with no decoder layer: checked above)
        return f"num_layers ({layers}) is smaller than pipeline_model_parallel_size ({lo.pp})"
    if lo.first_stage_layers is None and lo.last_stage_layers is None:
        if layers % lo.pp == 0:
            per_stage = layers // lo.pp
            if per_stage % lo.vpp:
                return (
                    f"layers per pipeline rank ({per_stage}) must be divisible by the virtual pipeline size ({lo.vpp})"
                )
            return None
        if c.model.is_hybrid:
            return (
                f"num_layers ({layers}) is not divisible by pipeline_model_parallel_size ({lo.pp}); megatron-core "
                "0.16 would silently drop layers of a hybrid Mamba model (integer division) and 0.19 refuses it"
            )
        if uneven_split(layers, lo.pp, lo.vpp) is None and accounted_split(layers, lo.pp, lo.vpp) is None:
            return (
                f"num_layers ({layers}) is not divisible by pipeline_model_parallel_size ({lo.pp}), and neither an "
                f"uneven first/last-stage split nor accounting for the embedding and the loss in the split fits"
                + (f" with virtual pipeline size {lo.vpp}" if lo.vpp > 1 else "")
            )
        return f"num_layers ({layers}) needs an uneven pipeline split; call space.pipeline.with_pipeline_split first"
    first, last = lo.first_stage_layers, lo.last_stage_layers
    for stage, count in (("first", first), ("last", last)):
        if count is not None and count <= 0:
            return f"num_layers_in_{stage}_pipeline_stage must be larger than 0"
        if count is not None and count % lo.vpp:
            return (
                f"number of layers at {stage} stage ({count}) must be divisible by virtual pipeline parallel "
                f"degree ({lo.vpp})"
            )
    middle_stages = lo.pp - (first is not None) - (last is not None)
    middle = layers - (first or 0) - (last or 0)
    if middle < 0 or bool(middle) != bool(middle_stages) or (middle_stages and middle % middle_stages):
        return f"uneven split {first or 0}/{middle}/{last or 0} does not fit {layers} layers on {lo.pp} pipeline stages"
    if middle_stages and (middle // middle_stages) % lo.vpp:
        return (
            f"number of layers on each middle pipeline rank ({middle // middle_stages}) must be divisible by "
            f"virtual pipeline parallel degree ({lo.vpp})"
        )
    return None


@rule("moe_a2a_overlap", "pp")
def mtp_with_a2a_overlap(c: RuleContext) -> str | None:
    """transformer_config.py __post_init__ with overlap_moe_expert_parallel_comm and multi-token prediction."""
    mtp = c.model.mtp_num_layers
    if not (c.layout.moe_a2a_overlap and mtp):
        return None
    if mtp != 1:
        return "MTP layernum only supports 1 when enabling overlap_moe_expert_parallel_comm."
    if c.layout.pp == 1:
        return ("Pipeline model parallel size must be larger than 1 when enabling overlap_moe_expert_parallel_comm "
                "with MTP layer.")
    return None


# -- MoE (moe_layer.py, transformer_config.py) --------------------------------------------------------------------
@rule("ep")
def ep_needs_experts(c: RuleContext) -> str | None:
    if c.layout.ep > 1 and not c.model.is_moe:
        return "num_moe_experts must be non None to use expert-parallel."
    return None


@rule("etp")
def etp_needs_experts(c: RuleContext) -> str | None:
    if c.layout.etp > 1 and not c.model.is_moe:
        return "expert_tensor_parallel_size > 1 only applies to MoE models (this model has no experts)"
    return None


@rule("ep")
def experts_divisible_by_ep(c: RuleContext) -> str | None:
    experts, ep = c.model.num_moe_experts, c.layout.ep
    if experts is not None and experts % ep:
        return f"num_moe_experts ({experts}) must be divisible by expert_model_parallel_size ({ep}) (moe_layer.py)"
    return None


EXPERT_GRADS_FIXED_IN = Version("0.19")  # the first release checked to reduce expert gradients over expert DP


@rule("ep", "etp", "tp")
def expert_grads_reduced_over_expert_dp(c: RuleContext) -> str | None:
    # Not a Megatron check but a megatron-core <= 0.16.1 defect (measured: TP2 ETP1 EP1 replicas differ after one
    # step). The expert linears set param.allreduce = not (EP > 1) (tensor_parallel/layers.py, moe/experts.py,
    # extensions/transformer_engine.py), so with EP 1 DDP puts expert weights in the dense buffers and reduces
    # their gradients over the data-parallel group (TP*PP ranks apart) instead of the expert-data-parallel group.
    # The groups are the same only when ETP == TP; otherwise each expert replica keeps its own tokens' gradient.
    # Fixed upstream by NVIDIA/Megatron-LM#5916 (expert params become `is_expert and (EP > 1 or ETP != TP)`): in
    # 0.19.2 (tensor_parallel/layers.py use_expert_pgs; TP2 ETP1 EP1 replicas then stay equal), not checked in 0.17
    # or 0.18, so refused below 0.19.
    lo = c.layout
    if c.model.is_moe and lo.ep == 1 and lo.etp != lo.tp and megatron_release.installed() < EXPERT_GRADS_FIXED_IN:
        return (
            f"expert_tensor_parallel_size ({lo.etp}) != tensor_model_parallel_size ({lo.tp}) with "
            f"expert_model_parallel_size 1: megatron-core {megatron_release.installed()} treats expert weights as "
            f"dense when EP == 1 "
            f"(param.allreduce=True), so their gradients are reduced over the data-parallel group instead of the "
            f"expert-data-parallel group and the expert replicas drift apart (fixed in megatron-core 0.19, "
            f"NVIDIA/Megatron-LM#5916); use ETP = TP or EP > 1"
        )
    return None


@rule("etp")
def expert_bias_needs_etp1(c: RuleContext) -> str | None:
    if c.model.is_moe and c.model.add_bias_linear and c.layout.etp != 1:
        return "Bias in Moe is only supported when ETP==1"
    return None


@rule()
def topk1_needs_pre_softmax(c: RuleContext) -> str | None:
    m = c.model
    if m.is_moe and m.moe_router_topk == 1 and not m.moe_router_pre_softmax:
        return "Please use --moe-router-pre-softmax when topk is 1."
    return None


@rule()
def experts_divisible_by_router_groups(c: RuleContext) -> str | None:
    m = c.model
    if m.is_moe and m.moe_router_num_groups and m.num_moe_experts % m.moe_router_num_groups:  # type: ignore[operator]
        return f"num_moe_experts ({m.num_moe_experts}) must be divisible by moe_router_num_groups"
    return None


# -- context parallel ----------------------------------------------------------------------------------------------
@rule("cp")
def cp_sequence_divisible(c: RuleContext) -> str | None:
    cp = c.layout.cp
    if cp > 1 and c.seq_length % (2 * cp):
        return f"context parallel needs seq_length ({c.seq_length}) divisible by 2 x CP ({2 * cp})"
    return None


@rule("cp", "precision")
def fp8_mla_cp(c: RuleContext) -> str | None:
    if c.layout.cp > 1 and c.model.multi_latent_attention and c.layout.is_fp8:
        return "FP8 multi-latent attention with context parallel is not supported by Transformer Engine"
    return None


# -- selective recompute modules (TransformerConfig.__post_init__) -----------------------------------------------
@rule("recompute")
def recompute_modules_exist(c: RuleContext) -> str | None:
    """A module the model does not have would be recomputed nowhere: the trial would repeat another layout's."""
    m, modules = c.model, c.layout.recompute_modules
    if not modules:
        return None
    needs = {
        "moe": (m.is_moe, "the model has no MoE layers"),
        "moe_act": (m.is_moe, "the model has no MoE layers"),
        "shared_experts": (bool(m.moe_shared_expert_intermediate_size), "the model has no shared experts"),
        # Megatron: "mla_up_proj in recompute_modules is only supported with multi_latent_attention."
        "mla_up_proj": (m.multi_latent_attention, "it is only supported with multi_latent_attention"),
        "mlp": (m.count("mlp") > 0, "the model has no dense MLP layers"),
        "core_attn": (m.count("attention") > 0, "the model has no attention layers"),
    }
    for module in modules:
        present, why = needs.get(module, (True, ""))
        if not present:
            return f"recompute module {module}: {why}"
    return None


@rule("precision", "recompute")
def recompute_modules_fp8_delayed(c: RuleContext) -> str | None:
    # TransformerConfig.__post_init__ raises "Delayed scaling does not support moe_act and layernorm recompute for
    # fp8." for fp8_recipe == 'delayed' only: current (tensorwise) and blockwise scaling recompute them (with TE
    # >= 2.6, which the GPU trial's TransformerConfig checks itself; the plan does not know the nodes' TE).
    lo = c.layout
    if c.fp8_recipe == "delayed":
        clash = [m for m in ("moe_act", "layernorm") if m in lo.recompute_modules]
        if clash:
            named = "" if lo.precision != "fp8" else (
                f" (run.fp8_recipe {c.run.fp8_recipe} on compute capability {c.cluster.compute_capability})")
            return (f"recompute module {clash[0]}: delayed scaling{named} does not support moe_act and layernorm "
                    f"recompute for fp8")
    return None


# -- batch ---------------------------------------------------------------------------------------------------------
@rule("dp", "gbs", "mbs")
def global_batch_divisible(c: RuleContext) -> str | None:
    lo = c.layout
    if lo.dp and lo.gbs % (lo.mbs * lo.dp):
        return (
            f"global_batch_size ({lo.gbs}) is not divisible by micro_batch_size ({lo.mbs}) x "
            f"data_parallel_size ({lo.dp})"
        )
    return None


# -- precision (Transformer Engine recipes) ------------------------------------------------------------------------
@rule("precision")
def fp8_hardware(c: RuleContext) -> str | None:
    cc = c.cluster.capability
    if c.layout.is_fp8 and c.layout.precision != "mxfp8" and cc < (8, 9):
        return ("FP8 needs compute capability >= 8.9 (Ada/Hopper/Blackwell); "
                f"the cluster is {c.cluster.compute_capability}")
    if c.fp8_recipe == "blockwise" and cc < (9, 0):
        # Transformer Engine's check_fp8_block_scaling_support: blockwise FP8 GEMMs need Hopper or later.
        return (f"FP8 blockwise scaling needs compute capability >= 9.0 (Transformer Engine's Float8BlockScaling); "
                f"the cluster is {c.cluster.compute_capability}")
    if c.layout.precision == "mxfp8" and cc[0] != 10:
        return (
            f"MXFP8 needs compute capability 10.x (B200/GB200); Transformer Engine rejects it on "
            f"{c.cluster.compute_capability}"
        )
    if c.layout.precision == "nvfp4" and cc[0] != 10:
        # Transformer Engine's check_nvfp4_support wants >= 10.0, and TE's own tests skip 12.x: NVFP4BlockScaling
        # fails there in the random Hadamard transform kernel (hadamard_transform_cast_fusion.cu, "invalid argument").
        return (
            f"NVFP4 needs compute capability 10.x (B200/GB200/B300): Transformer Engine requires >= 10.0 and its "
            f"NVFP4 recipe fails on 12.x; the cluster is {c.cluster.compute_capability}"
        )
    return None


@rule("precision", "tp", "etp", "mbs", "sp", "cp")
def fp8_gemm_shapes(c: RuleContext) -> str | None:
    lo, m = c.layout, c.model
    if not lo.quantized:
        return None
    # MXFP8 scales 32-element blocks, NVFP4 16-element blocks (both along rows and columns: the weight-gradient GEMM
    # quantises the tokens dimension); per-tensor FP8 needs Hopper's 16-byte GEMM alignment.
    align = 32 if lo.precision == "mxfp8" else 16
    dims = {"hidden_size": m.hidden_size, "ffn_hidden_size / TP": m.ffn_hidden_size // lo.tp}
    if m.is_moe:
        dims["moe_ffn_hidden_size / ETP"] = m.expert_ffn_hidden_size // lo.etp
    for name, value in dims.items():
        if value % align:
            return f"{lo.precision} GEMMs need {name} ({value}) divisible by {align}"
    tokens = c.seq_length * lo.mbs // (lo.tp if lo.sp else 1) // lo.cp
    token_align = 16 if lo.precision == "nvfp4" else 8
    if tokens % token_align:
        return f"{lo.precision} GEMMs need tokens per micro-batch per rank ({tokens}) divisible by {token_align}"
    return None


# -- issue 18: the dispatcher, A2A overlap, CUDA graphs, activation offload, Megatron-FSDP (transformer_config.py,
#    token_dispatcher.py, Megatron-LM's validate_args); each message is Megatron's own where it has one ------------
@rule("moe_token_dispatcher", "ep", "etp")
def token_dispatcher(c: RuleContext) -> str | None:
    lo = c.layout
    if lo.moe_token_dispatcher is None:
        return None
    if not c.model.is_moe:
        return "moe_token_dispatcher only applies to MoE models (this model has no experts)"
    if lo.dispatcher == "flex" and lo.etp * lo.ep == 1:
        # token_dispatcher.py MoEFlexTokenDispatcher: tp_size is the expert-tensor-parallel size.
        return "Flex token dispatcher requires TPxEP > 1 (expert_tensor_parallel_size x expert_model_parallel_size)"
    return None


@rule("moe_a2a_overlap", "ep", "moe_token_dispatcher", "pp", "vpp", "recompute", "precision")
def a2a_overlap(c: RuleContext) -> str | None:
    lo = c.layout
    if not lo.moe_a2a_overlap:
        return None
    if not c.model.is_moe or lo.ep == 1:
        return "overlap_moe_expert_parallel_comm is only supported with expert model parallelism"
    if c.model.is_hybrid:  # megatron-core 0.16.1 pipeline_parallel/combined_1f1b.py asserts it
        return ("The final unwrapped model must be a GPTModel instance since only GPTModel is supported for EP A2A "
                "overlapping")
    if lo.dispatcher not in ("alltoall", "flex"):
        return "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher"
    if lo.pp > 1 and lo.vpp == 1:
        return ("If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
                "pipeline_model_parallel_size > 1")
    if lo.recompute == "full":
        return "disable full recomputation when enabling overlap_moe_expert_parallel_comm"
    if lo.precision == "fp32":
        return "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model"
    return None


@rule("cuda_graph", "recompute", "offload_layers", "moe_a2a_overlap", "ep")
def cuda_graphs(c: RuleContext) -> str | None:
    lo, m = c.layout, c.model
    if lo.cuda_graph == "none":
        return None
    scope = set(lo.cuda_graph_scope)
    if lo.offload_layers:
        return "CUDA graphs not supported with CPU offloading."
    if scope & {"moe", "moe_router"} and not m.is_moe:
        return "moe cuda graph is only supported for MoE."
    if "mlp" in scope and not m.count("mlp"):
        return "mlp cuda graph is only supported for dense layers, but not found in the model."
    if {"moe", "moe_router"} <= scope:
        return "cuda_graph_scope must not contain both moe and moe_router."
    if "moe_preprocess" in scope and "moe_router" not in scope:
        return "moe_preprocess cuda graph is only supported with moe_router cuda graph."
    if "moe" in scope:  # sweeper's MoE trials are dropless: no capacity factor, no padding
        return "moe cuda graph is only supported with drop-padding MoE."
    if lo.recompute_granularity == "full" and lo.cuda_graph != "full_iteration":
        return "full recompute is only supported with full iteration CUDA graph."
    # With the A2A overlap megatron-core 0.16 asserts TE graphs without the moe/mlp scopes; 0.19 checks the scopes
    # of TE graphs only (transformer_config.py), so local and full-iteration graphs pass there.
    te_graphs = lo.cuda_graph_impl == "transformer_engine"
    if lo.moe_a2a_overlap and megatron_release.graph_modules() and te_graphs and scope & {"moe", "mlp"}:
        return "CUDA graph scope on moe and mlp is not supported with overlap_moe_expert_parallel_comm"
    if lo.moe_a2a_overlap and not megatron_release.graph_modules() and (not te_graphs or scope & {"moe", "mlp"}):
        return ("overlap_moe_expert_parallel_comm needs cuda_graph_impl transformer_engine; CUDA graph scope on "
                "moe and mlp is not supported with overlap_moe_expert_parallel_comm")
    return None


@rule("cuda_graph")
def local_graphs_dropless_moe(c: RuleContext) -> str | None:
    # Not a Megatron check (TransformerConfig.__post_init__ refuses only the `moe` scope without drop-and-pad):
    # cuda_graph_impl local with an empty scope graphs whole layers, the MoE layer included
    # (transformer_layer.py MoETransformerLayer.create_mcore_cudagraph_manager), and full_iteration graphs the
    # whole step. megatron-core 0.16.1's dropless token dispatchers read the per-expert token counts on the host
    # inside the forward (moe/token_dispatcher.py: MoEAllGatherTokenDispatcher.dispatch_postprocess `.cpu()`,
    # MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: a device-to-host copy, then d2h_event.synchronize()),
    # which a CUDA stream capture refuses, and a graph would replay the first step's split sizes anyway. sweeper's
    # MoE trials are dropless (no capacity factor): every MoE layout with local graphs is refused.
    if c.model.is_moe and c.layout.cuda_graph_impl == "local":
        return (f"cuda_graph {c.layout.cuda_graph} captures the MoE layers whole, and megatron-core 0.16.1's "
                "dropless token dispatchers copy the per-expert token counts to the host and synchronise inside "
                "the forward (moe/token_dispatcher.py: .cpu(), _maybe_dtoh_and_synchronize), which a CUDA graph "
                "capture cannot hold (Megatron: 'moe cuda graph is only supported with drop-padding MoE.'); use "
                "te:attn or te:attn+moe_router")
    return None


@rule("offload_layers", "pp", "recompute")
def activation_offload(c: RuleContext) -> str | None:
    lo, layers = c.layout, c.model.num_layers
    if not lo.offload_layers:
        return None
    if lo.offload_layers >= layers:
        return f"CPU offloading can be done only for layers less than {layers}"
    if lo.pp > 1:
        return "Currently there is no support for Pipeline parallelism with CPU offloading"
    if lo.recompute != "none":
        return "CPU offloading does not work when activation recomputation is enabled"
    return None


@rule("offload_layers")
def offload_not_hybrid(c: RuleContext) -> str | None:
    # Not a Megatron check: megatron-core 0.16.1's TransformerBlock enters the offload context around each layer
    # (transformer_block.py: get_cpu_offload_context, `with self.offload_context`), MambaStack has none
    # (ssm/mamba_block.py), so a hybrid model builds and trains with cpu_offloading on and offloads nothing: the
    # trial would measure the layout without offload under an offload label.
    if c.layout.offload_layers and c.model.is_hybrid:
        return ("activation offload (cpu_offloading_num_layers) does nothing on a hybrid Mamba model: megatron-core "
                "0.16.1's MambaStack (ssm/mamba_block.py) has no CPU offload context, only TransformerBlock does")
    return None


@rule("fsdp", "distributed_optimizer")
def megatron_fsdp(c: RuleContext) -> str | None:
    # Megatron-LM's validate_args (main) and Megatron-Bridge's _validate_and_apply_megatron_fsdp_configs both turn
    # the distributed optimizer on under Megatron-FSDP; megatron-core 0.16.1 builds a replicated optimizer without
    # it, whose replicas drift apart once the gradients are sharded.
    if c.layout.fsdp and not c.layout.distributed_optimizer:
        return "Megatron-FSDP v1 is only compatible with --use-distributed-optimizer"
    return None


# -- run settings a layout makes Megatron refuse (issue 52: Megatron-LM's validate_args, megatron-core's
#    OptimizerConfig); each message is Megatron's own ---------------------------------------------------------------
@rule("distributed_optimizer")
def precision_aware_optimizer_distributed(c: RuleContext) -> str | None:
    # OptimizerConfig.__post_init__ asserts it (the GPU trial builds the same config); Megatron-LM's validate_args
    # builds it too.
    if c.run.precision_aware_optimizer and not c.layout.distributed_optimizer:
        return ("--use-precision-aware-optimizer only supported with distributed optimizer "
                "(run.precision_aware_optimizer)")
    return None


@rule("precision", "distributed_optimizer")
def optimizer_offload_fp8_params_delayed(c: RuleContext) -> str | None:
    # Megatron-LM's validate_args (0.17 on; the megatron-core 0.19.2 wheel's megatron/training/arguments.py): the
    # hybrid device optimizer steps FP8 parameters only under delayed scaling.
    lo = c.layout
    if (c.run.optimizer_cpu_offload and c.fp8_recipe != "delayed"
            and c.run.fp8_params(lo.precision, c.cluster.compute_capability,
                                 distributed_optimizer=lo.distributed_optimizer)):
        return ("When `--fp8-param-gather` is enabled, the optimizer cpu offload must be used in conjunction with "
                f"`--fp8-recipe delayed` (this layout's recipe: {c.fp8_recipe}; run.fp8_param_gather false keeps "
                "BF16 weights)")
    return None
