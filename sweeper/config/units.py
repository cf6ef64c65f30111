"""Units every part of sweeper reports memory in: GiB (2**30 bytes), as torch's allocator and nvidia-smi do."""

GIB = float(1 << 30)
