"""What a GPU trial builds is what the export asks for (issue 30): for every knob and run setting, the
TransformerConfig, DDP config, optimizer config and rank environment the smoke run builds on a GPU against what
Megatron-LM makes of launch_megatron_lm.sh.

The script runs for real with a stand-in ``torchrun`` (test_exports._run_script) and its argv is read the way
Megatron-LM core_v0.16.1 reads it: a TransformerConfig field takes the flag megatron-core names in its
``argparse_meta`` (``--fp8-format`` for ``fp8``, ``--disable-bias-linear`` storing False) or its own name, DDP and
optimizer fields take the flags of their own names (training.py get_model / get_megatron_optimizer_config), and the
few translations core_transformer_config_from_args and validate_args make are written out below (RENAMED,
_megatron_lm_defaults). The trial's configs are built by sweeper's own builders with the device mocked (compute
capability 9.0); Megatron's config classes are real and validate both sides.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from sweeper.backends.megatron import build, device, gpu
from sweeper.config.load import load_config
from sweeper.config.run_settings import RunSettings
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.export.bridge import MIXED_PRECISION_RECIPES, dotted_overrides, overrides
from sweeper.export.megatron_lm import launch_script
from sweeper.space.environment import megatron_environment
from sweeper.space.layout import Layout
from sweeper.trial.actor import RankSlot
from sweeper.trial.runner import _rank_envs

sys.path.insert(0, str(Path(__file__).parent))
from test_exports import _run_script

ROOT = Path(__file__).resolve().parents[2]
HOPPER = (9, 0)

# (search space, layout, run settings): every knob value and run setting at least once.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("quickstart.yaml", "gpus=4,tp=2,pp=2,sp=true", {}),
    ("quickstart.yaml", "gpus=4,tp=2,pp=2,sp=true", {"framework": "megatron-bridge"}),
    ("quickstart.yaml", "gpus=4,pp=2,vpp=2,distributed_optimizer=true", {"framework": "megatron-bridge"}),
    ("quickstart.yaml", "gpus=4,cp=2,recompute=full", {"overlap_grad_reduce": True}),
    ("quickstart.yaml", "gpus=4,distributed_optimizer=true,recompute=selective", {"framework": "megatron-core"}),
    ("quickstart.yaml", "gpus=4,tp=2,precision=fp8,distributed_optimizer=true", {"framework": "megatron-bridge"}),
    ("quickstart.yaml", "gpus=4,precision=fp8,distributed_optimizer=false", {"framework": "megatron-bridge"}),
    ("quickstart.yaml", "gpus=4,precision=fp8", {"fp8_recipe": "blockwise", "fp8_param_gather": False}),
    ("quickstart.yaml", "gpus=4,precision=fp8,distributed_optimizer=true",
     {"fp8_recipe": "tensorwise", "fp8_param_gather": True, "grad_reduce_in_fp32": False}),
    ("quickstart.yaml", "gpus=2,precision=fp16", {}),
    ("quickstart.yaml", "gpus=2,precision=fp32", {}),
    ("quickstart.yaml", "gpus=4,distributed_optimizer=true",
     {"precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}),
    ("quickstart.yaml", "gpus=4,distributed_optimizer=true",
     {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "precision_aware_optimizer": True}),
    ("quickstart.yaml", "gpus=2,ep=2,offload_layers=1", {}),
    ("quickstart.yaml", "gpus=4,tp=2,sp=true,ep=2,moe_token_dispatcher=allgather,cuda_graph=local", {}),
    ("quickstart.yaml", "gpus=4,ep=4,precision=bf16,moe_a2a_overlap=true,cuda_graph=te:attn+moe_router", {}),
    ("quickstart.yaml", "gpus=4,ep=4,cuda_graph=full_iteration", {}),
    ("quickstart.yaml", "gpus=4,ep=2,fsdp=optim_grads_params", {"framework": "megatron-bridge"}),
    ("deepseek_v2_lite.yaml", "gpus=8,tp=2,sp=true,ep=4", {}),
    ("nemotron.yaml", "gpus=8,tp=2,sp=true,ep=4", {}),
    # issue 52: recipes as precision values (each names its own recipe whatever run.fp8_recipe says)
    ("quickstart.yaml", "gpus=4,ep=2,precision=fp8:tensorwise,recompute=selective:moe_act+layernorm", {}),
    ("quickstart.yaml", "gpus=4,precision=fp8:blockwise", {"framework": "megatron-bridge"}),
    ("quickstart.yaml", "gpus=4,precision=fp8:delayed", {"fp8_recipe": "tensorwise"}),
]
IDS = [f"{space.split('.')[0]}:{text}:{'-'.join(f'{k}={v}' for k, v in run.items()) or 'lm'}"
       for space, text, run in CASES]

# Megatron-LM flags that set a TransformerConfig field of another name (core_transformer_config_from_args).
RENAMED = {
    "--num-experts": "num_moe_experts",
    "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
    "--fp8-param-gather": "fp8_param",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--swiglu": "gated_linear_unit",
    # The fusions' store_false flags (arguments.py; persist_layer_norm and bias_activation_fusion through
    # core_transformer_config_from_args: not --no-persist-layer-norm, bias_swiglu_fusion under --swiglu).
    "--no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
    "--no-bias-swiglu-fusion": "bias_activation_fusion",
    "--no-bias-gelu-fusion": "bias_activation_fusion",
    "--no-masked-softmax-fusion": "masked_softmax_fusion",
    "--no-bias-dropout-fusion": "bias_dropout_fusion",
    "--no-rope-fusion": "apply_rope_fusion",
    "--no-persist-layer-norm": "persist_layer_norm",
}
# TransformerConfig fields only inference reads, which a trial leaves at their defaults: Megatron-LM 0.16's and 0.17's
# validate_args assert moe_pad_experts_for_cuda_graph_inference for local graphs with EP > 1, so the launch script
# sets it there (a TransformerConfig field from 0.17; text_generation_controller.py reads it).
INFERENCE_ONLY = {"moe_pad_experts_for_cuda_graph_inference"}
FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
           "apply_rope_fusion", "persist_layer_norm", "cross_entropy_loss_fusion")
# TransformerConfig fields a knob, the layout or a run setting decides: compared whether or not a flag names them
# (an absent flag is Megatron-LM's default).
DECIDED = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "bf16", "fp16", "fp8", "fp8_recipe", "fp8_param", "fp4", "fp4_recipe", "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_router_dtype",
    "overlap_moe_expert_parallel_comm", "cuda_graph_impl", "cuda_graph_scope", "use_te_rng_tracker",
    "cpu_offloading", "cpu_offloading_num_layers", "batch_p2p_comm", "overlap_p2p_comm", *FUSIONS,
)
DDP_DECIDED = ("overlap_grad_reduce", "overlap_param_gather", "align_param_gather", "use_distributed_optimizer",
               "fp8_param_gather", "use_megatron_fsdp", "data_parallel_sharding_strategy",
               "reuse_grad_buf_for_mxfp8_param_ag")
OPTIMIZER_DECIDED = ("use_distributed_optimizer", "clip_grad", "adam_beta1", "adam_beta2",
                     "use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype", "optimizer_cpu_offload",
                     "optimizer_offload_fraction", "fp8_recipe", "overlap_param_gather",
                     "reuse_grad_buf_for_mxfp8_param_ag")


def _case(space: str, text: str, run: dict[str, Any]) -> tuple[SweepConfig, Layout]:
    cfg = load_config(ROOT / "search_spaces" / space)
    cluster = cfg.cluster.model_copy(update={"compute_capability": "9.0"})  # the mocked device's
    cfg = cfg.model_copy(update={"run": RunSettings(**run), "cluster": cluster})
    return cfg, layout_from_string(cfg, text)


def _argv(tmp_path: Path, cfg: SweepConfig, layout: Layout) -> dict[str, Any]:
    """Megatron-LM's view of the script's arguments: flag -> True (no value), its value, or its values (nargs)."""
    argv = _run_script(tmp_path, launch_script(cfg, layout, 1))
    out: dict[str, Any] = {}
    key = None
    for item in argv:
        if item.startswith("--"):
            key, eq, value = item.partition("=")
            out[key] = value if eq else True
        elif key is not None:  # nargs values after a bare flag
            out[key] = [item] if out[key] is True else [*out[key], item]
    return out


def _flag_of(field: dataclasses.Field) -> list[str]:
    meta = field.metadata.get("argparse_meta", {})
    return list(meta.get("arg_names", [f"--{field.name.replace('_', '-')}"]))


def _value(flag: str, raw: Any, field: dataclasses.Field, like: Any) -> Any:
    """A flag's value as the field holds it (store_true / store_false for booleans, argparse's type otherwise)."""
    if raw is True:  # store_false for --disable-* / --no-* (--disable-bias-linear: add_bias_linear False)
        return not (flag.startswith("--disable-") or flag.startswith("--no-"))
    if field.name == "moe_layer_freq":  # Megatron-LM's moe_freq_type evaluates a Python list expression
        return eval(raw)  # the launch script's own expression, e.g. ([0]*1+[1]*26)
    if isinstance(raw, list):
        return raw
    if isinstance(like, bool):
        return raw.lower() == "true"
    for kind in (int, float):
        if isinstance(like, kind):
            return kind(raw)
    return raw


def _exported_transformer_fields(flags: dict[str, Any], trial: Any) -> dict[str, Any]:
    """TransformerConfig fields Megatron-LM sets from ``flags`` (the ones the trial also has)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(type(trial)):
        names = _flag_of(field) + [flag for flag, name in RENAMED.items() if name == field.name]
        for name in names:
            if name in flags:
                out[field.name] = _value(name, flags[name], field, getattr(trial, field.name))
    return out


