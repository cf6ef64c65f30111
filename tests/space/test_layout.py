"""Layout: derived sizes, the --layout string round trip, Megatron-LM flags, Megatron-Bridge overrides, the uneven
pipeline split and the space's enumeration."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sweeper.config.schema import ClusterConfig, SpaceConfig, SweepConfig, TrainingConfig, layout_from_string
from sweeper.errors import LayoutError
from sweeper.models.catalog import preset
from sweeper.plan.space import enumerate_layouts, matches, only_filter
from sweeper.space.layout import Layout, parse_assignments
from sweeper.space.pipeline import uneven_split, with_pipeline_split


def _cfg(model: str = "tiny-gpt", nodes: int = 2, per_node: int = 8, gbs: int = 64, **space) -> SweepConfig:
    return SweepConfig(
        name="t",
        model=preset(model),
        cluster=ClusterConfig(nodes=nodes, gpus_per_node=per_node),
        training=TrainingConfig(seq_length=256, global_batch_size=gbs),
        space=SpaceConfig(**space),
    )


# -- derived sizes ------------------------------------------------------------------------------------------------
def test_dp_is_world_over_tp_pp_cp() -> None:
    assert Layout(world_size=16, tp=2, pp=2, cp=2).dp == 2
    assert Layout(world_size=16, tp=4, pp=4).dp == 1
    assert Layout(world_size=12, tp=8).dp == 0  # does not divide: the rules say why


def test_edp_folds_cp_and_ignores_tp() -> None:
    # W = ETP * EP * EDP * PP; CP and TP do not appear.
    assert Layout(world_size=16, tp=2, pp=2, cp=2, ep=4, etp=1).edp == 2
    assert Layout(world_size=16, tp=4, pp=1, ep=2, etp=2).edp == 4
    assert Layout(world_size=16, ep=3).edp == 0


def test_microbatches() -> None:
    lo = Layout(world_size=16, tp=2, pp=2, mbs=2, gbs=64)  # dp 4, mbs 2 -> 8 per step
    assert lo.num_microbatches == 8
    assert Layout(world_size=16, tp=2, pp=2, mbs=3, gbs=64).num_microbatches == 0
    assert Layout(world_size=12, tp=8, gbs=64).num_microbatches == 0  # no dp


@pytest.mark.parametrize("field", ["world_size", "tp", "pp", "cp", "ep", "etp", "vpp", "mbs", "gbs"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_sizes_must_be_positive_integers(field: str, bad: object) -> None:
    kwargs = {"world_size": 8, field: bad}
    with pytest.raises(LayoutError, match=field):
        Layout(**kwargs)


def test_a_resized_layout_is_the_replaced_one_and_checks_its_new_sizes() -> None:
    lo = Layout(world_size=16, tp=2, pp=2, vpp=2, ep=4, mbs=2, gbs=64, precision="fp8", recompute="full",
                pipeline_layout="Et|tt|tt|tL", moe_a2a_overlap=True)
    hash(lo)  # a kept hash must not follow the copy
    big = lo.resized(64, 256)
    assert big == dataclasses.replace(lo, world_size=64, gbs=256) and hash(big) == hash(
        dataclasses.replace(lo, world_size=64, gbs=256))
    assert (big.dp, big.edp, big.num_microbatches) == (16, 8, 8) and lo.world_size == 16
    for bad in (0, -2, True, 2.0):
        with pytest.raises(LayoutError, match="world_size"):
            lo.resized(bad, 64)  # type: ignore[arg-type]
        with pytest.raises(LayoutError, match="gbs"):
            lo.resized(32, bad)  # type: ignore[arg-type]


def test_recompute_modules_are_canonical_and_checked() -> None:
    lo = Layout(world_size=1, recompute="selective:layernorm+moe_act")
    assert lo.recompute == "selective:moe_act+layernorm" and lo.recompute_granularity == "selective"
    assert lo.recompute_modules == ("moe_act", "layernorm")
    assert Layout(world_size=1, recompute="selective:core_attn").recompute == "selective"
    assert Layout(world_size=1, recompute="selective").recompute_modules == ("core_attn",)
    assert Layout(world_size=1, recompute="full").recompute_modules == ()
    assert lo.recompute_config() == {"recompute_granularity": "selective", "recompute_modules": ["moe_act", "layernorm"]}
    with pytest.raises(LayoutError, match="unknown module 'moe_ac'"):
        Layout(world_size=1, recompute="selective:moe_ac")
    with pytest.raises(LayoutError, match="selective:<modules>"):
        Layout(world_size=1, recompute="full:moe")
    assert parse_assignments("recompute=selective:moe+layernorm")["recompute"] == "selective:layernorm+moe"


def test_precision_and_recompute_are_checked() -> None:
    with pytest.raises(LayoutError, match="precision"):
        Layout(world_size=1, precision="fp4")
    with pytest.raises(LayoutError, match="recompute"):
        Layout(world_size=1, recompute="some")


def test_dict_round_trip() -> None:
    lo = Layout(world_size=16, tp=2, pp=2, ep=4, sp=True, mbs=2, gbs=64, first_stage_layers=14, last_stage_layers=13)
    data = lo.to_dict()
    assert data["dp"] == 4 and data["edp"] == 2 and data["gpus"] == 16
    assert Layout.from_dict(data) == lo


# -- --layout strings ---------------------------------------------------------------------------------------------
LAYOUTS = st.builds(
    Layout,
    world_size=st.sampled_from([1, 2, 4, 8, 16]),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4]),
    vpp=st.sampled_from([1, 2]),
    cp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
    etp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    mbs=st.sampled_from([1, 2, 4]),
    gbs=st.sampled_from([8, 64, 128]),
    precision=st.sampled_from(["fp32", "fp16", "bf16", "fp8", "fp8:delayed", "fp8:tensorwise", "fp8:blockwise",
                               "mxfp8", "nvfp4"]),
    recompute=st.sampled_from(["none", "selective", "full", "selective:moe", "selective:moe_act+layernorm"]),
    distributed_optimizer=st.booleans(),
    moe_token_dispatcher=st.sampled_from([None, "alltoall", "allgather", "flex:deepep", "flex:hybridep"]),
    moe_a2a_overlap=st.booleans(),
    cuda_graph=st.sampled_from(["none", "local", "full_iteration", "te:attn", "te:attn+moe_router+moe_preprocess"]),
    offload_layers=st.sampled_from([0, 1, 3]),
    fsdp=st.sampled_from([None, "optim", "optim_grads", "optim_grads_params"]),
)


@settings(max_examples=200, deadline=None)
@given(LAYOUTS)
def test_to_string_round_trips_through_layout_from_string(lo: Layout) -> None:
    cfg = _cfg()  # tiny-gpt: 4 layers, so PP 2 and 4 divide and no uneven split is added
    assert layout_from_string(cfg, lo.to_string()) == lo


@settings(max_examples=100, deadline=None)
@given(LAYOUTS)
def test_to_string_parses_to_its_own_fields(lo: Layout) -> None:
    parsed = parse_assignments(lo.to_string())
    assert parsed["gpus"] == lo.world_size
    for key in ("tp", "pp", "vpp", "cp", "ep", "etp", "sp", "mbs", "gbs", "precision", "recompute"):
        assert parsed[key] == getattr(lo, key)


def test_a_precision_that_names_its_fp8_recipe_is_a_precision_value() -> None:
    """Issue 52: fp8:<recipe> parses, names the layout, and is FP8 (quantised); an unknown recipe is refused."""
    lo = Layout(world_size=8, ep=8, precision="fp8:tensorwise", recompute="selective:layernorm")
    assert lo.short().endswith("-fp8:tensorwise") and lo.is_fp8 and lo.quantized
    assert parse_assignments("precision=fp8:Blockwise")["precision"] == "fp8:blockwise"
    with pytest.raises(LayoutError, match="precision must be one of .*fp8:delayed, fp8:tensorwise, fp8:blockwise"):
        parse_assignments("precision=fp8:mxfp8")
    assert Layout(world_size=1, precision="nvfp4").is_fp8 is False


def test_layout_from_string_fills_from_the_space_and_dp() -> None:
    cfg = _cfg(tp=[2, 4], pp=[1, 2], mbs=[2])
    lo = layout_from_string(cfg, "pp=2,dp=2")
    assert (lo.tp, lo.pp, lo.world_size, lo.mbs, lo.sp) == (2, 2, 8, 2, True)  # tp from space[0], sp auto
    assert layout_from_string(cfg, "tp=4").world_size == 16  # the largest world size


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tp=2,tp=4", "given twice"),
        ("tq=2", "unknown key 'tq'"),
        ("tp=0", "positive integer"),
        ("tp", "not key=value"),
        ("sp=maybe", "true or false"),
        ("precision=fp4", "precision must be one of"),
        ("gpus=8,tp=2,dp=2", "tp*pp*cp*dp"),
        ("gpus=32", "cluster has 16"),
        ("tp=2,edp=3", "edp=3"),
    ],
)
def test_bad_layout_strings(text: str, message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        layout_from_string(_cfg(), text)


# -- Megatron-LM flags ----------------------------------------------------------------------------------------------
# Verified against Megatron-LM megatron/training/arguments.py (argparse names): --tensor-model-parallel-size,
# --pipeline-model-parallel-size, --context-parallel-size, --expert-model-parallel-size,
# --expert-tensor-parallel-size, --micro-batch-size, --global-batch-size, --num-virtual-stages-per-pipeline-rank,
# --decoder-first/last-pipeline-num-layers, --sequence-parallel, --use-distributed-optimizer, --fp16/--bf16,
# --fp8-format {e4m3,hybrid}, --fp8-recipe {tensorwise,delayed,mxfp8,blockwise}, --recompute-granularity
# {full,selective}, --recompute-modules (nargs *, Megatron-Core's module names), --recompute-method {uniform,block},
# --recompute-num-layers, --fp4-format {e2m1}, --fp4-recipe {nvfp4,custom} (TransformerConfig.fp4 / fp4_recipe).
KNOWN_FLAGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--micro-batch-size", "--global-batch-size",
    "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--sequence-parallel", "--use-distributed-optimizer", "--fp16", "--bf16",
    "--fp8-format", "--fp8-recipe", "--recompute-granularity", "--recompute-modules", "--recompute-method",
    "--recompute-num-layers", "--fp4-format", "--fp4-recipe",
    # issue 18's knobs
    "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-router-dtype",
    "--overlap-moe-expert-parallel-comm", "--cuda-graph-impl", "--cuda-graph-scope",
    "--no-check-for-nan-in-loss-and-grad", "--moe-pad-experts-for-cuda-graph-inference", "--cpu-offloading-num-layers",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format",
}
CHOICES = {
    "--fp8-format": {"e4m3", "hybrid"},
    "--fp8-recipe": {"tensorwise", "delayed", "mxfp8", "blockwise"},
    "--recompute-granularity": {"full", "selective"},
    "--recompute-method": {"uniform", "block"},
    "--fp4-format": {"e2m1"},
    "--fp4-recipe": {"nvfp4", "custom"},
    "--moe-token-dispatcher-type": {"allgather", "alltoall", "flex"},
    "--moe-flex-dispatcher-backend": {"deepep", "hybridep"},
    "--moe-router-dtype": {"fp32", "fp64"},
    "--cuda-graph-impl": {"none", "local", "transformer_engine"},
    "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
    "--ckpt-format": {"fsdp_dtensor"},  # what Megatron-FSDP asks for; sweeper leaves the format alone otherwise
}
CUDA_GRAPH_SCOPE_CHOICES = {"full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"}
RECOMPUTE_MODULE_CHOICES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}


def _flags(argv: list[str]) -> dict[str, str]:
    """``--flag=value`` items, and the space-separated values of list flags (``--recompute-modules a b``)."""
    out: dict[str, str] = {}
    key = ""
    for item in argv:
        if item.startswith("--"):
            key, _, value = item.partition("=")
            out[key] = value
        else:
            out[key] = f"{out[key]} {item}".strip()
    return out


@settings(max_examples=150, deadline=None)
@given(LAYOUTS, st.none() | st.tuples(st.integers(1, 20), st.integers(1, 20)))
def test_megatron_args_use_megatron_lm_flag_names(lo: Layout, split: tuple[int, int] | None) -> None:
    if split:
        lo = dataclasses.replace(lo, first_stage_layers=split[0], last_stage_layers=split[1])
    args = _flags(lo.megatron_args())
    assert set(args) <= KNOWN_FLAGS, set(args) - KNOWN_FLAGS
    for flag, choices in CHOICES.items():
        if flag in args:
            assert args[flag] in choices
    assert args["--tensor-model-parallel-size"] == str(lo.tp)
    assert args["--pipeline-model-parallel-size"] == str(lo.pp)
    assert args["--context-parallel-size"] == str(lo.cp)
    assert args["--expert-model-parallel-size"] == str(lo.ep)
    assert args["--expert-tensor-parallel-size"] == str(lo.etp)
    assert args["--micro-batch-size"] == str(lo.mbs) and args["--global-batch-size"] == str(lo.gbs)
    assert ("--num-virtual-stages-per-pipeline-rank" in args) == (lo.vpp > 1)
    assert ("--sequence-parallel" in args) == lo.sp
    assert ("--use-distributed-optimizer" in args) == lo.distributed_optimizer
    assert args.get("--decoder-first-pipeline-num-layers") == (str(split[0]) if split else None)
    assert ("--bf16" in args) == (lo.precision == "bf16" or lo.quantized)  # BF16 weights under every recipe
    assert ("--fp4-format" in args) == (lo.precision == "nvfp4")
    assert not ("--fp4-format" in args and "--fp8-format" in args)  # "cannot be used simultaneously" (Megatron-LM)
    assert ("--fp16" in args) == (lo.precision == "fp16")
    # The FP8 recipe is a run setting (RunSettings.megatron_args); the layout names MXFP8's own recipe only.
    assert args.get("--fp8-recipe") == {"mxfp8": "mxfp8"}.get(lo.precision)
    assert args.get("--recompute-granularity") == (None if lo.recompute == "none" else lo.recompute_granularity)
    modules = args.get("--recompute-modules", "core_attn" if lo.recompute == "selective" else "").split()
    assert set(modules) <= RECOMPUTE_MODULE_CHOICES and tuple(modules) == lo.recompute_modules
    assert set(args.get("--cuda-graph-scope", "").split()) <= CUDA_GRAPH_SCOPE_CHOICES
    assert ("--cuda-graph-impl" in args) == (lo.cuda_graph != "none")
    assert args.get("--cpu-offloading-num-layers") == (str(lo.offload_layers) if lo.offload_layers else None)
    assert ("--moe-token-dispatcher-type" in args) == (lo.moe_token_dispatcher is not None)
    assert args.get("--data-parallel-sharding-strategy") == lo.fsdp
    assert ("--use-megatron-fsdp" in args) == ("--ckpt-format" in args) == (lo.fsdp is not None)


# -- Megatron-Bridge overrides ------------------------------------------------------------------------------------
# Section and recipe names verified against Megatron-Bridge: ConfigContainer groups train/model/optimizer/ddp/
# mixed_precision; train.micro_batch_size, train.global_batch_size, ddp.use_distributed_optimizer and
# optimizer.use_distributed_optimizer (kept in sync); recipes in megatron/bridge/training/mixed_precision.py.
# The recipe names every supported Bridge release registers (tests/data/megatron_bridge_fields.json), and null.
BRIDGE_RECIPES = {"null"} | set.intersection(*(set(fields["mixed_precision_recipes"]) for fields in json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "megatron_bridge_fields.json").read_text()).values()))
BRIDGE_OTHER_FIELDS = {
    "train.micro_batch_size", "train.global_batch_size", "ddp.use_distributed_optimizer",
    "optimizer.use_distributed_optimizer", "mixed_precision",
    "comm_overlap.overlap_moe_expert_parallel_comm",  # Bridge's CommOverlapConfig sets the model's from it
    "checkpoint.ckpt_format",  # CheckpointConfig; Megatron-FSDP asserts fsdp_dtensor there
}


@settings(max_examples=100, deadline=None)
@given(LAYOUTS, st.booleans())
def test_bridge_model_overrides_are_megatron_core_config_fields(lo: Layout, uneven: bool) -> None:
    torch = pytest.importorskip("torch")  # noqa: F841  (megatron-core imports it)
    from megatron.core.transformer.transformer_config import TransformerConfig

    if uneven:
        lo = dataclasses.replace(lo, first_stage_layers=3, last_stage_layers=2)
    from megatron.core.distributed import DistributedDataParallelConfig

    config_fields = {f.name for f in dataclasses.fields(TransformerConfig)}  # includes ModelParallelConfig's
    ddp_fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}  # Bridge's ddp subclasses it
    overrides = dict(o.split("=", 1) for o in lo.bridge_overrides())
    for key in overrides:
        section, _, name = key.partition(".")
        if section == "model":
            assert name in config_fields, key
        elif section == "ddp":
            assert name in ddp_fields, key
        else:
            assert key in BRIDGE_OTHER_FIELDS, key
    assert overrides["mixed_precision"] in BRIDGE_RECIPES
    assert overrides["model.tensor_model_parallel_size"] == str(lo.tp)
    assert overrides["model.virtual_pipeline_model_parallel_size"] == (str(lo.vpp) if lo.vpp > 1 else "null")
    assert overrides["model.sequence_parallel"] == str(lo.sp).lower()
    assert overrides["ddp.use_distributed_optimizer"] == overrides["optimizer.use_distributed_optimizer"]
    assert overrides.get("ddp.data_parallel_sharding_strategy") == (f'"{lo.fsdp}"' if lo.fsdp else None)
    assert overrides.get("ddp.use_megatron_fsdp") == ("true" if lo.fsdp else None)
    assert ("model.num_layers_in_first_pipeline_stage" in overrides) == uneven
    if lo.recompute != "none":
        assert overrides["model.recompute_granularity"] == lo.recompute_granularity
    if lo.recompute.startswith("selective:"):
        assert overrides["model.recompute_modules"] == f"[{','.join(lo.recompute_modules)}]"


# -- the uneven pipeline split ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "expected"),
    [
        (27, 2, 1, (14, 13)),
        (27, 4, 1, (7, 6)),  # 7 + 7 + 7 + 6: the first stage takes the extra layer, the last holds the loss
        (25, 4, 1, (7, 6)),  # 7 + 6 + 6 + 6
        (5, 2, 1, (3, 2)),
        (26, 4, 1, (6, 6)),  # 6 + 7 + 7 + 6
        (27, 2, 3, (15, 12)),  # every count a multiple of VPP
        (28, 3, 2, (10, 8)),  # 10 + 10 + 8
        (10, 4, 2, (4, 2)),  # 4 + 2 + 2 + 2
        (27, 4, 2, None),  # an odd layer count cannot be split into even counts
        (3, 4, 1, None),  # fewer layers than stages
    ],
)
def test_uneven_split(layers: int, pp: int, vpp: int, expected: tuple[int, int] | None) -> None:
    assert uneven_split(layers, pp, vpp) == expected


def _fits(layers: int, pp: int, vpp: int, first: int, last: int) -> bool:
    middle, stages = layers - first - last, pp - 2
    if (middle > 0) != (stages > 0) or middle < 0 or (stages and middle % stages):
        return False
    counts = [first, last] + ([middle // stages] if stages else [])
    return all(n > 0 and n % vpp == 0 for n in counts)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.integers(2, 8), st.sampled_from([1, 2, 3]))
def test_uneven_split_is_valid_and_most_balanced(layers: int, pp: int, vpp: int) -> None:
    split = uneven_split(layers, pp, vpp)
    candidates = [(f, la) for f in range(1, layers) for la in range(1, layers) if _fits(layers, pp, vpp, f, la)]
    if split is None:
        assert candidates == []
        return
    assert split in candidates

    def spread(f: int, la: int) -> int:
        counts = [f, la] + ([(layers - f - la) // (pp - 2)] if pp > 2 else [])
        return max(counts) - min(counts)

    assert spread(*split) == min(spread(*c) for c in candidates)


def test_with_pipeline_split_only_when_layers_do_not_divide() -> None:
    v2 = preset("deepseek-v2-lite")  # 27 layers
    lo = with_pipeline_split(Layout(world_size=16, pp=2), v2)
    assert (lo.first_stage_layers, lo.last_stage_layers) == (14, 13)
    assert with_pipeline_split(Layout(world_size=16, pp=3), v2).first_stage_layers is None  # 27 % 3 == 0
    assert with_pipeline_split(Layout(world_size=16), v2).first_stage_layers is None


# -- the space ----------------------------------------------------------------------------------------------------
def test_enumerate_resolves_sp_auto_and_dedups() -> None:
    cfg = _cfg(tp=[1, 2], sp=["auto", True, False])
    layouts = enumerate_layouts(cfg)
    assert len(layouts) == len(set(layouts))
    by_tp = {tp: sorted({lo.sp for lo in layouts if lo.tp == tp}) for tp in (1, 2)}
    assert by_tp == {1: [False, True], 2: [False, True]}  # auto == False at TP1 and True at TP2: no extra copies
    assert len(layouts) == 4
    assert len(enumerate_layouts(_cfg(tp=[1, 2], sp=["auto"]))) == 2
    assert {lo.sp for lo in enumerate_layouts(_cfg(tp=[2], sp=["auto"]))} == {True}


def test_enumerate_is_the_product_of_the_axes() -> None:
    cfg = _cfg(gbs=64, tp=[1, 2], pp=[1, 2], ep=[1, 2], mbs=[1, 2], precision=["bf16", "fp8"])
    layouts = enumerate_layouts(cfg)
    assert len(layouts) == 2 * 2 * 2 * 2 * 2
    assert {lo.world_size for lo in layouts} == {16}
    assert all(lo.gbs == 64 for lo in layouts)


def test_enumerate_fills_uneven_split() -> None:
    cfg = SweepConfig(name="t", model=preset("deepseek-v2-lite"), cluster=ClusterConfig(nodes=2),
                      space=SpaceConfig(pp=[1, 2, 4]))
    layouts = enumerate_layouts(cfg)
    splits = {lo.pp: (lo.first_stage_layers, lo.last_stage_layers) for lo in layouts if lo.pipeline_layout is None}
    assert splits == {1: (None, None), 2: (14, 13), 4: (7, 6)}
    # Besides sweeper's uneven split, the balanced layout string (the embedding's stage gives up the extra layer).
    assert {lo.pp: lo.pipeline_layout for lo in layouts if lo.pipeline_layout} == {2: "Et*13|t*14L",
                                                                                   4: "Et*6|(t*7|)*2t*7L"}


def test_enumerate_gives_a_layout_string_once_whatever_the_vpp_axis_and_auto_generate() -> None:
    # A layout string sets its own VPP (stages / PP), so each vpp value of the axis gives it again, and auto's
    # balanced string is the one listed: one layout each (the key is every field's value in order, issue 54).
    cfg = SweepConfig(name="t", model=preset("deepseek-v2-lite"), cluster=ClusterConfig(nodes=2),
                      space=SpaceConfig(pp=[2], vpp=[1, 2], pipeline_layout=["Et*13|t*14L", "auto"]))
    layouts = enumerate_layouts(cfg)
    assert len(layouts) == len(set(layouts)) == 3
    assert [(lo.vpp, lo.pipeline_layout, lo.first_stage_layers) for lo in layouts] == [
        (1, "Et*13|t*14L", None), (1, None, 14), (2, None, None)]


def test_enumerate_builds_the_layouts_the_constructor_builds() -> None:
    # enumerate_layouts checks each axis value once and assembles the product's layouts from checked values.
    cfg = _cfg(tp=[1, 2], pp=[1, 2], recompute=["selective:core_attn", "full"], cuda_graph=["te:moe_router+attn"],
               sp=["auto", True])
    layouts = enumerate_layouts(cfg)
    rebuilt = [Layout(**vars(lo)) for lo in layouts]
    assert rebuilt == layouts and [repr(lo) for lo in rebuilt] == [repr(lo) for lo in layouts]
    assert {lo.recompute for lo in layouts} == {"selective", "full"}
    assert {lo.cuda_graph for lo in layouts} == {"te:attn+moe_router"}


def test_only_filter() -> None:
    only = only_filter("tp=2,sp=auto")
    assert matches(Layout(world_size=8, tp=2, sp=True), only)
    assert not matches(Layout(world_size=8, tp=2, sp=False), only)
    assert not matches(Layout(world_size=8, tp=4, sp=True), only)
    assert only_filter(None) == {}


@pytest.mark.parametrize(("graphs", "up_to_016", "from_019"), [
    ("local", ["--cuda-graph-impl=local"], ["--cuda-graph-impl=local"]),
    ("te:attn+moe_router", ["--cuda-graph-impl=transformer_engine", "--cuda-graph-scope", "attn", "moe_router"],
     ["--cuda-graph-impl=transformer_engine", "--cuda-graph-modules", "attn", "moe_router"]),
    ("full_iteration", ["--cuda-graph-impl=local", "--cuda-graph-scope", "full_iteration"],
     ["--cuda-graph-impl=full_iteration"]),
])
def test_cuda_graphs_are_exported_under_the_names_of_the_installed_megatron(graphs, up_to_016, from_019) -> None:
    """megatron-core 0.19 renames cuda_graph_scope to cuda_graph_modules and makes full-iteration graphs an impl of
    their own; the flags, the Bridge overrides and the config fields follow the release they are written for."""
    lo = Layout(world_size=1, gbs=1, cuda_graph=graphs)
    for modules, flags in ((False, up_to_016), (True, from_019)):
        args = lo.megatron_args(graph_modules=modules)
        start = next(i for i, a in enumerate(args) if a.startswith("--cuda-graph-impl"))
        assert args[start:start + len(flags)] == flags
        fields = lo.cuda_graph_fields(modules)
        assert fields == {k: v for k, v in lo.knob_config(modules).items() if k.startswith("cuda_graph")}
        overrides = lo.bridge_overrides(graph_modules=modules)
        assert f"model.cuda_graph_impl={fields['cuda_graph_impl']}" in overrides
        parts = "cuda_graph_modules" if modules else "cuda_graph_scope"
        assert f"model.{parts}=[{','.join(fields[parts])}]" in overrides
