"""Pre-flight estimates of per-GPU memory and step time for a Layout (plain Python, no torch)."""
