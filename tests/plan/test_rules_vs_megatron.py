"""Cross-check: ``sweeper.plan.rules`` accepts exactly the layouts the installed megatron-core accepts (0.16.1 or
0.19.2; see "Both releases" below for what is asked differently on 0.19).

Hypothesis draws tiny models (heads, query groups, hidden, FFN, layers, experts, top-k, router groups, bias,
hybrid Mamba patterns, and multi-latent attention: query/KV LoRA ranks, QK/rotary/V head widths, QK norms) and
layouts (world size, TP, PP, VPP, CP, EP, ETP, SP, uneven split, embedding/loss accounting, pipeline layout
strings (issue 52: sweeper's generated ones, some with a layer moved or miscounted), MBS/GBS, sequence length): 1,000 GPT (dense and MoE), 300 MLA (half of them MoE) and 400 hybrid cases per run, ten times as many
with SWEEPER_XCHECK_SCALE=10. For each, Megatron is asked in its own code, under a fake process group of that world
size on CPU:

1. ``TransformerConfig(...)`` with the same fields (``__post_init__``: heads/query groups vs TP, SP without TP,
   EP without experts, uneven-split arithmetic, top-k 1 without pre-softmax, router groups, bias with ETP>1) --
   for MLA models ``MLATransformerConfig`` with the MLA fields the backend passes (architecture.mla_config_kwargs:
   the LoRA ranks and head widths, DeepSeek's YaRN RoPE), whose own ``__post_init__`` adds only checks on fields a
   layout does not set (RoPE fusion vs rope type, output gate, latent caching);
2. ``parallel_state.initialize_model_parallel(...)`` (world size vs TP*PP*CP and ETP*EP*PP, VPP without PP);
3. ``get_num_layers_to_build`` for every pipeline rank and virtual stage (transformer_block.py: even split,
   layers per rank vs VPP) -- or, for hybrid models, ``MambaStack._select_layers_for_pipeline_parallel`` for
   every rank (no VPP; a split that leaves layers out is counted as a rejection, see below), and the attention,
   MLP and MoE blocks of the pattern built standalone from the local spec;
4. the model itself on rank 0 (or, where the split leaves rank 0's first virtual stage without a decoder layer,
   as the first stage that has one): ``GPTModel`` with ``get_gpt_layer_local_spec`` and ``use_cpu_initialization``
   (linear layers divide FFN by TP, experts by EP, expert FFN by ETP), and for MoE one training-mode forward of
   the ``MoELayer`` to reach its "MoE and tensor parallelism without sequence parallelism" check. An MLA model's
   layers are ``MLASelfAttention`` from the local spec as the CPU backend adapts it (cpu/spec.py
   adapt_local_block_spec): Megatron's local MLA spec builds on neither release (its DotProductAttention takes no
   k_channels/v_channels), and its column-parallel down projections are not the TE spec's duplicated linears that
   every GPU run uses; the adapted spec has the backend's K/V-width-aware core attention and duplicated down
   projections, so the widths split over TP are the TE spec's (the up projections and output split heads);
5. the data-side helpers: ``get_batch_on_this_cp_rank`` (sequence into 2*CP chunks), the sequence-parallel
   scatter (sequence per CP rank divided by TP), ``ConstantNumMicroBatchesCalculator`` (GBS % (MBS*DP)).

Local patches, each because of CPU-only torch without Transformer Engine/Apex, none about layout validity:
the model is built with ``sequence_parallel`` off (the torch LayerNorm fallback refuses SP; TE's does not) and
``context_parallel_size`` 1 (only TEDotProductAttention supports CP), both restored for the MoE forward and the
data-side checks; the token dispatcher is ``allgather`` (``alltoall`` creates a CUDA stream); gloo groups are not
created (the fake backend cannot stand in for gloo); the vocabulary is padded to a multiple of 128*TP as
Megatron-LM's front end does. An error raised *after* the MoE layer's SP check (the CPU forward hits CUDA-only
code) means the check passed. No CUDA RNG patch was needed: ``use_cpu_initialization`` never touches it.
For MLA, while the model is built (``_mla_on_cpu``): ``multi_latent_attention.TELinear`` is the backend's
DuplicatedLinear, the class MLASelfAttention gives the duplicated mode to (cpu/compat.py registers it the same way;
0.16.1's ``HAVE_TE``, True there with TE missing, is off); ``torch.cuda.current_device`` answers the CPU, because
MLA builds its YaRN rotary embedding without ``use_cpu_initialization``; ``get_pos_emb_on_this_cp_rank`` in the
YaRN module is a transcription without its pinned, ``.cuda()`` index tensor (the rotary cache is sliced for the CP
rank at construction); YaRN's ``original_max_position_embeddings`` is 256, not 4096 (the cache's length, the
build's main cost; sliced into 2*CP chunks either way). On 0.19 a model with ``qk_layernorm`` and no
``q_lora_rank`` is built with the QK norms off: its query norm is fused into ``q_proj``, a TE-only layer
(transformer/mla_qk_norm_config.py; the backend refuses that model on the CPU, support.py), and no norm splits a
width over TP, so the config and parallel-state checks are asked with the norms on and the build without them.
MLA with CP > 1 is asked of the config, parallel_state, the rotary slicing and the data side only (the model is
built with CP 1 as above; MLA's CP attention is TE's, and the CPU backend refuses MLA with CP).

Both releases: the same questions, each asked of the installed release's own code. Where 0.19 moved or changed the
code, the 0.19 branch is taken by feature detection (the 0.16.1 path is unchanged):
- hybrid layer selection: 0.19 has no ``MambaStack._select_layers_for_pipeline_parallel``; ``HybridModel`` takes its
  chunk's layers from ``models/hybrid/hybrid_layer_allocation.select_pipeline_segment`` (hybrid_model.py:205), asked
  for every pipeline rank *and virtual stage* (the pipeline group's rank stood in for with a patched
  ``torch.distributed.get_rank/get_world_size``). sweeper's patterns have no '|' stage separators, so that is its
  auto-split: VPP raises (hybrid_layer_allocation.py:387), an even split that does not divide raises (:437; 0.16.1
  truncated silently), first/last are honoured and a middle that does not divide raises (:414). The layers built
  must be the pattern itself, in order; account_for_* is still never passed to it (counted as a rejection, as on
  0.16.1).
- layer specs: 0.19 gives the MLP and MoE blocks as ``functools.partial(MLP.as_mlp_submodule | MoELayer,
  submodules=...)``, built standalone the way TransformerLayer calls them (transformer_layer.py:433).
- ``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None)``: 0.19 splits over the group it is given, and over
  the whole world when given none (utils.py:2615, 2653, 2483), so it is given the layout's CP group (0.16.1 found
  it in parallel_state). ``test_trial_cp_split_is_megatrons`` checks the trials' own call
  (backends/megatron/releases.py) keeps the same chunks.
- MLA without a query LoRA and with QK norms: built with the norms off on 0.19 (see the MLA patches above); the
  module ``mla_qk_norm_config`` marks the release (``MLA_Q_NORM_FUSED``).
- the knob check: the CUDA-graph fields under the installed release's names (Layout.knob_config), and on 0.19 one
  TransformerConfig construction with every field instead of ``dataclasses.replace`` on a built one: 0.19's
  __post_init__ derives inference_cuda_graph_scope from cuda_graph_impl and asserts the pair, so a replace keeps
  the derived value and refuses cuda_graph_impl='local' by itself.

Disagreements this test found, fixed in sweeper/plan/rules.py:
- FFN / expert FFN / fused QKV widths not divisible by TP / ETP / TP (``divide`` asserts at model build; the QKV
  case bites when query groups < TP): new rule ``linear_widths_divisible``.
- An explicit uneven split with VPP: first/last/middle-per-rank counts must each divide by VPP, and explicit
  counts must be > 0 (TransformerConfig): added to ``pipeline_split``.
- num_attention_heads % TP and query groups vs TP are checked by TransformerConfig for every model, including a
  hybrid model without attention layers: the rules no longer skip models without attention.
- Hybrid models with an explicit first/last split: megatron-core 0.16.1's MambaStack honours
  num_layers_in_first/last_pipeline_stage, so ``pipeline_split`` no longer refuses it and ``with_pipeline_split``
  fills it in for hybrid models too (only the silently truncating even split stays refused).
- MLA with num_query_groups other than the head count (issue 45): ``query_groups_vs_tp`` skipped MLA and
  accepted heads 2, groups 1 at TP2, which the build refuses (DotProductAttention, which the backend's
  LatentDotProductAttention extends, divides num_query_groups by TP: dot_product_attention.py:81). Behind it,
  Megatron's Attention takes heads per TP rank from num_query_groups when it is below TP (transformer/attention.py)
  and its TE core attention is told num_gqa_groups=num_query_groups, while MLA gives every head its own key and
  value. Fixed in the model, not a rule: ModelSpec refuses num_query_groups
  other than unset or the head count on an MLA model (models/spec.py), which is what the skip assumed; MLA models
  are drawn with it unset or equal to the heads.

Documented Megatron gaps / interpretations (the rules are deliberately not "fixed" to match these):
- Hybrid Mamba models with layers not divisible by PP and no first/last split: megatron-core 0.16.1's
  ``MambaStack`` divides with ``//`` and builds fewer layers without an error. Likewise an explicit uneven split
  whose first + last exceed the layers, with a middle that "divides" (e.g. -2 over 2 stages), passes
  ``TransformerConfig`` and builds a wrong layer count (or a negative count on a middle stage). The test counts
  "Megatron would silently build a layer count other than num_layers" as a rejection, which is what sweeper refuses.
- Hybrid models with account_for_embedding/loss_in_pipeline_split: TransformerConfig accepts them and
  ``MambaStack._select_layers_for_pipeline_parallel`` ignores them (it splits num_layers // PP or by first/last), so
  the split built is not the one asked for: counted as a rejection, which is what sweeper refuses.
- ``moe_router_num_groups`` without ``moe_router_group_topk`` is not checked by Megatron; ModelSpec has no
  group-topk field and means group-limited routing whenever router groups are set, so the test passes
  ``moe_router_group_topk=1`` with them.
- ``mla_tp_needs_sp`` is excluded: MLA at TP > 1 without SP builds and runs in Megatron with a wrong rotary-key
  gradient (NVIDIA/Megatron-LM#1699). Re-checked on 0.19.2 (source and test_mla_gradients.py): still there, so the
  rule refuses it on both releases.
- MLA's LoRA ranks need not divide by TP: they are the widths of the duplicated down projections of the TE spec
  (Megatron's local spec would split them column-parallel and assert it, but that spec does not build MLA at all,
  see 4.). No rule: the drawn ranks (6, 12) often do not divide TP 4 or 8, and Megatron builds them.
- VPP with PP=2: megatron-core 0.16.1 accepts it (PP > 1); Megatron-LM's front end may want PP > 2 unless
  overlap_p2p_comm (docs/LAYOUT_RULES.md). sweeper follows megatron-core.
- Mamba mixer rules (heads/groups vs TP and CP) are asserted in ``ssm/mamba_mixer.py``, which needs
  ``mamba_ssm``/``causal_conv1d`` (CUDA only), so they are excluded here and unit-tested in test_rules.py;
  hybrid models are drawn with Mamba sizes that divide every TP/CP so those rules stay silent.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import warnings
from dataclasses import dataclass, replace
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sweeper.backends.megatron import releases  # noqa: E402
from sweeper.backends.megatron.architecture import mla_config_kwargs  # noqa: E402
from sweeper.backends.megatron.cpu.linear import DuplicatedLinear  # noqa: E402
from sweeper.backends.megatron.cpu.spec import adapt_local_block_spec  # noqa: E402
from sweeper.config import megatron_release  # noqa: E402
from sweeper.config.schema import ClusterConfig  # noqa: E402
from sweeper.models.spec import ModelSpec  # noqa: E402
from sweeper.plan import rules  # noqa: E402
from sweeper.space.layout import Layout  # noqa: E402
from sweeper.space.pipeline import balanced_layout, parse_layout, with_pipeline_split  # noqa: E402

warnings.filterwarnings("ignore")
import megatron.core.extensions.transformer_engine as te_extensions  # noqa: E402
import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn_rope  # noqa: E402
import megatron.core.transformer.multi_latent_attention as mla  # noqa: E402
import megatron.core.transformer.transformer_block as transformer_block_module  # noqa: E402
import megatron.core.transformer.transformer_layer as transformer_layer_module  # noqa: E402
import megatron.core.utils as megatron_utils  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator  # noqa: E402
from megatron.core.ssm.mamba_block import MambaStack  # noqa: E402
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_block import get_num_layers_to_build  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

# What the installed release asks differently (see the module docstring, "Both releases"); each feature-detected.
try:  # 0.18, 0.19: HybridModel selects each pipeline segment (models/hybrid/hybrid_layer_allocation.py)
    from megatron.core.models.hybrid.hybrid_layer_allocation import select_pipeline_segment
except ImportError:
    try:  # 0.17: MambaModel does, the same function in ssm/mamba_hybrid_layer_allocation.py (mamba_model.py:184)
        from megatron.core.ssm.mamba_hybrid_layer_allocation import select_pipeline_segment
    except ImportError:  # 0.16.1: MambaStack._select_layers_for_pipeline_parallel
        select_pipeline_segment = None
# 0.19: get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None) splits over the group it is given, the whole
# world when none (utils.py get_batch_on_this_cp_rank, _get_batch_on_this_cp_rank_per_sequence_balancing); 0.16.1
# falls back to parallel_state's CP group.
CP_SPLIT_NEEDS_GROUP = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
try:  # 0.19: MLA resolves its query/KV norms in QKNormConfigResolver; without a query LoRA the query norm is fused
    # into q_proj, a Transformer Engine layer (transformer/mla_qk_norm_config.py); 0.16.1 has no query norm there.
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver  # noqa: F401

    MLA_Q_NORM_FUSED = True
except ImportError:
    MLA_Q_NORM_FUSED = False

# Rules that are not Megatron checks, so the cross-check leaves them out (each is unit-tested in test_rules.py).
EXCLUDED: dict[str, str] = {
    "within_cluster": "cluster size: Megatron only sees the world it is launched with",
    "tp_inside_node": "topology: Megatron builds TP groups across nodes without complaint (just slowly)",
    "multi_node_trial_fills_nodes": "topology: how sweeper places a trial on nodes",
    "etp_needs_experts": "sweeper's own stricter choice: Megatron silently ignores ETP>1 on a dense model",
    "expert_grads_reduced_over_expert_dp": (
        "a megatron-core <= 0.16.1 defect, not a check: EP 1 with ETP != TP builds and runs, with expert replicas "
        "whose gradients are never reduced (caught at run time by the smoke run's replica-consistency check; "
        "tested in test_backend_megatron.py)"
    ),
    "mla_tp_needs_sp": (
        "a megatron-core defect (0.16.1 and 0.19.2), not a check: MLA at TP > 1 without SP builds and runs with a "
        "wrong rotary-key gradient (caught at run time by the FP32 equivalence gate; tested in test_mla_gradients.py)"
    ),
    "interleaved_microbatches": (
        "checked inside forward_backward_pipelining_with_interleaving after a CUDA allocation, which cannot be "
        "reached on a CPU-only torch; the arithmetic (M >= PP and M % PP == 0 with the default "
        "microbatch_group_size_per_vp_stage = PP) is unit-tested"
    ),
    "mamba_heads_and_groups": "ssm/mamba_mixer.py needs mamba_ssm (CUDA); unit-tested",
    "fp8_mla_cp": "Transformer Engine (GPU) check",
    "fp8_hardware": "hardware: compute capability of the cluster",
    "fp8_gemm_shapes": "Transformer Engine FP8 GEMM alignment (GPU)",
    # Issue 18's knobs are left at their defaults by the drawn layouts; test_knob_rules_agree_with_megatron asks
    # TransformerConfig about each of them instead.
    "token_dispatcher": "knob: test_knob_rules_agree_with_megatron",
    "a2a_overlap": "knob: test_knob_rules_agree_with_megatron",
    "cuda_graphs": "knob: test_knob_rules_agree_with_megatron",
    "activation_offload": "knob: test_knob_rules_agree_with_megatron",
    "local_graphs_dropless_moe": (
        "not a config check: TransformerConfig accepts local (whole-layer) and full-iteration graphs on a dropless "
        "MoE model, whose token dispatchers then copy to the host inside the CUDA graph capture (GPU); unit-tested "
        "in test_rules.py"
    ),
    "offload_not_hybrid": (
        "not a check: a hybrid model builds and trains with cpu_offloading on, and MambaStack never enters an "
        "offload context (ssm/mamba_block.py); unit-tested in test_rules.py"
    ),
}
COMPARED = [fn for fn in rules.RULES if fn.__name__ not in EXCLUDED]
BIG_CLUSTER = ClusterConfig(nodes=64, gpus_per_node=8)
MAX_SEQ = 256


def test_every_rule_is_compared_or_excluded() -> None:
    names = {fn.__name__ for fn in rules.RULES}
    assert set(EXCLUDED) <= names, f"stale exclusions: {set(EXCLUDED) - names}"
    assert len(COMPARED) >= 15


@dataclass(frozen=True)
class Case:
    model: ModelSpec
    layout: Layout
    seq_length: int


def sweeper_reasons(case: Case) -> list[str]:
    ctx = rules.RuleContext(case.model, case.layout, BIG_CLUSTER, case.seq_length)
    return [reason for fn in COMPARED if (reason := fn(ctx))]


# -- the Megatron side -------------------------------------------------------------------------------------------
class Rejected(Exception):
    """Megatron refused the case (the message says where)."""


@contextlib.contextmanager
def fake_world(world_size: int):
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _stage(where: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, AssertionError, RuntimeError, ZeroDivisionError) as exc:
        raise Rejected(f"{where}: {type(exc).__name__}: {exc}") from exc


def transformer_config(case: Case, **extra) -> TransformerConfig:
    """``extra``: more TransformerConfig fields, given to the same construction (the knob check on 0.19)."""
    m, lo = case.model, case.layout
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        add_bias_linear=m.add_bias_linear,
        gated_linear_unit=m.gated_linear_unit,
        tensor_model_parallel_size=lo.tp,
        pipeline_model_parallel_size=lo.pp,
        virtual_pipeline_model_parallel_size=lo.vpp if lo.vpp > 1 else None,
        context_parallel_size=lo.cp,
        expert_model_parallel_size=lo.ep,
        expert_tensor_parallel_size=lo.etp,
        sequence_parallel=lo.sp,
        mtp_num_layers=m.mtp_num_layers or None,
        **lo.pipeline_split_config(),
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    config_class: type[TransformerConfig] = TransformerConfig
    if m.multi_latent_attention:
        # The MLA fields the backend passes (DeepSeek's YaRN RoPE included: backends/megatron/architecture.py),
        # but YaRN's original_max_position_embeddings MAX_SEQ instead of 4096: YarnRotaryEmbedding fills a cos/sin
        # cache of that length at construction (most of an MLA build's time) and only slices it into 2*CP chunks.
        config_class = MLATransformerConfig
        kwargs.update(mla_config_kwargs(m), qk_layernorm=m.qk_layernorm, normalization=m.normalization,
                      original_max_position_embeddings=MAX_SEQ)
    if m.is_moe:
        kwargs.update(
            num_moe_experts=m.num_moe_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.expert_ffn_hidden_size,
            moe_router_pre_softmax=m.moe_router_pre_softmax,
            moe_token_dispatcher_type="allgather",
        )
        if m.moe_router_num_groups:
            kwargs.update(moe_router_num_groups=m.moe_router_num_groups, moe_router_group_topk=1)
    kwargs.update(extra)
    return _stage(config_class.__name__, config_class, **kwargs)


def megatron_verdict(case: Case) -> str | None:
    """None when megatron-core accepts the case, else where and why it refused."""
    m, lo = case.model, case.layout
    try:
        config = transformer_config(case)
        with fake_world(lo.world_size):
            _stage(
                "initialize_model_parallel",
                ps.initialize_model_parallel,
                tensor_model_parallel_size=lo.tp,
                pipeline_model_parallel_size=lo.pp,
                virtual_pipeline_model_parallel_size=lo.vpp if lo.vpp > 1 else None,
                context_parallel_size=lo.cp,
                expert_model_parallel_size=lo.ep,
                expert_tensor_parallel_size=lo.etp,
                create_gloo_process_groups=False,
            )
            if m.is_hybrid:
                _hybrid_layers(config, m)
                moe = _stage("hybrid blocks", _build_hybrid_blocks, config, m, lo)
                if moe is not None:
                    _moe_forward(config, moe, lo.sp)
            else:
                _gpt_layers(config, lo)
                model = _stage("GPTModel", _build_gpt, config, m, lo)
                moe = next((mod for mod in model.modules() if isinstance(mod, MoELayer)), None)
                if moe is not None:
                    _moe_forward(config, moe, lo.sp)
            _data_side(case)
    except Rejected as exc:
        return str(exc)
    return None


def _gpt_layers(config: TransformerConfig, lo: Layout) -> None:
    count_of = _layer_counter(config)
    counts = [
        _stage("get_num_layers_to_build", count_of, vp_stage=vp_stage, pp_rank=rank)
        for rank in range(lo.pp)
        for vp_stage in (range(lo.vpp) if lo.vpp > 1 else [None])
    ]
    if min(counts) < 0 or sum(counts) != config.num_layers:
        raise Rejected(f"get_num_layers_to_build: would silently build {counts} layers for {config.num_layers}")


def _hybrid_layers(config: TransformerConfig, m: ModelSpec) -> None:
    if select_pipeline_segment is not None:
        _hybrid_segments(config, m)
        return
    pattern = list(m.hybrid_layer_pattern or "")
    pp = config.pipeline_model_parallel_size
    if pp == 1:
        return
    if config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split:
        raise Rejected("MambaStack: ignores account_for_*_in_pipeline_split (it builds a split other than asked)")
    if config.pipeline_model_parallel_layout is not None:  # mamba_block.py never reads it
        raise Rejected("MambaStack: ignores pipeline_model_parallel_layout (it builds a split other than asked)")
    built: list[str] = []
    for rank in range(pp):
        stack = SimpleNamespace(config=config, pp_group=SimpleNamespace(rank=lambda r=rank: r, size=lambda: pp))
        _, selected = _stage("MambaStack", MambaStack._select_layers_for_pipeline_parallel, stack, pattern)
        built += selected
    if len(built) != len(pattern):
        raise Rejected(f"MambaStack: would silently build {len(built)} of {len(pattern)} layers")


class _PipelineGroup:
    """Rank ``rank`` of a ``size``-rank pipeline group, for ``select_pipeline_segment``, which asks
    ``torch.distributed.get_rank/get_world_size(pp_group)`` (the fake world itself is only ever rank 0)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


