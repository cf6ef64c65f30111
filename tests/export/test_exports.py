"""The winner's exports: launch_megatron_lm.sh against Megatron-LM's own flag list, and the Bridge override file
against the dataclasses Megatron-Bridge merges it onto.

``tests/data/megatron_lm_flags.txt`` is every flag of Megatron-LM core_v0.16.1's ``arguments.py``, and
``megatron_lm_flags_0.17.txt`` / ``_0.18.txt`` / ``_0.19.txt`` megatron-core 0.17.1's, 0.18.2's and 0.19.2's (whose
wheels ship ``megatron/training``): the script is checked against the installed release's (``scripts/megatron_lm_flags.py``
wrote them). The script is run for real, with ``torchrun`` replaced by a stand-in
on PATH that prints its arguments (stand-in: no GPU here, and Megatron-LM is not installed): that is what bash
hands to Megatron-LM after expanding the arrays, defaults and quoting.

``tests/data/megatron_bridge_fields.json`` is, per Megatron-Bridge release sweeper supports (0.3.1, 0.4.2, 0.5.1,
0.6.2), the fields of the dataclasses the override file lands on, its mixed-precision recipe names and the pretraining
recipes it exports, each entry naming the files it was read from (``scripts/megatron_bridge_fields.py`` wrote it from
the released wheels' source: Bridge needs Transformer Engine and a GPU, so it is not installed). The override file is
written for each release in turn and checked against that release's sets; the model, DDP and optimizer sections
against the installed megatron-core's dataclasses (0.16.1 pairs with Bridge 0.3.1, 0.19.x with 0.6.x).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from packaging.version import Version

from sweeper.config import bridge_release, megatron_release
from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.export import EXECUTABLE, export_files
from sweeper.export.bridge import (
    MIXED_PRECISION_CLASS,
    OVERRIDES_FILE,
    RECIPES,
    dotted_overrides,
    mixed_precision_recipes,
)
from sweeper.export.megatron_lm import LAUNCH_FILE, launch_script
from sweeper.space.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
# The installed megatron-core release's Megatron-LM flags: the export writes that release's names (issue 45).
FLAGS_FILES = {"0.16": "megatron_lm_flags.txt", "0.17": "megatron_lm_flags_0.17.txt",
               "0.18": "megatron_lm_flags_0.18.txt", "0.19": "megatron_lm_flags_0.19.txt"}
FLAGS_FILE = FLAGS_FILES["{0.major}.{0.minor}".format(megatron_release.installed())]
FLAGS = set((ROOT / "tests" / "data" / FLAGS_FILE).read_text().split())
CASES = [
    ("nemotron.yaml", "gpus=8,tp=2,ep=4,sp=true"),
    ("nemotron.yaml", "gpus=16,pp=2,ep=8,recompute=selective"),
    ("deepseek_v2_lite.yaml", "gpus=8,tp=2,pp=2,ep=2,sp=true,precision=fp8"),
    ("deepseek_v2_lite.yaml", "gpus=8,ep=8,recompute=full"),
    ("quickstart.yaml", "gpus=4,tp=2,pp=2,ep=2,sp=true"),
    # issue 18's knobs: the dispatcher replaces the model block's alltoall, graphs, overlap, offload, NVFP4
    ("deepseek_v2_lite.yaml", "gpus=16,ep=16,moe_token_dispatcher=flex:deepep,moe_a2a_overlap=true,"
                              "cuda_graph=te:attn+moe_router+moe_preprocess"),
    ("nemotron.yaml", "gpus=8,ep=8,moe_token_dispatcher=allgather,cuda_graph=local"),
    ("deepseek_v2_lite.yaml", "gpus=16,tp=2,sp=true,ep=8,moe_a2a_overlap=true"),
    ("quickstart.yaml", "gpus=2,ep=2,offload_layers=1,precision=nvfp4"),
    ("nemotron.yaml", "gpus=16,tp=2,sp=true,ep=8,fsdp=optim_grads_params"),
    # issue 52: FP8 recipes as precision values (Nemotron-3-Nano's FP8 layout; DeepSeek's blockwise)
    ("nemotron.yaml", "gpus=16,ep=16,precision=fp8:tensorwise,recompute=selective:layernorm"),
    ("deepseek_v2_lite.yaml", "gpus=8,tp=2,sp=true,ep=4,precision=fp8:blockwise"),
]
# Per Bridge release: the dataclasses' fields, recipe names and pretraining recipes (module docstring).
BRIDGE = json.loads((ROOT / "tests" / "data" / "megatron_bridge_fields.json").read_text())
BRIDGE_RELEASES = sorted(BRIDGE, key=Version)


def _case(space: str, text: str) -> tuple[SweepConfig, Layout]:
    cfg = load_config(ROOT / "search_spaces" / space)
    return cfg, layout_from_string(cfg, text)


def _run_script(tmp_path: Path, script: str, **env: str) -> list[str]:
    """Run the script with a stand-in torchrun that writes its argv, one per line; return the argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    out = tmp_path / "argv.txt"
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {shlex.quote(str(out))}\n')
    torchrun.chmod(0o755)
    path = tmp_path / LAUNCH_FILE
    path.write_text(script)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "MEGATRON_LM": "/opt/mlm", **env}
    subprocess.run(["bash", str(path)], check=True, env=full_env, cwd=tmp_path, timeout=60)
    return out.read_text().splitlines()


