"""The environment a layout's Megatron run needs: written once, set on every GPU trial's ranks (trial/runner.py)
and exported in launch_megatron_lm.sh, so a trial measures the environment the export asks for.

Each variable is Megatron-LM's requirement or its launch scripts' practice (megatron/training/arguments.py,
core_v0.16.1):
- ``CUDA_DEVICE_MAX_CONNECTIONS=1``: validate_args asserts it with TP or CP > 1 before Blackwell (compute
  capability < 10), so that the communication kernels are queued before the compute they overlap; with the
  expert A2A overlap it only warns (that overlap wants more connections), and Megatron-FSDP asserts the opposite
  ("FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset"): left unset there.
- ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: fewer fragmented reserved bytes, as Megatron's examples run.
- ``NCCL_GRAPH_REGISTER=0`` with Transformer Engine's CUDA graphs, and with megatron-core's local ones below compute
  capability 10: both assert it beside expandable segments ("illegal memory access when using CUDA Graph with
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True").
- ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``: NCCL buffers freed when the collective ends, not when the stream syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

from sweeper.space.layout import Layout


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    why: str


def needs_one_device_connection(layout: Layout, compute_capability: str) -> bool:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (see the module docstring)."""
    return ((layout.tp > 1 or layout.cp > 1) and int(compute_capability.partition(".")[0]) < 10
            and not layout.moe_a2a_overlap and not layout.fsdp)


def needs_nccl_graph_register_off(layout: Layout, compute_capability: str) -> bool:
    """NCCL_GRAPH_REGISTER=0 (see the module docstring): megatron-core 0.16.1 asserts it beside expandable segments
    for Transformer Engine's graphs (``TECudaGraphHelper.__init__``) and, below compute capability 10, for its own
    local graphs (``CudaGraphManager.__init__``), which filed every local-graph layout as invalid there (issue 44)."""
    if layout.cuda_graph == "none":
        return False
    return layout.cuda_graph_impl == "transformer_engine" or int(compute_capability.partition(".")[0]) < 10


def megatron_environment(layout: Layout, compute_capability: str) -> list[EnvVar]:
    """The variables a GPU run of ``layout`` sets, on GPUs of ``compute_capability`` ("9.0")."""
    out: list[EnvVar] = []
    if needs_one_device_connection(layout, compute_capability):
        out.append(EnvVar("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                          "Megatron-LM asserts it with TP or CP > 1 before Blackwell"))
    out.append(EnvVar("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True",
                      "less fragmentation in the reserved memory"))
    if needs_nccl_graph_register_off(layout, compute_capability):
        out.append(EnvVar("NCCL_GRAPH_REGISTER", "0",
                          "megatron-core asserts it for CUDA graphs beside expandable segments"))
    out.append(EnvVar("TORCH_NCCL_AVOID_RECORD_STREAMS", "1", "NCCL buffers freed when their collective ends"))
    return out