@contextlib.contextmanager
def _as_pipeline_rank(rank: int, size: int):
    stand_in = _PipelineGroup(rank, size)
    get_rank, get_world_size = torch.distributed.get_rank, torch.distributed.get_world_size

    def rank_of(group=None):
        return stand_in.rank if group is stand_in else get_rank(group)

    def size_of(group=None):
        return stand_in.size if group is stand_in else get_world_size(group)

    with mock.patch.object(torch.distributed, "get_rank", rank_of), \
            mock.patch.object(torch.distributed, "get_world_size", size_of):
        yield stand_in


def _hybrid_segments(config: TransformerConfig, m: ModelSpec) -> None:
    """0.19: ``HybridModel.__init__`` (models/hybrid/hybrid_model.py:205) takes its chunk's layers from
    ``select_pipeline_segment(pattern, pp_group, vp_stage, first_stage_layers, last_stage_layers)``, asked here for
    every pipeline rank and virtual stage. sweeper's patterns have no '|' stage separators, so that is the
    "auto-split" path (models/hybrid/hybrid_layer_allocation.py:385-446): VPP refused, an even split that does not
    divide refused (no longer truncated), first/last honoured. The account_for_* options are still not passed to it."""
    pattern = m.hybrid_layer_pattern or ""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if pp > 1 and (config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split):
        raise Rejected("HybridModel: ignores account_for_*_in_pipeline_split (it builds a split other than asked)")
    if pp > 1 and config.pipeline_model_parallel_layout is not None:  # select_pipeline_segment is not given it
        raise Rejected("HybridModel: ignores pipeline_model_parallel_layout (it builds a split other than asked)")
    built: list[str] = []
    for rank in range(pp):
        for vp_stage in range(vpp) if vpp else [None]:
            with _as_pipeline_rank(rank, pp) as pp_group:
                selected, _ = _stage(
                    "select_pipeline_segment", select_pipeline_segment, pattern, pp_group, vp_stage,
                    first_stage_layers=config.num_layers_in_first_pipeline_stage,
                    last_stage_layers=config.num_layers_in_last_pipeline_stage,
                )
            built += selected
    if "".join(built) != pattern:
        raise Rejected(f"select_pipeline_segment: would silently build {''.join(built)!r} for {pattern!r}")


