"""Which Ray cluster a command uses, decided before anything starts, and whether an address answers, in bounded time.

``resolve_target(cluster_cfg, address_override)`` turns the configuration into a :class:`Target`:

- ``simulate: true``: a simulated cluster on this machine;
- ``address: local``: a new single-node Ray instance on this machine;
- ``HOST:PORT`` / ``ray://HOST:PORT`` (``cluster.address`` or ``--address``): that cluster, which must answer
  within ``cluster.connect_timeout_s``, else :class:`ClusterError` with one line;
- ``address: auto``: the Ray cluster already running, found as ``ray.init(address="auto")`` finds it, from
  ``RAY_ADDRESS`` and then from the address file ``ray start`` writes; only when none of them answers does the
  command fall back to a simulated cluster (``simulate: auto`` and no GPU visible) or a new local instance. Ray's
  other fallback, any Ray process found in this machine's process table, is left out on purpose: on a shared login
  node that is someone else's cluster. A cluster whose nodes carry sweeper's simulated-node label is another
  sweep's simulated cluster and is never joined.

Probing does not go through ``ray.init``: for an address that does not answer it retries for minutes (about 40 s
per attempt, 20 attempts in Ray 2.60). :func:`probe` opens a TCP connection with a timeout and then asks the Ray
GCS for its node table over gRPC with a deadline, so a refused port fails at once and a silent one after the
timeout, each with one line that says which.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from sweeper.cluster.simulated import NODE_LABEL_KEY, ray_start_address_file
from sweeper.config.address import check_address, split_address
from sweeper.config.schema import ClusterConfig, check_address_override
from sweeper.errors import ClusterError

Mode = Literal["simulated", "local", "auto", "remote"]  # what the configuration asks for
Kind = Literal["simulated", "local", "existing", "remote"]  # what a command gets


@dataclass(frozen=True)
class Probe:
    """What an address answered: ``problem`` is None when a Ray GCS replied."""

    address: str
    problem: str | None
    sweeper_simulated: bool = False  # its nodes carry NODE_LABEL_KEY: another sweep's simulated cluster


@dataclass(frozen=True)
class Target:
    """The cluster a command will use and, in ``why``, one line saying which and why that one."""

    kind: Kind
    address: str | None  # for ray.init; None for a simulated cluster (its address exists once it is started)
    why: str


def choose_mode(cluster_cfg: ClusterConfig, address_override: str | None = None) -> Mode:
    """What the configuration asks for, before anything is probed. Raises UsageError on a malformed ``--address``
    or one given to a ``simulate: true`` cluster (the YAML's own contradictions are refused when it is loaded)."""
    check_address_override(cluster_cfg, address_override)
    address = address_override or cluster_cfg.address
    if cluster_cfg.simulate is True:
        return "simulated"
    if address == "local":
        return "local"
    return "auto" if address == "auto" else "remote"


def resolve_target(cluster_cfg: ClusterConfig, address_override: str | None = None) -> Target:
    """Decide which cluster to use (see the module docstring); probes addresses, starts nothing."""
    mode = choose_mode(cluster_cfg, address_override)
    timeout_s = cluster_cfg.connect_timeout_s
    source = "--address" if address_override is not None else "cluster.address"
    if mode == "simulated":
        return Target("simulated", None, f"{_simulated(cluster_cfg)} (cluster.simulate: true)")
    if mode == "local":
        return Target("local", "local", f"a new single-node Ray instance on this machine ({source}: local)")
    if mode == "remote":
        address = address_override or cluster_cfg.address
        found = probe(address, timeout_s)
        if found.problem is not None:
            raise ClusterError(f"{source}: no Ray cluster answers at {address}: {found.problem} "
                               f"(cluster.connect_timeout_s: {timeout_s:g})")
        return Target("remote", address, f"the Ray cluster at {address} ({source})")
    tried: list[str] = []
    for where, address in _running_cluster_addresses(tried):
        found = probe(address, timeout_s)
        if found.problem is None and not found.sweeper_simulated:
            return Target("existing", address, f"the running Ray cluster at {address} (from {where})")
        tried.append(f"{where} {address}: {found.problem or 'a simulated cluster of another sweep'}")
    none_answered = f"no running Ray cluster answered: {'; '.join(tried)}"
    if cluster_cfg.simulate == "auto" and not cuda_visible():
        return Target("simulated", None, f"{_simulated(cluster_cfg)} (no GPU visible here and {none_answered})")
    return Target("local", "local", f"a new single-node Ray instance on this machine ({none_answered})")


def probe(address: str, timeout_s: float) -> Probe:
    """Whether a Ray cluster answers at ``address`` (HOST:PORT or ray://HOST:PORT) within about ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        host, port = split_address(address)
    except ValueError:
        return Probe(address, "not an address of the form HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except ConnectionRefusedError:
        return Probe(address, "connection refused")
    except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
        return Probe(address, f"no answer within {timeout_s:g} s")
    except socket.gaierror:
        return Probe(address, f"unknown host {host!r}")
    except OSError as exc:
        return Probe(address, exc.strerror or str(exc))
    if address.startswith("ray://") or os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        # A Ray Client server speaks its own protocol, and a TLS cluster needs its certificates: the TCP answer is
        # what can be checked here, and ray.init reports anything else as one line.
        return Probe(address, None)
    return _ask_gcs(address, host, port, max(deadline - time.monotonic(), 0.5))


def _ask_gcs(address: str, host: str, port: int, timeout_s: float) -> Probe:
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            reply = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout_s)  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return Probe(address, f"the port is open but no Ray GCS replied within {timeout_s:.3g} s")
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return Probe(address, "the server there is not a Ray GCS (a Ray Client server is reached with "
                                      "ray://HOST:PORT)")
            if code == grpc.StatusCode.UNAVAILABLE:
                return Probe(address, f"the server there is not a Ray GCS ({_one_line(exc.details())})")
            return Probe(address, None)  # e.g. UNAUTHENTICATED: a GCS replied, it wants a token ray.init has
    simulated = any(NODE_LABEL_KEY in node.labels for node in reply.node_info_list)
    return Probe(address, None, sweeper_simulated=simulated)


def _running_cluster_addresses(tried: list[str]) -> Iterator[tuple[str, str]]:
    """Where ``ray.init(address="auto")`` looks: RAY_ADDRESS, then the address ``ray start`` last wrote."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if not env or env in ("auto", "local"):
        tried.append("RAY_ADDRESS unset" if not env else f"RAY_ADDRESS={env}")
    else:
        try:
            check_address(env)
            yield "RAY_ADDRESS", env
        except ValueError:  # e.g. the dashboard URL `ray job submit` uses: not a cluster address
            tried.append(f"RAY_ADDRESS={env!r} is not HOST:PORT or ray://HOST:PORT")
    path = ray_start_address_file()
    try:
        recorded = path.read_text().strip()
    except OSError:
        tried.append(f"no {path} (ray start writes it)")
        return
    try:
        check_address(recorded)
    except ValueError:
        tried.append(f"{path} holds no address")
        return
    yield str(path), recorded


def _simulated(cluster_cfg: ClusterConfig) -> str:
    return f"simulated, {cluster_cfg.nodes} nodes x {cluster_cfg.gpus_per_node} GPUs on this machine"


def _one_line(text: str | None) -> str:
    return " ".join((text or "unavailable").split())[:200]


def cuda_visible() -> bool:
    """Whether this machine has a CUDA device, without initialising CUDA in the driver (nvidia-smi first)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            return out.returncode == 0 and "GPU" in out.stdout
        except (OSError, subprocess.SubprocessError):
            return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