def _megatron_lm_defaults(flags: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """What validate_args and core_transformer_config_from_args set for DECIDED fields no flag names."""
    out: dict[str, Any] = {}
    impl = flags.get("--cuda-graph-impl", "none")
    if impl != "none":
        out["use_te_rng_tracker"] = True  # validate_args: "enabling it for CUDA graphs"
    if int(flags.get("--cpu-offloading-num-layers", 0)) > 0:
        out["cpu_offloading"] = True  # validate_args
    # batch_p2p_comm = not overlap_p2p_comm; overlap_p2p_comm (on by default) is turned off without VPP.
    out["overlap_p2p_comm"] = layout.vpp > 1
    out["batch_p2p_comm"] = layout.vpp <= 1
    # The fusions' store_false flags default on; validate_args turns bias-gelu fusion off without linear biases
    # (bias-swiglu stays) and rope fusion off for position embeddings other than rope.
    out.update(gradient_accumulation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
               persist_layer_norm=True,
               bias_activation_fusion="--swiglu" in flags or "--disable-bias-linear" not in flags,
               apply_rope_fusion=flags.get("--position-embedding-type", "learned_absolute") == "rope")
    return out


def _gpu_trial_config(cfg: SweepConfig, layout: Layout) -> Any:
    """The TransformerConfig the GPU trial builds on the mocked Hopper (every fusion kernel present)."""
    plan = gpu.gpu_plan(cfg.model, layout, HOPPER, causal_conv1d=False, framework=cfg.run.framework,
                        fp8_recipe=None if cfg.run.fp8_recipe == "auto" else cfg.run.fp8_recipe)
    with mock.patch.object(gpu, "device_plan", lambda s, lo, r: plan):
        return build.transformer_config(cfg.model, layout, cuda=True, te=True, run=cfg.run)


@pytest.fixture
def hopper():
    """A Hopper GPU with Transformer Engine 2.12: megatron-core asks TE's version for FP8 MoE and the
    precision-aware optimizer, and that optimizer's config checks TE's FusedAdam signature (a stand-in here,
    never constructed)."""
    import types

    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from packaging.version import Version

    class FusedAdam:  # stand-in for TE's (OptimizerConfig reads its signature for the precision-aware optimizer)
        def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None, exp_avg_sq_dtype=None,
                     use_decoupled_grad=False):
            raise AssertionError("a stand-in: never built here")

    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    optimizers.FusedAdam = FusedAdam
    with mock.patch.object(device, "compute_capability", lambda: HOPPER), \
            mock.patch.object(utils, "get_te_version", lambda: Version("2.12.0")), \
            mock.patch.dict(sys.modules, {"transformer_engine.pytorch.optimizers": optimizers}), \
            mock.patch.object(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None):
        # TE's fused RoPE, which TransformerConfig asks rope_utils for under apply_rope_fusion (a stand-in)
        yield


