"""A proxy trial's run layout (trial/proxy_run.py): every model-parallel group kept, fewer replicas and
micro-batches, and still a layout the rules accept; the proxy reference's batch splits over every one of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweeper.config.load import load_config, proxy_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.plan.rules import check
from sweeper.plan.space import enumerate_layouts
from sweeper.space.pipeline import with_pipeline_split
from sweeper.trial.proxy_run import proxy_run_layout, proxy_run_note
from sweeper.trial.reference import reference_sequences

ROOT = Path(__file__).resolve().parents[2]
KEPT = ("tp", "pp", "cp", "ep", "etp", "vpp", "sp", "mbs", "precision", "recompute", "distributed_optimizer",
        "first_stage_layers", "last_stage_layers", "fsdp", "cuda_graph", "moe_token_dispatcher")


def _proxy(name: str) -> SweepConfig:
    return proxy_config(load_config(ROOT / "search_spaces" / name))


@pytest.mark.parametrize("space", ["nemotron.yaml", "deepseek_v2_lite.yaml"])
def test_every_valid_layout_of_a_flagship_proxy_runs_with_all_its_groups(space: str) -> None:
    cfg = _proxy(space)
    shrunk = 0
    sequences = reference_sequences(cfg)
    for layout in enumerate_layouts(cfg):
        layout = with_pipeline_split(layout, cfg.model)
        if check(cfg.model, layout, cfg.cluster, cfg.training.seq_length):
            continue
        run = proxy_run_layout(layout)
        assert {k: getattr(run, k) for k in KEPT} == {k: getattr(layout, k) for k in KEPT}, layout.short()
        assert layout.dp % run.dp == 0 and run.dp >= min(layout.dp, 2), layout.short()
        assert run.edp >= min(layout.edp, 2), layout.short()
        assert min(layout.num_microbatches, 2, layout.pp) <= run.num_microbatches <= layout.num_microbatches
        assert run.num_microbatches >= min(layout.num_microbatches, max(2, layout.pp)), layout.short()
        assert not check(cfg.model, run, cfg.cluster, cfg.training.seq_length), (layout.short(), run.short())
        assert sequences % run.dp == 0, layout.short()
        shrunk += run != layout
    assert shrunk, "no layout of the space runs smaller as a proxy"


def test_a_proxy_trial_drops_replicas_only_where_the_expert_layout_allows() -> None:
    cfg = _proxy("deepseek_v2_lite.yaml")
    # DP 4, EDP 4: two replicas keep EDP 2 -> 8 ranks; 8 micro-batches per rank become max(2, PP) = 2.
    run = proxy_run_layout(layout_from_string(cfg, "tp=2,pp=2,ep=2,gpus=16,sp=true"))
    assert (run.world_size, run.dp, run.edp, run.num_microbatches) == (8, 2, 2, 2)
    # EP 8 over DP 16 (EDP 2): fewer replicas would fold the expert-data-parallel group away -> all 16 ranks.
    wide = layout_from_string(cfg, "ep=8,gpus=16")
    assert (proxy_run_layout(wide).world_size, proxy_run_layout(wide).num_microbatches) == (16, 2)
    # A pipeline keeps PP micro-batches per rank (every phase of its schedule).
    deep = proxy_run_layout(layout_from_string(cfg, "pp=4,ep=4,gpus=16"))
    assert (deep.world_size, deep.num_microbatches) == (16, 4)
    note = proxy_run_note(layout_from_string(cfg, "tp=2,pp=2,ep=2,gpus=16,sp=true"))
    assert note is not None and note.startswith("proxy run: 8 ranks (DP 2, EDP 2) of the layout's 16 (DP 4, EDP 4)")
    one = layout_from_string(cfg, "ep=8,gpus=16,mbs=2")  # 16 replicas of one micro-batch: nothing to drop
    assert proxy_run_layout(one) == one and proxy_run_note(one) is None


def test_a_proxy_reference_batch_is_the_replicas_the_proxy_trials_run() -> None:
    nemotron, deepseek = _proxy("nemotron.yaml"), _proxy("deepseek_v2_lite.yaml")
    # Nemotron's widest expert layout, EP 8 at TP 1 over DP 16 (EDP 2), keeps 16 replicas; so does DeepSeek's EP 16.
    assert reference_sequences(nemotron) == 16 and reference_sequences(deepseek) == 16
    small = nemotron.model_copy(update={"space": nemotron.space.model_copy(update={"ep": [1, 2]})})
    assert reference_sequences(small) == 4  # EP 2 over TP 1: two replicas, or four to keep EDP 2
    real = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    assert reference_sequences(real) == 16  # a real model's trials run every replica: the world sizes' lcm


def test_a_reference_without_prefixes_is_made_again(tmp_path: Path) -> None:
    """A reference made before references recorded their batch's prefixes (format 1) cannot serve a trial's prefix
    gate: a resumed sweep makes it again instead of failing every trial."""
    import json

    from sweeper.trial.reference import REFERENCE_FILE, _reusable

    cfg = _proxy("deepseek_v2_lite.yaml")
    ref = {"model": cfg.model.model_dump(), "seq_length": cfg.training.seq_length,
           "sequences": reference_sequences(cfg)}
    (tmp_path / REFERENCE_FILE).write_text(json.dumps(ref))
    assert not _reusable(cfg, tmp_path)
    (tmp_path / REFERENCE_FILE).write_text(json.dumps({**ref, "prefixes": {"4": [1.0, 2.0]}}))
    assert _reusable(cfg, tmp_path)