def _flags(argv: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in argv:
        if item.startswith("--"):
            key, _, value = item.partition("=")
            out[key] = value
    return out


@pytest.mark.parametrize(("space", "text"), CASES)
def test_the_launch_script_hands_megatron_lm_only_its_own_flags_with_the_layout_and_model(
        tmp_path: Path, space: str, text: str) -> None:
    cfg, measured = _case(space, text)
    script = export_files(cfg, measured, 3)[LAUNCH_FILE]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    # The export launches the production run (issue 43): the measured layout's copies on its GPUs, its batch.
    layout = cfg.production_layout(measured) or measured
    assert layout.gbs == cfg.training.global_batch_size or cfg.copies(measured.world_size) == 0
    if layout != measured:
        assert f"--layout '{measured.to_string()}'" in script  # how to reproduce the measurement
    nodes = max(1, layout.world_size // cfg.cluster.gpus_per_node)
    argv = _run_script(tmp_path, script, NNODES=str(nodes))
    entry = "pretrain_mamba.py" if cfg.model.is_hybrid else "pretrain_gpt.py"
    assert f"/opt/mlm/{entry}" in argv
    flags = _flags(argv)
    torchrun = {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"}
    unknown = set(flags) - FLAGS - torchrun
    assert not unknown, unknown
    assert flags["--nproc-per-node"] == str(min(layout.world_size, cfg.cluster.gpus_per_node))
    spec = cfg.model
    assert flags["--num-layers"] == str(spec.num_layers) and flags["--hidden-size"] == str(spec.hidden_size)
    assert flags["--num-attention-heads"] == str(spec.num_attention_heads)
    assert flags["--seq-length"] == str(cfg.training.seq_length)
    assert flags.get("--num-experts") == (str(spec.num_moe_experts) if spec.is_moe else None)
    assert ("--multi-latent-attention" in flags) == spec.multi_latent_attention
    assert flags.get(megatron_release.hybrid_pattern_flag()) == spec.hybrid_layer_pattern
    for item in layout.megatron_args(megatron_release.graph_modules()):  # the layout's flags, exactly as best_layout.yaml gives them
        assert item in argv
    one_connection = "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script
    hopper = int(cfg.cluster.compute_capability.partition(".")[0]) < 10
    assert one_connection == ((layout.tp > 1 or layout.cp > 1) and hopper and not layout.moe_a2a_overlap
                              and not layout.fsdp)  # Megatron-FSDP asserts it is not 1
    dispatchers = [a for a in argv if a.startswith("--moe-token-dispatcher-type=")]
    assert dispatchers == ([f"--moe-token-dispatcher-type={layout.dispatcher}"] if spec.is_moe else [])
    assert flags["--tensor-model-parallel-size"] == str(layout.tp)
    assert "--mock-data" in flags and flags["--vocab-size"] == str(spec.vocab_size)  # the default data


def test_the_launch_script_takes_the_users_data_and_refuses_the_wrong_node_count(tmp_path: Path) -> None:
    cfg, layout = _case("deepseek_v2_lite.yaml", "gpus=16,ep=16")
    script = export_files(cfg, layout, 1)[LAUNCH_FILE]
    argv = _run_script(tmp_path, script, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1",
                       DATA_ARGS="--data-path /data/tok_text_document --tokenizer-type HuggingFaceTokenizer")
    flags = _flags(argv)
    assert argv[argv.index("--data-path") + 1] == "/data/tok_text_document" and "--mock-data" not in flags
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1" and flags["--master-addr"] == "10.0.0.1"
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") is None or True  # the script sets its own (below)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" not in script  # TP 1, CP 1: Megatron-LM does not ask for it
    wrong = subprocess.run(["bash", str(tmp_path / LAUNCH_FILE)], env={**os.environ, "MEGATRON_LM": "/x",
                                                                        "NNODES": "1"},
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "this layout needs 2 node(s), NNODES is 1" in wrong.stderr


def test_tp_before_blackwell_sets_one_device_connection() -> None:
    cfg, layout = _case("deepseek_v2_lite.yaml", "gpus=8,tp=2,ep=4")
    assert cfg.cluster.compute_capability.startswith("9")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in export_files(cfg, layout, 1)[LAUNCH_FILE]


@pytest.mark.parametrize(("recipe", "name"), [("delayed", "bf16_with_fp8_delayed_scaling_mixed"),
                                              ("tensorwise", "bf16_with_fp8_current_scaling_mixed"),
                                              ("blockwise", "bf16_with_fp8_subchannel_scaling_mixed")])
def test_a_bare_fp8_is_exported_to_bridge_as_the_recipe_the_run_gives_it(recipe: str, name: str) -> None:
    """Issue 52: precision fp8 under run.fp8_recipe writes what fp8:<recipe> writes (that recipe's Bridge name)."""
    cfg, _ = _case("quickstart.yaml", "gpus=2")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"fp8_recipe": recipe})})
    bare, named = (layout_from_string(cfg, f"gpus=2,precision={p}") for p in ("fp8", f"fp8:{recipe}"))
    assert dotted_overrides(cfg, bare) == dotted_overrides(cfg, named)
    assert f"mixed_precision={name}" in dotted_overrides(cfg, bare)


