"""Megatron-LM accepts what sweeper exports (issue 52): the launch script's argv of a broad sample of valid layouts,
through Megatron-LM's own ``parse_args`` and ``validate_args`` and its config builders
(``core_transformer_config_from_args``, training.py's ``get_megatron_optimizer_config`` and
``get_megatron_ddp_config``); and what sweeper refuses of the run settings, Megatron-LM refuses in the same words.

``megatron/training`` ships in the megatron-core 0.19 wheel, which installs on Python 3.12 only (CI's 3.12 end runs
tests/export); on 0.16.1 (Python 3.11) it is absent and the test is skipped. The sample: every shipped search space,
its valid layouts (rules and run settings, as ``sweeper plan`` keeps them) drawn with a fixed seed, each under
several run settings (the three frameworks' defaults, BF16 grads, the precision-aware optimizer with BF16 moments,
CPU offload, FP8 weights on and off, each FP8 recipe of a bare fp8, the overlaps), each space searching every
precision value (each fp8:<recipe> among them), the knobs where its space searches them (moe_knobs.yaml). The script runs for real with test_exports' stand-in ``torchrun``; its environment
(``sweeper.space.environment``, which the script exports) is set as the script sets it.

Stubs, each because a CPU-only process cannot answer it, none about the arguments:
- ``megatron.core.utils.get_te_version`` (Transformer Engine, a GPU library, is not installed): TE_VERSION, new
  enough for every feature sweeper exports, as on the nodes sweeper's GPU trials run on (every
  ``is_te_min_version`` asks it);
- ``torch.cuda.get_device_properties`` / ``get_device_capability`` / ``is_available``: a device of the cluster's
  compute capability (a CPU has none), for the checks validate_args makes per device (e.g. the overlaps before
  Blackwell);
- ``rope_utils.fused_apply_rotary_pos_emb``: TE's fused RoPE kernel, which TransformerConfig asks for under
  apply_rope_fusion (the frameworks' fusion defaults, ``sweeper.config.fusions``), a stand-in that is never called;
- ``transformer_engine.pytorch.optimizers.FusedAdam``: the class OptimizerConfig inspects for the precision-aware
  optimizer's arguments (TE's; a stand-in with that signature, never built).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

pytest.importorskip("megatron.training.arguments")  # megatron-core >= 0.19's wheel (module docstring)
torch = pytest.importorskip("torch")

from megatron.core import utils as mcore_utils  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.training import arguments as mlm  # noqa: E402
from megatron.training import training as mlm_training  # noqa: E402
from packaging.version import Version  # noqa: E402

from sweeper.config.load import SHIPPED_SPACES, load_config  # noqa: E402
from sweeper.config.run_settings import RunSettings  # noqa: E402
from sweeper.config.schema import SweepConfig  # noqa: E402
from sweeper.export.megatron_lm import launch_script  # noqa: E402
from sweeper.plan.rules import Checker  # noqa: E402
from sweeper.plan.space import enumerate_layouts  # noqa: E402
from sweeper.space.axes import PRECISIONS  # noqa: E402
from sweeper.space.environment import megatron_environment  # noqa: E402
from sweeper.space.layout import Layout  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_exports import _run_script  # noqa: E402

# Run settings each sampled layout is exported under (their refusals are the rules'/the YAML's, issue 52).
RUNS: tuple[RunSettings, ...] = (
    RunSettings(),
    RunSettings(framework="megatron-bridge", grad_reduce_in_fp32=False),
    RunSettings(framework="megatron-core", fp8_recipe="tensorwise"),
    RunSettings(precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
                overlap_grad_reduce=True, overlap_param_gather=True, fp8_recipe="blockwise"),
    RunSettings(precision_aware_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                fp8_param_gather=True, fp8_recipe="delayed"),
    RunSettings(framework="megatron-bridge", precision_aware_optimizer=True, optimizer_cpu_offload=True),
)
PER_SPACE = 6  # layouts drawn per space and run setting
TE_VERSION = Version("2.13")  # sweeper's GPU path asks for TE >= 2.10 (pyproject's gpu extra); 0.19's containers 2.13
SEED = 52


def _sample() -> list[tuple[str, SweepConfig, Layout]]:
    rng = random.Random(SEED)
    out = []
    spaces = [(path.stem, load_config(path)) for path in sorted(SHIPPED_SPACES.glob("*.yaml"))]
    # MXFP8 and NVFP4 need compute capability 10.x, which no shipped space's cluster has: one on B200 nodes.
    v2 = load_config(SHIPPED_SPACES / "deepseek_v2_lite.yaml")
    spaces.append(("deepseek_v2_lite_b200", v2.model_copy(update={"cluster": v2.cluster.model_copy(
        update={"compute_capability": "10.0", "gpu_kind": "b200"})})))
    for stem, base in spaces:
        # Every precision value (each FP8 recipe among them): the rules keep those the cluster runs.
        space = base.space.model_copy(update={"precision": list(PRECISIONS)})
        for i, run in enumerate(RUNS):
            cfg = base.model_copy(update={"run": run, "space": space})
            checker = Checker(cfg.model, cfg.cluster, cfg.training.seq_length, run)
            valid = [lo for lo in enumerate_layouts(cfg) if not checker(lo)]
            for layout in rng.sample(valid, min(PER_SPACE, len(valid))):
                out.append((f"{stem}-run{i}-{layout.to_string()}", cfg, layout))
    return out


SAMPLE = _sample()


class _FusedAdamStandIn:
    """TE's FusedAdam as OptimizerConfig inspects it (its keyword arguments), never built."""

    def __init__(self, params: object, master_weight_dtype: object = None, exp_avg_dtype: object = None,
                 exp_avg_sq_dtype: object = None, use_decoupled_grad: bool = False) -> None:
        raise AssertionError("the FusedAdam stand-in is never built: the arguments are only validated")


