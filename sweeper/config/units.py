"""Units every part of sweeper reports memory in: GiB (2**30 bytes), as torch's allocator and nvidia-smi do; and how
an amount that may be tiny or huge (days, GPU-hours, dollars) is written for a reader."""

GIB = float(1 << 30)


def readable(value: float) -> str:
    """Whole numbers with thousands separators from 100 up, three significant digits below (0.0123, 4.56, 78.9)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
