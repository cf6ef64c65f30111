"""Peak dense tensor-core throughput per GPU kind (vendor datasheets, dense = without 2:4 sparsity).

Only the ratio between layouts matters for ranking, but absolute step times feed the sweep's time budget, so
the numbers are the datasheet's dense figures; ``EstimatorConstants.achievable_mfu`` scales them to what
Megatron reaches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    kind: str
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores (FP8 runs would fall back to BF16 GEMMs)
    fp4_tflops: float | None = None  # dense NVFP4; None: no FP4 tensor cores
    memory_tbs: float = 3.35  # HBM / GDDR bandwidth, TB/s (what the memory-bound optimizer step runs at)


DEVICES: dict[str, Device] = {
    d.kind: d
    for d in (
        Device("a100", 312.0, None, memory_tbs=2.04),  # A100 SXM 80GB
        Device("l40s", 362.0, 733.0, memory_tbs=0.864),
        Device("h100", 989.0, 1979.0, memory_tbs=3.35),  # H100 SXM
        Device("h200", 989.0, 1979.0, memory_tbs=4.8),  # same compute as H100 SXM, more/faster HBM
        Device("b200", 2250.0, 4500.0, 9000.0, memory_tbs=8.0),
        Device("gb200", 2500.0, 5000.0, 10000.0, memory_tbs=8.0),  # per GPU of a GB200 superchip
        # RTX PRO 6000 Blackwell (workstation/server edition, cc 12.0): ~4 PFLOPS FP4 with sparsity on the
        # datasheet -> ~1 PFLOPS dense FP8 and half that for BF16 with FP32 accumulation.
        Device("rtx-pro-6000", 500.0, 1000.0, 2000.0, memory_tbs=1.79),
    )
}

# When the cluster section names no gpu_kind, the compute capability picks the most common part of that family.
_BY_CAPABILITY: dict[str, str] = {
    "8.0": "a100",
    "8.9": "l40s",
    "9.0": "h100",
    "10.0": "b200",
    "12.0": "rtx-pro-6000",
}
_FALLBACK = "h100"


def device_for(gpu_kind: str | None, compute_capability: str) -> Device:
    """The Device for a cluster section; unknown kinds fall back by compute capability, then to H100."""
    if gpu_kind:
        key = gpu_kind.lower().replace("_", "-").replace(" ", "-")
        if key in DEVICES:
            return DEVICES[key]
        for kind, device in DEVICES.items():  # tolerate "h100-sxm", "nvidia-b200" and the like
            if kind in key:
                return device
    return DEVICES[_BY_CAPABILITY.get(compute_capability, _FALLBACK)]
