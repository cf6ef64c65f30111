"""Ask the GPU nodes, not the driver, which kernel packages they have (sweeper.config.kernels): one small task pinned
to each alive GPU node, at the start of a sweep on a real cluster and in ``doctor``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sweeper.cluster.connection import ClusterHandle
from sweeper.config.kernels import Kernels

KERNELS_TIMEOUT_S = 120.0


def gpu_node_kernels(handle: ClusterHandle, timeout_s: float = KERNELS_TIMEOUT_S) -> dict[str, Kernels]:
    """node label -> the kernels that node has, for every alive GPU node (a node whose task fails is left out)."""
    nodes = handle.nodes()
    refs = [_kernels_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n.node_id, soft=False))
            .remote() for n in nodes]
    out: dict[str, Kernels] = {}
    for node, ref in zip(nodes, refs):
        try:
            out[node.label] = ray.get(ref, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a node that cannot answer is doctor's finding; the sweep skips it
            continue
    return out


@ray.remote(num_cpus=0, max_retries=0)
def _kernels_here() -> Kernels:
    return Kernels.here()


# What "it imports" means per package: Transformer Engine's PyTorch extension is the part built against torch.
IMPORT_NAMES = {"transformer_engine": "transformer_engine.pytorch", "mamba_ssm": "mamba_ssm",
                "causal_conv1d": "causal_conv1d", "deep_ep": "deep_ep"}


def import_failure(package: str, timeout_s: float = 300.0) -> str | None:
    """Import ``package`` in a new interpreter on this node: None when it imports, else the error's last line (an
    extension built against another torch fails here with an undefined symbol, not at the package finder). The
    child sees the node's GPUs (Ray hides them from a task without GPUs) and exits before any trial starts."""
    try:
        done = subprocess.run([sys.executable, "-c", f"import {IMPORT_NAMES[package]}"], env=_node_env(),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"import {IMPORT_NAMES[package]} did not finish in {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"import {IMPORT_NAMES[package]} exited with code {done.returncode}"


def torch_cuda(timeout_s: float = 300.0) -> tuple[str | None, int | None, str | None]:
    """What torch sees on this node, asked of a new interpreter (this worker stays light) that sees the node's GPUs:
    (the CUDA version torch was built for, None for a CPU build; how many CUDA devices it sees; an error line when
    it could not tell)."""
    code = "import json, torch; print(json.dumps([torch.version.cuda, torch.cuda.device_count()]))"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=_node_env(), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, None, f"import torch did not finish in {timeout_s:.0f} s"
    try:
        build, devices = json.loads(done.stdout.strip().splitlines()[-1])
        return build, int(devices), None
    except (ValueError, IndexError, TypeError):
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return None, None, lines[-1].strip() if lines else f"torch's probe exited with code {done.returncode}"


def _node_env() -> dict[str, str]:
    """This worker's environment with the node's GPUs visible: Ray hides them from a task that reserves none."""
    env = dict(os.environ)
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]
    return env