_TE_OPTIMIZERS = SimpleNamespace(FusedAdam=_FusedAdamStandIn)


def _fused_rope_stand_in(*args: object, **kwargs: object) -> None:
    raise AssertionError("the fused RoPE stand-in is never called: the arguments are only validated")


def _megatron_lm(monkeypatch: pytest.MonkeyPatch, cfg: SweepConfig, layout: Layout, args_in: list[str]) -> object:
    """Megatron-LM's view of the arguments: parse_args, validate_args and the three config builders, under the
    stubs of the module docstring and the environment the script exports; returns the TransformerConfig."""
    cc = cfg.cluster.compute_capability
    major, minor = (int(p) for p in cc.split("."))
    environment = megatron_environment(layout, cc)
    for variable in environment:
        monkeypatch.setenv(variable.name, str(variable.value))
    if not any(v.name == "CUDA_DEVICE_MAX_CONNECTIONS" for v in environment):
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(layout.world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain.py", *args_in])
    device = SimpleNamespace(major=major, minor=minor, name=cfg.cluster.gpu_kind or "gpu")
    te_modules = {"transformer_engine": SimpleNamespace(pytorch=SimpleNamespace(optimizers=_TE_OPTIMIZERS)),
                  "transformer_engine.pytorch": SimpleNamespace(optimizers=_TE_OPTIMIZERS),
                  "transformer_engine.pytorch.optimizers": _TE_OPTIMIZERS}
    with mock.patch.object(mcore_utils, "get_te_version", return_value=TE_VERSION), \
            mock.patch.object(torch.cuda, "get_device_properties", return_value=device), \
            mock.patch.object(torch.cuda, "get_device_capability", return_value=(major, minor)), \
            mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(rope_utils, "fused_apply_rotary_pos_emb", _fused_rope_stand_in):
        args = mlm.parse_args()
        mlm.validate_args(args, {})
        config = mlm.core_transformer_config_from_args(args)
        with mock.patch.dict(sys.modules, te_modules):
            mlm_training.get_megatron_optimizer_config(args)
        mlm_training.get_megatron_ddp_config(args)
    return config


def _megatron_lm_args(tmp_path: Path, cfg: SweepConfig, layout: Layout) -> list[str]:
    """The flags the script hands pretrain_gpt.py / pretrain_mamba.py (after torchrun's own and the entry)."""
    argv = _run_script(tmp_path, launch_script(cfg, layout, 1),
                       NNODES=str(max(1, layout.world_size // cfg.cluster.gpus_per_node)))
    entry = next(i for i, item in enumerate(argv) if item.endswith((".py",)))
    return argv[entry + 1:]


@pytest.mark.parametrize(("name", "cfg", "layout"), SAMPLE, ids=[s[0] for s in SAMPLE])
def test_megatron_lm_accepts_the_exported_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                    cfg: SweepConfig, layout: Layout) -> None:
    config = _megatron_lm(monkeypatch, cfg, layout, _megatron_lm_args(tmp_path, cfg, layout))
    assert config.tensor_model_parallel_size == layout.tp  # type: ignore[attr-defined]
    assert config.expert_model_parallel_size == layout.ep  # type: ignore[attr-defined]
    assert config.num_layers == cfg.model.num_layers  # type: ignore[attr-defined]
    if layout.is_fp8:
        assert config.fp8_recipe == cfg.run.recipe(layout.precision, cfg.cluster.compute_capability)  # type: ignore
    assert os.environ["WORLD_SIZE"] == str(layout.world_size)


# What sweeper refuses (a rule, or the run settings' own check), exported anyway, and Megatron-LM's words for it.
REFUSED = [
    ("gpus=4,distributed_optimizer=false", dict(precision_aware_optimizer=True),
     "--use-precision-aware-optimizer only supported with distributed optimizer"),
    ("gpus=4", dict(optimizer_cpu_offload=True),
     "The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`"),
    ("gpus=4,precision=fp8:tensorwise", dict(precision_aware_optimizer=True, optimizer_cpu_offload=True,
                                             fp8_param_gather=True),
     "When `--fp8-param-gather` is enabled, the optimizer cpu offload must be used in conjunction with "
     "`--fp8-recipe delayed`"),
]


@pytest.mark.parametrize(("text", "run", "words"), REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_what_sweeper_refuses_megatron_lm_refuses_in_the_same_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, run: dict[str, object], words: str) -> None:
    from sweeper.config.schema import layout_from_string
    from sweeper.plan.rules import check

    base = load_config(SHIPPED_SPACES / "quickstart.yaml")
    settings = RunSettings.model_construct(**run)  # past its own check: the export of what the YAML would refuse
    cfg = base.model_copy(update={"run": settings})
    layout = layout_from_string(cfg, text)
    try:
        RunSettings(**run)
        ours = check(cfg.model, layout, cfg.cluster, cfg.training.seq_length, settings)
    except ValueError as exc:
        ours = [str(exc)]
    assert any(words in reason for reason in ours), ours
    with pytest.raises((AssertionError, ValueError), match=words.replace("`", ".").replace("-", ".")[:60]):
        _megatron_lm(monkeypatch, cfg, layout, _megatron_lm_args(tmp_path, cfg, layout))