def _build_gpt(config: TransformerConfig, m: ModelSpec, lo: Layout) -> GPTModel:
    vocab = math.ceil(m.vocab_size / (128 * lo.tp)) * 128 * lo.tp
    # The local (non-TE) spec cannot do SP (torch LayerNorm) or CP (DotProductAttention): both are Transformer
    # Engine features, so the model is built without them; their layout rules are checked by the config,
    # parallel_state and the data-side helpers. Nor is the MTP block built (mtp_num_layers off for the build): an MTP
    # model syncs its embedding copy with a CUDA all-reduce at construction, and TransformerConfig and the layout
    # already checked what a layout decides about MTP (placement, counts).
    config.sequence_parallel, config.context_parallel_size = False, 1
    mtp_num_layers, config.mtp_num_layers = config.mtp_num_layers, None
    rank, vp_stage = _first_stage_with_layers(config, lo)
    try:
        with _mla_on_cpu(config) if m.multi_latent_attention else contextlib.nullcontext(), _as_rank(rank):
            return GPTModel(
                config=config,
                transformer_layer_spec=_gpt_layer_spec(config, m),
                vocab_size=vocab,
                max_sequence_length=MAX_SEQ,
                pre_process=True,
                post_process=lo.pp == 1,
                vp_stage=vp_stage if lo.vpp > 1 else None,
            )
    finally:
        config.sequence_parallel, config.context_parallel_size = lo.sp, lo.cp
        config.mtp_num_layers = mtp_num_layers


