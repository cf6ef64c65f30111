"""Megatron's pipeline-split options (issue 13 item 5): account_for_embedding/loss_in_pipeline_split and
pipeline_model_parallel_layout, in the placement, the plan verdict, the exports and a real CPU trial."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import layout_from_string
from sweeper.plan.assess import build_plan
from sweeper.space.layout import Layout, PipelineSplit
from sweeper.space.pipeline import stage_layers
from tests.space.cpu_trial import assert_trial_passes, write_space

ROOT = Path(__file__).resolve().parents[2]
ACCOUNTED = PipelineSplit(embedding=True, loss=True)


def test_126_layers_on_pp8_vpp8_place_as_megatron_does() -> None:
    """get_num_layers_to_build / get_transformer_layer_offset with both options: 128 slots, 2 per virtual stage,
    the embedding's slot on rank 0's first virtual stage and the loss's on the last rank's last one."""
    chunks = stage_layers(126, 8, 8, split=ACCOUNTED)
    assert [c[0] for c in chunks[:3]] == [(0,), (1, 2), (3, 4)]
    assert chunks[0][1] == (15, 16)
    assert chunks[7][7] == (125,)
    assert sorted(i for rank in chunks for chunk in rank for i in chunk) == list(range(126))
    # The same split written as Megatron's layout string.
    assert stage_layers(126, 8, 8, split=PipelineSplit(layout="Et|(tt|)*62tL")) == chunks


def _space(tmp_path: Path, **space: object) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({
        "name": "llama405", "model": "llama3.1-405b",
        "cluster": {"nodes": 128, "gpus_per_node": 8, "gpu_memory_gib": 80, "compute_capability": "9.0",
                    "address": "local"},
        "training": {"seq_length": 8192, "global_batch_size": 512},
        "space": {"gpus": [1024], "tp": [8], "pp": [8], "vpp": [8], "cp": [2], "precision": ["bf16"], **space},
        "run": {"framework": "megatron-bridge", "grad_reduce_in_fp32": False},
    }))
    return path


def test_plan_follows_megatron_for_126_layers_on_pp8_vpp8(tmp_path: Path) -> None:
    cfg = load_config(_space(tmp_path))
    entries = build_plan(cfg)
    assert len(entries) == 1 and entries[0].valid, entries[0].reasons
    layout = entries[0].layout
    assert (layout.account_for_embedding, layout.account_for_loss) == (True, True)
    args = layout.megatron_args()
    assert "--account-for-embedding-in-pipeline-split" in args and "--account-for-loss-in-pipeline-split" in args
    assert "model.account_for_loss_in_pipeline_split=true" in layout.bridge_overrides()
    # NVIDIA's preset (H100, BF16 grads) runs this layout: the estimator must not prune it.
    assert entries[0].launchable, entries[0].predicted
    # A layout string names the same split; it round-trips through --layout.
    lo = layout_from_string(cfg, "pipeline_layout=Et|(tt|)*62tL")
    assert lo.pipeline_layout == "Et|(tt|)*62tL" and not lo.account_for_embedding
    assert "--pipeline-model-parallel-layout=Et|(tt|)*62tL" in lo.megatron_args()
    assert "--num-virtual-stages-per-pipeline-rank=8" not in lo.megatron_args()
    assert layout_from_string(cfg, lo.to_string()) == lo
    assert Layout.from_dict(lo.to_dict()) == lo


@pytest.mark.e2e
def test_an_accounted_split_trains_on_the_cpu_backend(tmp_path: Path) -> None:
    """14 layers on PP4 x VPP2 have the divisibility of 126 on PP8 x VPP8: they split only with the embedding and
    the loss accounted (16 slots, 2 per virtual stage, 1 on the two ends). A real 4-rank megatron-core trial builds
    it (TransformerConfig's account_for_* options), passes the equivalence gate against the one-rank reference
    and reloads its checkpoint."""
    path = write_space(tmp_path, "accounted-split", 14, 4, {"pp": [4], "vpp": [2]})
    assert_trial_passes(tmp_path, path, "gpus=4,pp=4,vpp=2,mbs=1")
