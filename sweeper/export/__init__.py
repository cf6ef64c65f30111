"""The winner in the forms a Megatron user launches: ``launch_megatron_lm.sh`` (megatron_lm.py) and
``megatron_bridge_overrides.yaml`` (bridge.py), written next to best_layout.yaml."""

from __future__ import annotations

from sweeper.config.schema import SweepConfig
from sweeper.export.bridge import OVERRIDES_FILE, overrides_yaml
from sweeper.export.megatron_lm import LAUNCH_FILE, launch_script
from sweeper.space.layout import Layout

EXECUTABLE = {LAUNCH_FILE}
__all__ = ["EXECUTABLE", "LAUNCH_FILE", "OVERRIDES_FILE", "export_files"]


def export_files(cfg: SweepConfig, layout: Layout, trial: int) -> dict[str, str]:
    """File name -> text of every export of the measured ``layout`` (sweep trial ``trial``), as the production run
    runs it (``SweepConfig.production_layout``: its data parallelism and nodes on the production run's GPUs, the
    production batch); each names the measured layout for reproduction."""
    production = cfg.production_layout(layout) or layout
    return {LAUNCH_FILE: launch_script(cfg, production, trial, measured=layout),
            OVERRIDES_FILE: overrides_yaml(cfg, production, trial, measured=layout)}