def _first_stage_with_layers(config: TransformerConfig, lo: Layout) -> tuple[int, int]:
    """The (pipeline rank, virtual stage) the model is built as: rank 0's first, unless the split leaves it without
    a decoder layer (a layout string's ``E|...``, or the embedding accounted as a layer on a one-slot stage): then
    the first stage that has one, so that the layer-level checks (widths over TP, experts over EP, MoE without SP)
    run as they would on that rank."""
    count_of = _layer_counter(config)
    for vp_stage in range(lo.vpp):
        for rank in range(lo.pp):
            try:
                if count_of(vp_stage=vp_stage if lo.vpp > 1 else None, pp_rank=rank) > 0:
                    return rank, vp_stage
            except (ValueError, AssertionError, RuntimeError, ZeroDivisionError):
                return 0, 0
    return 0, 0


@contextlib.contextmanager
def _as_rank(rank: int):
    """The model built as pipeline rank ``rank`` of the fake world (whose own rank is 0): parallel_state's rank (a
    layout string's count asks it) and ``get_pg_rank`` of the pipeline group (TransformerBlock's and
    TransformerLayer's counts and offsets ask it, 0.16.1), where the module has it."""
    if rank == 0:
        yield
        return
    real = megatron_utils.get_pg_rank

    def pg_rank(group=None):
        return rank if group is ps.get_pipeline_model_parallel_group() else real(group)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(ps, "get_pipeline_model_parallel_rank", return_value=rank))
        for module in (transformer_block_module, transformer_layer_module):
            if hasattr(module, "get_pg_rank"):
                stack.enter_context(mock.patch.object(module, "get_pg_rank", pg_rank))
        yield


def _layer_counter(config: TransformerConfig):
    """get_num_layers_to_build for any rank: transformer_block's asks a layout for the calling rank's count (it does
    not pass pp_rank on); the layout's own method takes the rank, so every rank is asked as itself."""
    layout = config.pipeline_model_parallel_layout
    return functools.partial(get_num_layers_to_build, config) if layout is None else layout.get_num_layers_to_build