def test_hybrid_exports_write_the_pattern_flag_of_the_release() -> None:
    """Issue 52: 0.19 deprecates --hybrid-override-pattern for --hybrid-layer-pattern; each release's flag list
    (tests/data) has the flag written for it."""
    for release, flags_file in FLAGS_FILES.items():
        flag = megatron_release.hybrid_pattern_flag(Version(release))
        assert flag in (ROOT / "tests" / "data" / flags_file).read_text().split()
        assert (flag == "--hybrid-layer-pattern") == (Version(release) >= Version("0.19"))


@pytest.mark.parametrize("release", BRIDGE_RELEASES)
@pytest.mark.parametrize(("space", "text"), CASES)
def test_the_bridge_overrides_are_fields_of_what_bridge_merges_them_onto(
        monkeypatch: pytest.MonkeyPatch, space: str, text: str, release: str) -> None:
    pytest.importorskip("torch")  # megatron-core imports it
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    monkeypatch.setattr(bridge_release, "target", lambda: Version(release))
    bridge = {name: set(values) for name, values in BRIDGE[release].items()}
    cfg, measured = _case(space, text)
    text_yaml = export_files(cfg, measured, 2)[OVERRIDES_FILE]
    layout = cfg.production_layout(measured) or measured  # the production run's shape (issue 43)
    tree = OmegaConf.to_container(OmegaConf.create(text_yaml))
    assert isinstance(tree, dict) and set(tree) <= bridge["ConfigContainer"], set(tree) - bridge["ConfigContainer"]
    fields = {
        "model": {f.name for f in dataclasses.fields(MLATransformerConfig)} | {"seq_length"},
        "ddp": {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
        "optimizer": {f.name for f in dataclasses.fields(OptimizerConfig)},
        "train": bridge["TrainingConfig"],
        "dataset": {"seq_length"},
        "checkpoint": bridge["CheckpointConfig"],
        "comm_overlap": bridge["CommOverlapConfig"],
    }
    assert set(tree) <= set(fields) | {"mixed_precision"}, set(tree) - set(fields)
    for section, names in fields.items():
        assert set(tree.get(section, {})) <= names, set(tree[section]) - names
    assert set(tree["train"]) == {"micro_batch_size", "global_batch_size"}
    model = tree["model"]
    assert model["tensor_model_parallel_size"] == layout.tp and model["expert_model_parallel_size"] == layout.ep
    assert model["sequence_parallel"] is layout.sp and model["seq_length"] == cfg.training.seq_length
    assert tree["train"] == {"micro_batch_size": layout.mbs, "global_batch_size": cfg.training.global_batch_size}
    precision = tree["mixed_precision"]
    if isinstance(precision, dict):  # the whole config, as Bridge instantiates it
        assert precision["_target_"] == MIXED_PRECISION_CLASS
        assert set(precision) - {"_target_"} <= bridge["MixedPrecisionConfig"]
        if layout.precision != "nvfp4":  # NVFP4 keeps its recipe's grad dtype (RunSettings.bridge_overrides)
            assert precision["grad_reduce_in_fp32"] == cfg.run.grads_in_fp32 == tree["ddp"]["grad_reduce_in_fp32"]
        assert precision["params_dtype"] == {"_target_": "torch.bfloat16", "_call_": False}
    else:
        assert precision is None or precision in bridge["mixed_precision_recipes"]
    assert set(mixed_precision_recipes(Version(release))) <= bridge["mixed_precision_recipes"]
    fp8_recipe = precision.get("fp8_recipe") if isinstance(precision, dict) else None  # NVFP4's node: None
    assert (fp8_recipe is not None) == layout.is_fp8
    if layout.precision.startswith("fp8:"):  # a named recipe is exported as itself (issue 52)
        assert fp8_recipe == layout.precision.partition(":")[2]
    # NVFP4 keeps BF16 weights, as the trial runs and the estimate counts them; from Bridge 0.4 its recipe would
    # store them in FP4 (fp4_param_gather), a field 0.3.1 does not have.
    if layout.precision == "nvfp4":
        node = precision if isinstance(precision, dict) else mixed_precision_recipes(Version(release))[precision]
        assert node.get("fp4_param_gather", False) is False
        assert ("fp4_param_gather" in node) == ("fp4_param_gather" in bridge["MixedPrecisionConfig"])
    lines = text_yaml.splitlines()
    recipe = {"nemotron.yaml": "nemotron_3_nano_pretrain_config", "deepseek_v2_lite.yaml":
              "deepseek_v2_lite_pretrain_config"}.get(space)
    assert (recipe in lines[1]) if recipe else "No Megatron-Bridge recipe" in lines[1]
    written = f"# Written for Megatron-Bridge {release}"
    assert lines[2] == f"{written}." or lines[2].startswith(f"{written} (")  # "(installed)", "(paired with ...)"
    refused = "refuses cuda_graph_impl=local" in text_yaml
    assert refused == (layout.cuda_graph == "local" and Version(release) >= Version("0.6"))


@pytest.mark.parametrize("release", BRIDGE_RELEASES)
def test_every_recipe_sweeper_names_ships_in_each_bridge_release(release: str) -> None:
    assert set(RECIPES.values()) <= set(BRIDGE[release]["pretrain_recipes"])
    assert set(mixed_precision_recipes(Version(release))) <= set(BRIDGE[release]["mixed_precision_recipes"])


def test_a_run_setting_equal_to_the_recipe_keeps_the_recipe_name(tmp_path: Path) -> None:
    space = yaml.safe_load((ROOT / "search_spaces" / "quickstart.yaml").read_text())
    space["run"] = {**space.get("run", {}), "grad_reduce_in_fp32": True}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    cfg = load_config(path)
    layout = layout_from_string(cfg, "gpus=2,pp=2,precision=bf16")
    tree = yaml.safe_load(export_files(cfg, layout, 1)[OVERRIDES_FILE])
    assert tree["mixed_precision"] == "bf16_mixed"


def test_only_the_launch_script_is_executable() -> None:
    assert EXECUTABLE == {LAUNCH_FILE}


def test_a_launch_of_12_gpus_on_8_gpu_nodes_runs_on_2_nodes_of_6_and_names_the_release() -> None:
    """issue 51: the node count was world // min(world, gpus_per_node): 12 GPUs on 8-GPU nodes gave 1 node."""
    from sweeper.config.megatron_release import installed
    from sweeper.export.megatron_lm import node_shape

    assert node_shape(12, 8) == (2, 6) and node_shape(16, 8) == (2, 8) and node_shape(4, 8) == (1, 4)
    assert node_shape(9, 8) == (3, 3) and node_shape(1024, 8) == (128, 8)
    cfg = load_config(ROOT / "search_spaces" / "quickstart.yaml")
    script = launch_script(cfg, Layout(world_size=4, gbs=cfg.training.global_batch_size), 1)
    assert f"matching megatron-core {installed()}" in script