@pytest.mark.parametrize(("space", "text", "run"), CASES, ids=IDS)
def test_the_gpu_trials_configs_are_the_exports(tmp_path: Path, hopper: None, space: str, text: str,
                                                run: dict[str, Any]) -> None:
    cfg, layout = _case(space, text, run)
    flags = _argv(tmp_path, cfg, layout)
    trial = _gpu_trial_config(cfg, layout)

    # Megatron-LM's config: the trial's own architecture, with every field the flags set and every DECIDED field
    # at the flags' value or Megatron-LM's default, validated again by TransformerConfig.__post_init__.
    exported = _exported_transformer_fields(flags, trial)
    defaults = {f.name: f.metadata.get("argparse_meta", {}).get("default", f.default)
                for f in dataclasses.fields(type(trial)) if f.name in DECIDED}
    megatron_lm_kwargs = {f.name: getattr(trial, f.name) for f in dataclasses.fields(type(trial)) if f.init}
    megatron_lm_kwargs.update({k: v for k, v in defaults.items() if v is not dataclasses.MISSING})
    megatron_lm_kwargs.update(_megatron_lm_defaults(flags, layout))
    megatron_lm_kwargs.update(exported)
    reference = type(trial)(**megatron_lm_kwargs)
    for name in sorted((set(DECIDED) | set(exported)) - INFERENCE_ONLY):
        assert getattr(trial, name) == getattr(reference, name), (
            f"TransformerConfig.{name}: trial {getattr(trial, name)!r}, launch script {getattr(reference, name)!r}")

    # DDP config: fields of their own names; grad_reduce_in_fp32 is --accumulate-allreduce-grads-in-fp32, on
    # under --bf16 unless --grad-reduce-in-bf16 (validate_args), FP32 runs reduce FP32 grads anyway.
    ddp = build.ddp_config(layout, cfg.run, cuda=True, te=True)
    for name in DDP_DECIDED:
        flag = f"--{name.replace('_', '-')}"
        want = flags.get(flag, getattr(DistributedDataParallelConfig, name))
        if name == "align_param_gather":  # on by default (--no-align-param-gather), off without VPP
            want = layout.vpp > 1 and flags.get("--overlap-param-gather", False) is True
        if name == "use_megatron_fsdp":
            want = "--use-megatron-fsdp" in flags
        assert getattr(ddp, name) == (want if isinstance(want, str) else bool(want)), f"DDP {name}"
    bf16_grads_fp32 = "--bf16" in flags and "--grad-reduce-in-bf16" not in flags
    assert ddp.grad_reduce_in_fp32 == (bf16_grads_fp32 or layout.precision == "fp32"), "DDP grad_reduce_in_fp32"

    # Optimizer config: fields of their own names (get_megatron_optimizer_config); dtypes as torch dtypes.
    optimizer = build.optimizer_config(layout, cfg.run, te=True)
    for name in OPTIMIZER_DECIDED:
        flag = f"--{name.replace('_', '-')}"
        got = getattr(optimizer, name)
        if flag not in flags:
            assert got == getattr(OptimizerConfig, name), f"optimizer {name}: {got!r} without {flag}"
            continue
        raw = flags[flag]
        if name.endswith("_dtype"):
            assert str(got) == f"torch.{ {'bf16': 'bfloat16', 'fp16': 'float16', 'fp32': 'float32'}[raw]}", name
        elif raw is True:
            assert got is True, f"optimizer {name}"
        else:
            assert got == type(got)(raw), f"optimizer {name}: {got!r} vs {flag}={raw}"