def _gpt_layer_spec(config: TransformerConfig, m: ModelSpec):
    if not m.multi_latent_attention:
        return get_gpt_layer_local_spec(num_experts=m.num_moe_experts, moe_grouped_gemm=False)
    # Megatron's local MLA spec does not build on either release: its DotProductAttention takes no k_channels /
    # v_channels (MLA's K and V widths differ), and its column-parallel down projections are not the duplicated
    # linears of the TE spec every GPU run uses. The CPU backend's adaptation (cpu/spec.py) swaps in both, so the
    # model built is the trials' own, its TP-split widths the TE spec's.
    spec = get_gpt_layer_local_spec(num_experts=m.num_moe_experts, moe_grouped_gemm=False,
                                    multi_latent_attention=True, qk_layernorm=config.qk_layernorm,
                                    normalization=m.normalization)
    return adapt_local_block_spec(spec, config)


@contextlib.contextmanager
def _mla_on_cpu(config: TransformerConfig):
    """What building MLASelfAttention needs on a CPU-only torch without TE, none of it about the layout:
    ``multi_latent_attention.TELinear`` is the class it gives the duplicated mode to (a MagicMock on 0.16.1, None on
    0.19): the backend's DuplicatedLinear, as cpu/compat.py registers it (and 0.16.1's HAVE_TE, True there with TE
    missing, off); ``torch.cuda.current_device`` answers the CPU, because MLA builds its Yarn/RotaryEmbedding without
    use_cpu_initialization (multi_latent_attention.py MultiLatentAttention.__init__: the rotary embeddings then
    allocate on torch.cuda.current_device()). On 0.19 a model with qk_layernorm and no q_lora_rank is built with
    qk_layernorm off: its query norm is fused into q_proj, a TE layer (mla_qk_norm_config.py), and the norms split
    no width over TP (the fused q_proj splits heads x q_head_dim as the plain one does)."""
    q_norm_te_only = MLA_Q_NORM_FUSED and config.qk_layernorm and config.q_lora_rank is None
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(mla, "TELinear", DuplicatedLinear))
        if mla.HAVE_TE and not getattr(te_extensions, "HAVE_TE", True):
            stack.enter_context(mock.patch.object(mla, "HAVE_TE", False))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(yarn_rope, "get_pos_emb_on_this_cp_rank", _pos_emb_on_this_cp_rank))
        if q_norm_te_only:
            config.qk_layernorm = False
            stack.callback(setattr, config, "qk_layernorm", True)
        yield


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """rope_utils.get_pos_emb_on_this_cp_rank (the same chunks i and 2*CP-1-i of the sequence) without its pinned
    host index tensor and ``.cuda()``: YarnRotaryEmbedding fills its cos/sin cache at construction and slices it for
    this CP rank there (yarn_rotary_pos_embedding.py forward)."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1]))
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _build_hybrid_blocks(config: TransformerConfig, m: ModelSpec, lo: Layout) -> MoELayer | None:
    """The attention, MLP and MoE blocks a hybrid pattern uses, built the way MambaStack builds them (the Mamba
    mixer itself needs mamba_ssm); returns the MoE layer for the forward check."""
    dense = get_gpt_layer_local_spec().submodules
    moe_spec = get_gpt_layer_local_spec(num_experts=m.num_moe_experts, moe_grouped_gemm=False).submodules
    pattern = m.hybrid_layer_pattern or ""
    config.sequence_parallel, config.context_parallel_size = False, 1  # as in _build_gpt
    try:
        if "*" in pattern:
            build_module(dense.self_attention, config=config, layer_number=1)
        if "-" in pattern:
            _build_mlp(dense.mlp, config)
        return _build_mlp(moe_spec.mlp, config) if "E" in pattern else None
    finally:
        config.sequence_parallel, config.context_parallel_size = lo.sp, lo.cp


def _build_mlp(spec, config: TransformerConfig):
    """A layer spec's MLP or MoE block: ``build_module`` for a ModuleSpec (0.16.1); 0.19's specs give it as
    ``functools.partial(MLP.as_mlp_submodule or MoELayer, submodules=...)``, which TransformerLayer calls with these
    arguments (transformer/transformer_layer.py:433, its default process groups at :332)."""
    if isinstance(spec, functools.partial):
        from megatron.core.process_groups_config import ProcessGroupCollection

        return spec(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups(), is_mtp_layer=False)
    return build_module(spec, config=config)


def _moe_forward(config: TransformerConfig, moe: MoELayer, sp: bool) -> None:
    moe.train()
    try:
        moe(torch.zeros(4, 1, config.hidden_size))
    except ValueError as exc:
        if "MoE and tensor parallelism" in str(exc):
            raise Rejected(f"MoELayer.forward: {exc}") from exc
    except Exception:  # noqa: BLE001
        pass  # past the SP check: the rest of a CPU forward hits CUDA-only code


def _data_side(case: Case) -> None:
    lo, seq = case.layout, case.seq_length
    tokens = torch.zeros(1, seq)
    if lo.cp > 1:
        tokens = _stage("get_batch_on_this_cp_rank", _cp_split, {"tokens": tokens})["tokens"]
    if lo.sp:
        hidden = torch.zeros(tokens.shape[1], 1, 1)
        _stage("scatter_to_sequence_parallel_region", scatter_to_sequence_parallel_region, hidden, ps.get_tensor_model_parallel_group())
    _stage("ConstantNumMicroBatchesCalculator", ConstantNumMicroBatchesCalculator, lo.gbs, lo.mbs, lo.dp, False, 0)


def _cp_split(batch: dict) -> dict:
    """The sequence into 2*CP chunks over the layout's CP group. 0.19 is given the group (without it, it splits over
    the whole world); 0.16.1 finds it in parallel_state."""
    if CP_SPLIT_NEEDS_GROUP:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)



# -- drawing cases -----------------------------------------------------------------------------------------------
@st.composite
def moe_fields(draw) -> dict:
    if not draw(st.booleans()):
        return {}
    experts = draw(st.sampled_from([2, 3, 4, 6, 8]))
    topk = draw(st.integers(1, min(experts, 2)))
    fields = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_router_pre_softmax=draw(st.booleans()),
        moe_ffn_hidden_size=draw(st.sampled_from([16, 24, 32])),
    )
    if draw(st.integers(0, 4)) == 0:
        fields["moe_router_num_groups"] = draw(st.sampled_from([2, 3]))
    return fields


@st.composite
def gpt_models(draw) -> ModelSpec:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    groups = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    return ModelSpec(
        num_layers=draw(st.integers(1, 9)),
        hidden_size=draw(st.sampled_from([16, 24, 32, 48])),
        ffn_hidden_size=draw(st.sampled_from([24, 32, 48, 64])),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=8,
        vocab_size=100,
        add_bias_linear=draw(st.integers(0, 3)) == 0,
        mtp_num_layers=draw(st.sampled_from([0, 0, 0, 1, 2])),  # issue 52: MTP placed by layout strings
        **draw(moe_fields()),
    )


@st.composite
def mla_models(draw) -> ModelSpec:
    """DeepSeek-style models: MLA attention, half of them MoE; widths that TP often does not divide (the down
    projections are duplicated, the up projections split heads), a query LoRA or none (V2-Lite), sometimes
    num_query_groups given (ModelSpec accepts only the head count on an MLA model; the backend passes it on)."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    return ModelSpec(
        num_layers=draw(st.integers(1, 9)),
        hidden_size=draw(st.sampled_from([16, 24, 32, 48])),
        ffn_hidden_size=draw(st.sampled_from([24, 32, 48, 64])),
        num_attention_heads=heads,
        num_query_groups=heads if draw(st.integers(0, 3)) == 0 else None,
        vocab_size=100,
        add_bias_linear=draw(st.integers(0, 3)) == 0,
        qk_layernorm=draw(st.booleans()),
        multi_latent_attention=True,
        q_lora_rank=draw(st.none() | st.sampled_from([6, 8, 12, 16])),
        kv_lora_rank=draw(st.sampled_from([6, 8, 12, 16])),
        qk_head_dim=draw(st.sampled_from([4, 6, 8])),
        qk_pos_emb_head_dim=draw(st.sampled_from([2, 4])),  # RoPE rotates pairs
        v_head_dim=draw(st.sampled_from([4, 6, 8, 12])),
        **draw(moe_fields()),
    )


