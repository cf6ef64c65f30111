"""A sweep's disk footprint as `plan` prints it (sweeper/estimate/disk.py, issue 43)."""

from __future__ import annotations

from pathlib import Path

from sweeper.config.load import load_config
from sweeper.estimate.disk import checkpoint_bytes, disk_plan
from sweeper.models.params import total_params

ROOT = Path(__file__).resolve().parents[2]


def test_a_trials_checkpoint_is_the_weights_and_the_peak_follows_keep_checkpoints() -> None:
    cfg = load_config(ROOT / "search_spaces" / "nemotron.yaml")
    params = total_params(cfg.model)
    assert checkpoint_bytes(cfg, "bf16") == 2 * params and checkpoint_bytes(cfg, "fp32") == 4 * params
    assert 55 < checkpoint_bytes(cfg, "bf16") / 2**30 < 62  # Nemotron-3-Nano's ~31.6B weights in BF16
    none = disk_plan(cfg, "bf16", smallest_world_size=8)  # 16 GPUs: two 8-GPU trials at once at most
    assert (none.trials_at_once, none.peak_bytes) == (2, 3 * checkpoint_bytes(cfg, "bf16"))
    keep = cfg.model_copy(update={"training": cfg.training.model_copy(update={"keep_checkpoints": "all"})})
    everything = disk_plan(keep, "bf16", smallest_world_size=8)
    assert everything.trials_at_once == cfg.search.max_trials + cfg.search.confirm_top
    assert "keep_checkpoints: all" in everything.line("all")
