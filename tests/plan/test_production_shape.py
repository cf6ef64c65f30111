"""Trials at the production run's shape (issue 43): a trial of W GPUs runs its share of the production batch, so every
data-parallel rank runs the production run's micro-batches; a share that does not split evenly is refused."""

from __future__ import annotations

from pathlib import Path

import yaml

from sweeper.config.load import load_config
from sweeper.config.schema import SweepConfig, layout_from_string
from sweeper.plan.assess import assess
from sweeper.plan.space import enumerate_layouts


def _cfg(tmp_path: Path, gbs: int, budget_gpus: int | None = None) -> SweepConfig:
    space = {"name": "shape", "model": "tiny-gpt",
             "cluster": {"nodes": 2, "gpus_per_node": 4, "gpu_memory_gib": 80, "compute_capability": "9.0"},
             "training": {"seq_length": 128, "global_batch_size": gbs},
             "space": {"gpus": [2, 4, 8], "tp": [1], "pp": [1, 2], "mbs": [1, 2, 4]}}
    if budget_gpus:
        space["budget"] = {"tokens": 1e9, "gpus": budget_gpus}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    return load_config(path)


def test_each_trial_runs_its_share_and_the_production_layout_the_whole_batch(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, gbs=64)  # N = the cluster's 8 GPUs
    shares = {lo.world_size: lo.gbs for lo in enumerate_layouts(cfg)}
    assert shares == {2: 16, 4: 32, 8: 64}
    layout = layout_from_string(cfg, "gpus=2,pp=2,mbs=2")
    assert layout.gbs == 16 and layout.num_microbatches == 8
    production = cfg.production_layout(layout)
    assert production is not None and (production.world_size, production.dp, production.gbs) == (8, 4, 64)
    assert production.num_microbatches == layout.num_microbatches  # the same micro-batches per DP rank
    # A production run larger than the cluster: the trial runs its share of it all the same.
    big = _cfg(tmp_path, gbs=1024, budget_gpus=64)
    assert big.trial_global_batch(8) == 128 and big.copies(8) == 8


def test_a_share_that_does_not_split_is_refused_with_the_reason(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, gbs=12, budget_gpus=8)  # 12 sequences over the 4 copies of a 2-GPU layout: 3 each
    odd = layout_from_string(cfg, "gpus=2,mbs=2")
    reasons = assess(cfg, odd).reasons
    assert any("not divisible by micro_batch_size (2) x data_parallel_size (2)" in r for r in reasons), reasons
    cfg = _cfg(tmp_path, gbs=10, budget_gpus=8)  # 10 sequences over 4 copies: no even share
    reasons = assess(cfg, layout_from_string(cfg, "gpus=2,mbs=1")).reasons
    assert any("does not split over the 4 copies of a 2-GPU layout" in r for r in reasons), reasons
    assert cfg.production_batch_reason(8) is None


def test_a_layout_larger_than_the_production_run_is_refused_with_the_reason(tmp_path: Path) -> None:
    """issue 53: a layout of W > N GPUs has no copy in the production run, so nothing of it can be chosen; it was
    launched anyway, and first in exhaustive order."""
    cfg = _cfg(tmp_path, gbs=64, budget_gpus=4)  # a 4-GPU production run on the 8-GPU cluster
    refused = assess(cfg, layout_from_string(cfg, "gpus=8,pp=2,mbs=1"))
    assert refused.reasons[0] == ("the layout needs 8 GPUs, more than the production run's 4 (budget.gpus): no copy "
                                  "of it runs in production")
    assert not assess(cfg, layout_from_string(cfg, "gpus=4,pp=2,mbs=1")).reasons



def test_judging_a_space_at_once_gives_each_layouts_own_verdict(tmp_path: Path) -> None:
    """``judge`` (the plan's rules pass, the production batch's verdict once per world size) against ``assess`` layout
    by layout: 2-GPU trials whose share of a batch of 6 does not split over 4 copies, 8-GPU ones that a 4-GPU
    production run cannot hold; the batch's reason first, the rules' after it."""
    from sweeper.plan.assess import judge
    from sweeper.plan.rules import Checker

    for gbs, budget, why in ((6, None, "does not split"), (64, 4, "budget.gpus")):
        cfg = _cfg(tmp_path, gbs=gbs, budget_gpus=budget)
        layouts = enumerate_layouts(cfg)
        judged = judge(cfg, layouts, Checker(cfg.model, cfg.cluster, cfg.training.seq_length, cfg.run))
        assert [(e.layout, e.reasons, e.predicted) for e in judged] == [
            (lo, assess(cfg, lo, predict=False).reasons, None) for lo in layouts]
        assert any(why in e.reasons[0] for e in judged if e.reasons)
        if budget:
            assert any(e.valid for e in judged)
        else:  # and a rule's reason after the batch's
            assert any(len(e.reasons) > 1 and why in e.reasons[0] for e in judged)