@st.composite
def hybrid_models(draw) -> ModelSpec:
    moe = draw(moe_fields())
    symbols = "M*-E" if moe else "M*-"
    pattern = "".join(draw(st.lists(st.sampled_from(symbols), min_size=1, max_size=9)))
    if moe and "E" not in pattern:
        pattern += "E"
    heads = draw(st.sampled_from([1, 2, 4, 6, 8]))
    return ModelSpec(
        num_layers=len(pattern),
        hybrid_layer_pattern=pattern,
        hidden_size=32,
        ffn_hidden_size=draw(st.sampled_from([24, 32, 64])),
        num_attention_heads=heads,
        num_query_groups=draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0])),
        kv_channels=8,
        vocab_size=100,
        mamba_num_heads=16,  # divides every TP*CP drawn: the (excluded) mixer rules stay silent
        mamba_num_groups=8,
        **moe,
    )


@st.composite
def cases(draw, models) -> Case:
    model = draw(models)
    # Mostly sizes a user would try (so that many cases get past the config), sometimes odd ones.
    tp = draw(st.sampled_from([1, 2, 2, 4, 4, 8, 3]))
    pp = draw(st.sampled_from([1, 1, 2, 3, 4]))
    vpp = draw(st.sampled_from([1, 1, 1, 2, 3]))
    cp = draw(st.sampled_from([1, 1, 2]))
    ep = draw(st.sampled_from([1, 2, 3, 4] if model.is_moe else [1, 1, 1, 1, 2]))
    etp = draw(st.sampled_from([1, 1, 2] if model.is_moe else [1, 1, 1, 1, 2]))
    if draw(st.integers(0, 5)) == 0:
        world = draw(st.integers(1, 48))  # anything: sometimes indivisible
    else:
        world = tp * pp * cp * draw(st.sampled_from([1, 2, 3, 4]))
    if world > 64:
        world = tp * pp * cp
    layout = Layout(
        world_size=world, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
        sp=draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else tp > 1,
        mbs=draw(st.sampled_from([1, 2])), gbs=draw(st.sampled_from([8, 12, 16, 24, 48])),
    )
    split = draw(st.integers(0, 7)) if pp > 1 else 7
    if split <= 1:
        # An explicit (possibly wrong) uneven split, as a --layout or a Bridge recipe could give.
        first = draw(st.none() | st.integers(1, model.num_layers))
        last = draw(st.none() | st.integers(1, model.num_layers))
        layout = replace(layout, first_stage_layers=first, last_stage_layers=last)
    elif split == 2:
        # Megatron's embedding/loss accounting, one or both, as Bridge's recipes set it (possibly not dividing).
        embedding, loss = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
        if embedding and (model.num_layers + 1 + loss) // (pp * vpp) <= 1:
            # Rank 0 would build no decoder layer, and the model is built on rank 0 only: Megatron's model-level
            # checks (widths, experts vs EP) would not run, so the comparison would say nothing. Loss only.
            embedding, loss = False, True
        layout = replace(layout, account_for_embedding=embedding, account_for_loss=loss)
    elif split in (3, 4):
        layout = replace(layout, **_layout_string(draw, model, pp, vpp))
    else:
        layout = with_pipeline_split(layout, model)
    return Case(model, layout, draw(st.sampled_from([16, 24, 32, 48, 64, 96])))