@pytest.mark.parametrize(("space", "text", "run"), CASES, ids=IDS)
def test_the_gpu_trials_config_is_the_bridge_export(hopper: None, space: str, text: str, run: dict[str, Any]) -> None:
    """Every ``model.<field>`` the Bridge export sets is the trial's value (Bridge's provider is a TransformerConfig
    and takes them as they are); the fusions are all set, gradient accumulation fusion left to Bridge's probe for
    apex's kernel only where the trial ran it (the kernel present, as here)."""
    cfg, layout = _case(space, text, run)
    trial = _gpu_trial_config(cfg, layout)
    exported = {key.removeprefix("model."): yaml.safe_load(value)
                for key, value in (item.split("=", 1) for item in dotted_overrides(cfg, layout))
                if key.startswith("model.")}
    for name, value in exported.items():
        got = getattr(trial, name)
        if name in ("cuda_graph_scope", "cuda_graph_modules"):  # __post_init__ makes them CudaGraphScope/Module
            got = [scope.name for scope in got]
        assert got == value, f"model.{name}: trial {got!r}, Bridge export {value!r}"
    assert set(FUSIONS) - set(exported) <= {"gradient_accumulation_fusion"}
    if layout.cuda_graph != "none":  # Bridge's provide() asserts TE's RNG tracker under graphs
        assert exported["cuda_graph_impl"] == trial.cuda_graph_impl and exported["use_te_rng_tracker"] is True
    if "gradient_accumulation_fusion" not in exported:
        assert trial.gradient_accumulation_fusion is True
    # Delayed scaling's amax history: MixedPrecisionConfig's fields (a recipe name's, or the node's), which Bridge
    # copies onto the model config (MixedPrecisionConfig.setup); its own defaults are 1 / most_recent.
    if trial.fp8_recipe == "delayed" and trial.fp8:
        precision = overrides(cfg, layout)["mixed_precision"]
        fields = MIXED_PRECISION_RECIPES[precision] if isinstance(precision, str) else precision
        assert (fields.get("fp8_amax_history_len", 1), fields.get("fp8_amax_compute_algo", "most_recent")) == (
            trial.fp8_amax_history_len, trial.fp8_amax_compute_algo)


