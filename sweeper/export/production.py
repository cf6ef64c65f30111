"""What every export says of the production run's shape: which measured layout it scales up (issue 43)."""

from __future__ import annotations

from sweeper.space.layout import Layout


def measured_note(production: Layout, measured: Layout) -> list[str]:
    """Comment lines saying which measured layout an export scales up, and how to reproduce the measurement."""
    if production == measured:
        return []
    k = production.world_size // measured.world_size
    return [f"# The production run's shape of the measured layout {measured.short()} (trial on {measured.world_size} "
            f"GPUs, global batch {measured.gbs}): {k} copies side by side,",
            f"# data parallel x{k} on {production.world_size} GPUs, global batch {production.gbs}. Reproduce the "
            f"measurement: sweeper trial SPACE.yaml --layout '{measured.to_string()}'"]