def _layout_string(draw, model: ModelSpec, pp: int, vpp: int) -> dict:
    """A pipeline_model_parallel_layout as sweeper generates it (``balanced_layout``) or a user could write it:
    sometimes with a layer moved to another stage, one too many or too few, an MTP layer the model lacks, or a
    VPP other than the string's (Megatron derives VPP from the string and asserts a given one agrees)."""
    mtp = "m" * model.mtp_num_layers
    text = balanced_layout(model.num_layers, pp, vpp, model.mtp_num_layers)
    if text is None:  # a middle stage would be empty: write every stage by hand, one layer each where possible
        text = "E" + "|".join("t" * (model.num_layers // (pp * vpp)) for _ in range(pp * vpp)) + mtp + "L"
    stages = parse_layout(text, 1)
    flat = list(stages)
    mutation = draw(st.integers(0, 7))
    if mutation == 0:  # a layer moved: Megatron accepts any placement of the right count
        src, dst = draw(st.integers(0, len(flat) - 1)), draw(st.integers(0, len(flat) - 1))
        if "t" in flat[src]:
            flat[src] = flat[src].replace("t", "", 1)
            flat[dst] = flat[dst].replace("L", "") + "t" + ("L" if flat[dst].endswith("L") else "")
    elif mutation == 1:
        flat[-1] = "t" + flat[-1]  # one layer too many
    elif mutation == 2:
        flat[-1] = flat[-1].replace("L", "mL")  # an MTP layer the model does not have
    elif mutation == 3 and mtp and len(flat) > 1:
        # The MTP layers one stage earlier: a standalone MTP stage (the last virtual stage of another rank), or
        # not Megatron's to accept (not a last virtual stage, or decoder layers after it).
        flat[-1] = flat[-1].replace(mtp, "")
        flat[-2] += mtp
    written = "|".join(flat)
    string_vpp = max(1, len(flat) // pp)
    given_vpp = draw(st.sampled_from([string_vpp] * 5 + [1, 2]))
    return {"pipeline_layout": written, "vpp": given_vpp}


# SWEEPER_XCHECK_SCALE=10 runs ten times more examples (a deeper hunt, minutes).
SCALE = int(os.environ.get("SWEEPER_XCHECK_SCALE", "1"))


def _agree(case: Case) -> None:
    ours = sweeper_reasons(case)
    theirs = megatron_verdict(case)
    event("megatron: valid" if theirs is None else f"megatron rejects in {theirs.split(':')[0]}")
    if case.layout.pipeline_layout:  # --hypothesis-show-statistics counts the layout strings drawn (issue 52)
        event("pipeline layout string, " + ("valid" if theirs is None else "refused"))
    assert (not ours) == (theirs is None), (
        f"\nmodel={case.model.model_dump(exclude_defaults=True)}\nlayout={case.layout!r}\n"
        f"seq_length={case.seq_length}\nsweeper: {ours or 'valid'}\nmegatron: {theirs or 'valid'}"
    )


@settings(max_examples=1000 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(gpt_models()))
def test_gpt_layouts_agree_with_megatron(case: Case) -> None:
    _agree(case)


@settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(mla_models()))
def test_mla_layouts_agree_with_megatron(case: Case) -> None:
    _agree(case)


@settings(max_examples=400 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(hybrid_models()))
def test_hybrid_layouts_agree_with_megatron(case: Case) -> None:
    _agree(case)


# Hand-picked cases that must stay covered whatever hypothesis draws.
def _dense(**kw) -> ModelSpec:
    base = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=8, vocab_size=100)
    return ModelSpec(**{**base, **kw})


def _hybrid(pattern: str) -> ModelSpec:
    return _dense(num_layers=len(pattern), hybrid_layer_pattern=pattern, mamba_num_heads=16, mamba_num_groups=8)


def _mla(**kw) -> ModelSpec:
    base = dict(num_query_groups=None, multi_latent_attention=True, q_lora_rank=6, kv_lora_rank=6, qk_head_dim=8,
                qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True)
    return _dense(**{**base, **kw})


def _L(**kw) -> Layout:
    return Layout(**{"gbs": 48, **kw})


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
EXAMPLES = [
    (Case(_dense(), _L(world_size=8, tp=2, pp=2), 64), True),
    (Case(_dense(num_attention_heads=6, num_query_groups=6), _L(world_size=4, tp=4), 64), False),
    (Case(_dense(), _L(world_size=6, tp=4), 64), False),
    (Case(_dense(), _L(world_size=2, sp=True), 64), False),
    (Case(_dense(num_layers=5), _L(world_size=2, pp=2), 64), False),  # even split asserted at build
    (Case(_dense(num_layers=5), with_pipeline_split(_L(world_size=2, pp=2), _dense(num_layers=5)), 64), True),
    (Case(_dense(), _L(world_size=2, pp=2, vpp=4), 64), False),
    # 126 layers on PP8 x VPP8 in miniature: 14 layers + embedding + loss on PP4 x VPP2 (2 slots per virtual stage).
    (Case(_dense(num_layers=14), _L(world_size=4, pp=4, vpp=2, gbs=8), 64), False),
    (Case(_dense(num_layers=14), with_pipeline_split(_L(world_size=4, pp=4, vpp=2, gbs=8),
                                                           _dense(num_layers=14)), 64), True),
    (Case(_dense(num_layers=14), _L(world_size=4, pp=4, vpp=2, gbs=8, account_for_embedding=True), 64), False),
    # Issue 52: 30 layers + embedding + loss on PP4 x VPP8 (one slot per virtual stage, rank 0's first holding only
    # the embedding) build; 13 layers on PP4 x VPP2 split only with a layout string, sweeper's generated one.
    (Case(_dense(num_layers=30), _L(world_size=4, pp=4, vpp=8, gbs=8, account_for_embedding=True,
                                    account_for_loss=True), 64), True),
    (Case(_dense(num_layers=13), _L(world_size=4, pp=4, vpp=2, gbs=8, pipeline_layout="E|(tt|)*6tL"), 64), True),
    (Case(_dense(num_layers=13), _L(world_size=4, pp=4, vpp=1, gbs=8, pipeline_layout="E|(tt|)*6tL"), 64), False),
    (Case(_dense(num_layers=13), _L(world_size=4, pp=4, vpp=2, gbs=8, pipeline_layout="E|(tt|)*6tmL"), 64), False),
    (Case(_dense(), _L(world_size=4, ep=2), 64), False),
    (Case(_dense(**MOE), _L(world_size=8, tp=2, ep=2, sp=True), 64), True),
    (Case(_dense(**MOE), _L(world_size=8, tp=2, ep=2, sp=False), 64), False),  # MoE forward check
    (Case(_dense(**MOE), _L(world_size=3, ep=3), 64), False),  # experts % EP: bare assert in moe_layer
    (Case(_dense(**{**MOE, "moe_router_topk": 1}), _L(world_size=1), 64), False),
    (Case(_dense(), _L(world_size=2, cp=2), 6), False),
    (Case(_dense(), _L(world_size=2, gbs=3), 64), False),
    # MLA: the down projections are duplicated (LoRA ranks need not divide by TP), the up projections split heads.
    (Case(_mla(), _L(world_size=4, tp=4, sp=True), 64), True),
    (Case(_mla(num_attention_heads=6), _L(world_size=4, tp=4, sp=True), 64), False),
    (Case(_mla(q_lora_rank=None), _L(world_size=2, tp=2, sp=True), 64), True),  # 0.19: built without qk norms
    (Case(_mla(**MOE), _L(world_size=4, tp=2, ep=2, sp=True), 64), True),
    (Case(_mla(), _L(world_size=4, tp=2, cp=2, sp=True), 64), True),  # the rotary embedding sliced for CP rank 0
    (Case(_mla(), _L(world_size=2, pp=2), 64), True),
    # Hybrid pipeline splits (0.16.1: MambaStack; 0.19: select_pipeline_segment).
    (Case(_hybrid("M*M-"), _L(world_size=2, pp=2), 64), True),
    (Case(_hybrid("M*M-M"), _L(world_size=2, pp=2), 64), False),  # 0.16.1 truncates, 0.19 raises
    (Case(_hybrid("M*M-M"), with_pipeline_split(_L(world_size=2, pp=2), _hybrid("M*M-M")), 64), True),
    (Case(_hybrid("M*M-"), _L(world_size=2, pp=2, vpp=2), 64), False),
    (Case(_hybrid("M*M-"), _L(world_size=2, pp=2, account_for_embedding=True, account_for_loss=True), 64), False),
]


@pytest.mark.parametrize(("case", "valid"), EXAMPLES)
def test_known_cases(case: Case, valid: bool) -> None:
    assert (megatron_verdict(case) is None) == valid, megatron_verdict(case)
    assert (not sweeper_reasons(case)) == valid, sweeper_reasons(case)


def test_trial_cp_split_is_megatrons() -> None:
    """The trials split a batch over CP with ``releases.batch_on_this_cp_rank`` (backends/megatron/steps.py): in a
    world larger than the CP group (TP2 x CP2) it must keep the chunks Megatron's split over the CP group keeps, CP
    rank 0 chunks 0 and 3 of 4. (On 0.19 a call without cp_group splits over the whole world: 8 chunks.)"""
    tokens = torch.arange(16).reshape(1, 16)
    with fake_world(4):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2,
                                     create_gloo_process_groups=False)
        theirs = _cp_split({"tokens": tokens.clone()})["tokens"].tolist()
        ours = releases.batch_on_this_cp_rank({"tokens": tokens.clone()})["tokens"].tolist()
    assert theirs == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert ours == theirs, f"the trials' CP split keeps {ours}, Megatron's over the CP group {theirs}"