@pytest.mark.parametrize(("space", "text", "run"), CASES, ids=IDS)
def test_a_gpu_trials_ranks_get_the_exported_environment(space: str, text: str, run: dict[str, Any]) -> None:
    cfg, layout = _case(space, text, run)
    script = launch_script(cfg, layout, 1)
    exported = dict(line.split("  #")[0][len("export "):].split("=", 1)
                    for line in script.splitlines() if line.startswith("export "))
    slots = [RankSlot(r, "n0", "10.0.0.1", (str(r),), 100 + r, 29500 if r == 0 else None) for r in range(2)]
    env = _rank_envs(slots, {"n0": "node-0"}, "t1", megatron_environment(layout, cfg.cluster.compute_capability),
                     gpu=True)
    rendezvous = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                  "SWEEPER_NODE_ID", "SWEEPER_TRIAL_ID", "CUDA_VISIBLE_DEVICES"}
    for rank_env in env:
        assert {k: v for k, v in rank_env.items() if k not in rendezvous} == exported
    # A simulated cluster's ranks (Ray's virtual GPU ids): none of the layout's CUDA variables, every GPU hidden.
    cpu = _rank_envs(slots, {"n0": "node-0"}, "t1", megatron_environment(layout, "9.0"), gpu=False)
    assert all(set(e) <= rendezvous | {"GLOO_SOCKET_IFNAME", "PYTORCH_NVML_BASED_CUDA_CHECK"} for e in cpu)
    assert {e["CUDA_VISIBLE_DEVICES"] for e in cpu} == {""}


def test_local_graphs_below_blackwell_ask_for_nccl_graph_register_off() -> None:
    """megatron-core's CudaGraphManager asserts NCCL_GRAPH_REGISTER=0 beside expandable segments below compute
    capability 10 (transformer/cuda_graphs.py); the trial set it for TE graphs only, so every local-graph layout on
    an H100/H200 was filed invalid_layout (issue 44, item 2)."""
    _, layout = _case("quickstart.yaml", "gpus=2,ep=2,cuda_graph=local", {})
    hopper = {v.name: v.value for v in megatron_environment(layout, "9.0")}
    blackwell = {v.name: v.value for v in megatron_environment(layout, "10.0")}
    assert hopper["NCCL_GRAPH_REGISTER"] == "0" and hopper["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "NCCL_GRAPH_REGISTER" not in blackwell


def test_te_graphs_ask_for_nccl_graph_register_off_and_blackwell_for_no_connection_limit() -> None:
    cfg, layout = _case("quickstart.yaml", "gpus=4,tp=2,ep=2,cuda_graph=te:attn", {})
    names = {v.name: v.value for v in megatron_environment(layout, "9.0")}
    assert names["NCCL_GRAPH_REGISTER"] == "0" and names["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in {v.name for v in megatron_environment(layout, "10.0")}


def test_the_interleaved_schedule_overlaps_p2p_on_a_gpu_only() -> None:
    """Megatron-LM overlaps the interleaved schedule's p2p (batch_p2p_comm off, issue 44 item 14c); the CPU trial
    keeps it off: gloo sends from memory the schedule frees before the send is waited on (layout_config.py)."""
    from sweeper.backends.megatron.layout_config import layout_config_kwargs

    cfg, interleaved = _case("quickstart.yaml", "gpus=4,pp=2,vpp=2", {})
    _, plain = _case("quickstart.yaml", "gpus=4,pp=2", {})
    gpu_kwargs = layout_config_kwargs(cfg.model, interleaved, cuda=True)
    cpu_kwargs = layout_config_kwargs(cfg.model, interleaved, cuda=False)
    assert (gpu_kwargs["overlap_p2p_comm"], gpu_kwargs["batch_p2p_comm"]) == (True, False)
    assert (cpu_kwargs["overlap_p2p_comm"], cpu_kwargs["batch_p2p_comm"]) == (False, False)
    for cuda in (True, False):
        kwargs = layout_config_kwargs(cfg.model, plain, cuda=cuda)
        assert (kwargs["overlap_p2p_comm"], kwargs["batch_p2p_comm"]) == (False, True)
