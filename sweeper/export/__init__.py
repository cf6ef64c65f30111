"""The winner in the forms a Megatron user launches: ``launch_megatron_lm.sh`` (megatron_lm.py) and
``megatron_bridge_overrides.yaml`` (bridge.py), written next to best_layout.yaml."""

from __future__ import annotations

import textwrap

from sweeper.config.schema import SweepConfig
from sweeper.export.bridge import OVERRIDES_FILE, overrides_yaml
from sweeper.export.megatron_lm import LAUNCH_FILE, launch_script
from sweeper.record.schema import MODELLED, REHEARSAL_NOTE
from sweeper.space.layout import Layout

EXECUTABLE = {LAUNCH_FILE}
__all__ = ["EXECUTABLE", "LAUNCH_FILE", "OVERRIDES_FILE", "export_files"]


def export_files(cfg: SweepConfig, layout: Layout, trial: int, *, rehearsal: bool = False) -> dict[str, str]:
    """File name -> text of every export of the measured ``layout`` (sweep trial ``trial``), as the production run
    runs it (``SweepConfig.production_layout``: its data parallelism and nodes on the production run's GPUs, the
    production batch); each names the measured layout for reproduction. ``rehearsal``: the layout was modelled,
    not measured, and each file's header opens by saying so (issue 54)."""
    production = cfg.production_layout(layout) or layout
    files = {LAUNCH_FILE: launch_script(cfg, production, trial, measured=layout),
             OVERRIDES_FILE: overrides_yaml(cfg, production, trial, measured=layout)}
    return {name: _rehearsal_header(text) for name, text in files.items()} if rehearsal else files


def _rehearsal_header(text: str) -> str:
    """The export with the rehearsal's lines at the top of its header (under a script's ``#!`` line)."""
    text_lines = textwrap.wrap(f"{MODELLED.upper()}, NOT MEASURED: {REHEARSAL_NOTE}. Run the sweep on the cluster "
                               "(without --rehearse) before a production run launches this layout.", width=116)
    lines = [f"# {line}" for line in text_lines]
    first, newline, rest = text.partition("\n")
    if first.startswith("#!"):
        return first + newline + "\n".join(lines) + "\n" + rest
    return "\n".join(lines) + "\n" + text