# -- issue 18's knobs: each knob rule against TransformerConfig.__post_init__ ----------------------------------
# The rule cases of test_rules.py for the four knob rules, less the verdicts TransformerConfig cannot give: a
# dispatcher named on a dense model (sweeper's own: Megatron ignores it), flex with ETP x EP = 1 (asserted when
# the flex dispatcher is built, token_dispatcher.py) and the A2A overlap on a hybrid model (asserted by the combined
# 1F1B schedule, pipeline_parallel/combined_1f1b.py).
NOT_IN_CONFIG = ("only applies to MoE models", "Flex token dispatcher requires TPxEP > 1",
                 "only GPTModel is supported for EP A2A overlapping")


def _knob_cases() -> list:  # of pytest.param
    from test_rules import CASES as RULE_CASES  # tests/plan is on sys.path (pytest rootdir import mode)
    from test_rules import on_this_release

    out = []
    for name in ("token_dispatcher", "a2a_overlap", "cuda_graphs", "activation_offload"):
        for i, (model, layout, _cluster, seq, expected) in enumerate(RULE_CASES[name]):
            expected = on_this_release(name, expected)
            if expected is None or not any(text in expected for text in NOT_IN_CONFIG):
                out.append(pytest.param(model, layout, seq, expected is None, id=f"{name}-{i}"))
    return out


@pytest.mark.parametrize(("model", "layout", "seq", "valid"), _knob_cases())
def test_knob_rules_agree_with_megatron(model: ModelSpec, layout: Layout, seq: int, valid: bool) -> None:
    """The same layout with its knobs as TransformerConfig fields (Layout.knob_config, moe_config,
    recompute_config and the precision's params dtype) is accepted by megatron-core exactly when the rules accept
    it."""
    graph_modules = megatron_release.graph_modules()  # the graphs under the installed release's names, as trials
    base = transformer_config(Case(model, layout, seq))
    fields = dict(layout.knob_config(graph_modules), **layout.recompute_config())
    if model.is_moe:
        fields.update(layout.moe_config())
    if layout.precision in ("bf16", "fp8", "mxfp8", "nvfp4"):
        fields.update(bf16=True, params_dtype=torch.bfloat16)
    if graph_modules:
        # 0.19 derives inference_cuda_graph_scope from cuda_graph_impl in __post_init__ (transformer_config.py:2452,
        # cuda_graph_config.py normalize_inference_cuda_graph_scope) and then asserts the pair, so dataclasses.replace
        # on a built config keeps the derived 'none' and refuses cuda_graph_impl='local' by itself. One construction
        # with every field, as the trial's config is built (backends/megatron/layout_config.py).
        try:
            transformer_config(Case(model, layout, seq), **fields)
            refused = None
        except Rejected as exc:
            refused = str(exc)
        assert (refused is None) == valid, refused
        return
    try:
        replace(base, **fields)
        refused = None
    except (ValueError, AssertionError) as exc:
        refused = f"{type(exc).__name__}: {exc}"
    assert (refused is None) == valid, refused


# -- FP8 recipes (issue 52) -------------------------------------------------------------------------------------
# The FP8 checks TransformerConfig.__post_init__ makes (delayed scaling refuses moe_act and layernorm recompute; the
# other recipes recompute them) are asked with the FP8 fields the GPU trial passes for the precision
# (gpu.fp8_precision_kwargs: the recipe a precision names, else run.fp8_recipe, else the device's default).
# One patch, not about layouts: ``transformer_config.is_te_min_version`` answers True (a Transformer Engine new
# enough for every recipe, >= 2.6: the version checks read the installed TE, which a CPU-only torch lacks, and
# the plan cannot know the nodes'; the GPU trial's own TransformerConfig checks the real one). The compute
# capabilities drawn run every drawn recipe (hardware is fp8_hardware's, excluded above as a TE/GPU check).
FP8_PRECISIONS = ("bf16", "fp8", "fp8:delayed", "fp8:tensorwise", "fp8:blockwise")


@st.composite
def fp8_cases(draw) -> tuple[Case, str, object]:
    from sweeper.config.run_settings import RunSettings

    model = draw(gpt_models())
    capability = draw(st.sampled_from(["9.0", "10.0"]))
    precisions = FP8_PRECISIONS + (("mxfp8",) if capability == "10.0" else ())
    # Modules the model has (recompute_modules_exist, sweeper's own rule, stays silent): MoE models here are MoE in
    # every layer.
    modules = ["core_attn", "layernorm"] + (["moe_act", "moe"] if model.is_moe else ["mlp"])
    chosen = draw(st.lists(st.sampled_from(modules), max_size=3, unique=True))
    recompute = draw(st.sampled_from(["none", "full"])) if not chosen else "selective:" + "+".join(chosen)
    layout = Layout(world_size=1, gbs=8, precision=draw(st.sampled_from(precisions)), recompute=recompute)
    run = RunSettings(fp8_recipe=draw(st.sampled_from(["auto", "delayed", "tensorwise", "blockwise"])))
    return Case(model, layout, 64), capability, run


def _fp8_megatron_verdict(case: Case, capability: str, run) -> str | None:
    from sweeper.backends.megatron.gpu import fp8_precision_kwargs
    from sweeper.backends.megatron.layout_config import params_dtype

    lo = case.layout
    major, minor = (int(p) for p in capability.split("."))
    fp8, _, _ = fp8_precision_kwargs(lo.precision, (major, minor), None if run.fp8_recipe == "auto" else run.fp8_recipe)
    fields = dict(fp8, **lo.recompute_config())
    if case.model.is_moe:  # the GPU trial's grouped experts (build.py: moe_grouped_gemm under TE), which moe_act
        fields["moe_grouped_gemm"] = True  # recompute needs ("only supported with moe_grouped_gemm")
    if lo.precision != "fp32":
        fields.update(bf16=True, params_dtype=params_dtype(lo))
    with mock.patch("megatron.core.transformer.transformer_config.is_te_min_version", return_value=True):
        try:
            transformer_config(case, **fields)
        except Rejected as exc:
            return str(exc)
    return None


@settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=list(HealthCheck))
@given(fp8_cases())
def test_fp8_recipe_rules_agree_with_megatron(drawn: tuple[Case, str, object]) -> None:
    """Every FP8 recipe as a precision value (and a bare fp8 under each run.fp8_recipe) with recompute modules on
    dense and MoE models: the rules TransformerConfig checks refuse a case exactly when megatron-core does."""
    case, capability, run = drawn
    cluster = ClusterConfig(nodes=1, gpus_per_node=8, compute_capability=capability)
    ctx = rules.RuleContext(case.model, case.layout, cluster, case.seq_length, run)  # type: ignore[arg-type]
    ours = [reason for fn in COMPARED if (reason := fn(ctx))]
    theirs = _fp8_megatron_verdict(case, capability, run)
    event(f"{case.layout.precision}/{run.fp8_recipe}: " + ("valid" if theirs is None else "rejected"))  # type: ignore
    assert (not ours) == (theirs is None), (
        f"\nmodel={case.model.model_dump(exclude_defaults=True)}\nlayout={case.layout!r}\ncapability={capability}"
        f"\nrun={run!r}\nsweeper: {ours or 'valid'}\nmegatron: {theirs or 'valid'}"
    )
