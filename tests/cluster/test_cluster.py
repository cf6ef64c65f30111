"""sweeper.cluster: placement planning, mode choice and the Ray version floor (pure); connecting with a bounded
timeout (real loopback sockets); ``address: auto`` against a real running Ray cluster (``ray start`` on 127.0.0.1);
then a real simulated 2-node x 2-GPU Ray cluster: inventory, placement groups that keep TP pairs inside a node,
bundles pinned by node label, unsatisfiable placements, node join and loss.

Every Ray test checks afterwards that no placement group and no sweeper actor is left. Nothing but this machine is
contacted; the connection tests keep Ray on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray use 127.0.0.1 as
the node address instead of this machine's network address).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic import ValidationError

from sweeper.cluster import (
    ClusterError,
    PlacementError,
    PlacementTimeout,
    SimulatedCluster,
    choose_mode,
    cleanup_stale_clusters,
    connect,
    discovery,
    plan_placement,
    probe,
    resolve_target,
    trial_placement,
)
from sweeper.config.schema import ClusterConfig
from sweeper.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


# -- pure: placement plans ---------------------------------------------------------------------------------------
def test_plan_one_node_is_one_packed_bundle() -> None:
    plan = plan_placement(2, 2)
    assert (plan.strategy, plan.num_bundles, plan.ranks_per_bundle) == ("STRICT_PACK", 1, 2)
    assert plan.bundles == [{"GPU": 2.0, "CPU": 2.0}]


def test_plan_spreads_equal_blocks_over_nodes() -> None:
    plan = plan_placement(4, 2, keep_together=2)
    assert (plan.strategy, plan.num_bundles) == ("STRICT_SPREAD", 2)
    assert [plan.bundle_of(r) for r in range(4)] == [0, 0, 1, 1]
    sixteen = plan_placement(16, 8, keep_together=2)
    assert (sixteen.num_bundles, sixteen.ranks_per_bundle) == (2, 8)


def test_plan_keeps_tp_blocks_whole_even_if_it_needs_more_nodes() -> None:
    # 6 ranks, TP=2, 4-GPU nodes: 2 nodes x 3 would split a TP pair; 3 nodes x 2 keeps pairs whole.
    plan = plan_placement(6, 4, keep_together=2)
    assert (plan.num_bundles, plan.ranks_per_bundle) == (3, 2)


def test_plan_rejects_a_group_larger_than_a_node() -> None:
    with pytest.raises(PlacementError, match="cannot stay inside a node of 2 GPUs"):
        plan_placement(4, 2, keep_together=4)


# -- pure: which cluster connect() picks ---------------------------------------------------------------------------
def test_mode_choice() -> None:
    # Pure: nothing is contacted.
    assert choose_mode(ClusterConfig(simulate=True)) == "simulated"
    assert choose_mode(ClusterConfig(simulate=True), address_override="auto") == "simulated"
    assert choose_mode(ClusterConfig(simulate=False, address="local")) == "local"
    assert choose_mode(ClusterConfig(simulate=False)) == "auto"
    assert choose_mode(ClusterConfig()) == "auto"  # a running cluster first, whether or not a GPU is visible
    assert choose_mode(ClusterConfig(simulate="auto", address="127.0.0.1:6379")) == "remote"
    assert choose_mode(ClusterConfig(simulate="auto"), address_override="ray://127.0.0.1:10001") == "remote"
    with pytest.raises(ValidationError, match="true cannot be combined with cluster.address"):
        ClusterConfig(simulate=True, address="127.0.0.1:6379")
    with pytest.raises(UsageError, match=r"^--address: '127.0.0.1:6379' cannot be combined with cluster.simulate"):
        choose_mode(ClusterConfig(simulate=True), address_override="127.0.0.1:6379")
    with pytest.raises(UsageError, match=r"^--address: must be auto, local, HOST:PORT"):
        choose_mode(ClusterConfig(), address_override="127.0.0.1")


# -- the Ray version floor -------------------------------------------------------------------------------------------
def test_installed_ray_meets_the_floor_and_has_what_sweeper_uses() -> None:
    import ray
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "ray"]
    assert Version(ray.__version__) in spec, f"installed ray {ray.__version__} outside {spec}"
    # 2.57.0 is the first release with both: placement_group(bundle_label_selector=) honoured by STRICT_PACK groups
    # (ray-project/ray#60170, first in 2.54.0; 2.53.0 placed a STRICT_PACK bundle on a node its selector excluded),
    # and NODE_ID_LABEL_KEY in ray.util.placement_group (absent from 2.56.1, present in 2.57.0). Ray 3 may drop the
    # private APIs used (ray._private.state, ray.cluster_utils, the GCS protos the connection probe asks).
    assert Version("2.57.0") in spec and Version("2.56.1") not in spec and Version("3.0.0") not in spec
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

    assert NODE_ID_LABEL_KEY == "ray.io/node-id"
    assert "bundle_label_selector" in inspect.signature(placement_group).parameters
    import ray._private.state
    from ray.cluster_utils import Cluster
    from ray.core.generated import gcs_pb2, gcs_service_pb2

    assert callable(ray._private.state.available_resources_per_node)
    assert callable(Cluster.add_node) and callable(Cluster.remove_node)
    assert "GetAllNodeInfo" in gcs_service_pb2.DESCRIPTOR.services_by_name["NodeInfoGcsService"].methods_by_name
    assert "labels" in gcs_pb2.GcsNodeInfo.DESCRIPTOR.fields_by_name


# -- connecting: bounded, one line (real sockets on loopback) ----------------------------------------------------------
def test_a_refused_port_fails_at_once_with_one_line() -> None:
    started = time.monotonic()
    with pytest.raises(ClusterError) as exc:
        resolve_target(ClusterConfig(), address_override="127.0.0.1:1")
    assert time.monotonic() - started < 5
    assert str(exc.value) == ("--address: no Ray cluster answers at 127.0.0.1:1: connection refused "
                              "(cluster.connect_timeout_s: 10)")
    assert exc.value.exit_code == 1


def test_a_port_that_never_answers_fails_after_the_timeout() -> None:
    with _silent_listener() as port:
        started = time.monotonic()
        with pytest.raises(ClusterError, match=r"^cluster.address: no Ray cluster answers at 127.0.0.1:\d+: the port "
                           r"is open but no Ray GCS replied within 1\.\d* s \(cluster.connect_timeout_s: 1\.5\)$"):
            resolve_target(ClusterConfig(address=f"127.0.0.1:{port}", connect_timeout_s=1.5))
        assert 1.0 < time.monotonic() - started < 8


def test_an_address_that_drops_connections_fails_after_the_timeout() -> None:
    """A host that never answers the TCP handshake (a firewall dropping packets), made on loopback: a listening
    socket whose accept queue is full drops further SYNs."""
    with _full_listener() as (port, drops):
        # Where the kernel completes the handshake anyway, the same bound holds with the open-port wording.
        expected = (r": no answer within 1\.5 s \(cluster.connect_timeout_s: 1\.5\)$" if drops else
                    r": the port is open but no Ray GCS replied within 1\.\d* s \(cluster.connect_timeout_s: 1\.5\)$")
        started = time.monotonic()
        with pytest.raises(ClusterError, match=expected):
            resolve_target(ClusterConfig(connect_timeout_s=1.5), address_override=f"127.0.0.1:{port}")
        assert (1.4 if drops else 1.0) < time.monotonic() - started < 8


def test_an_http_server_is_not_taken_for_ray() -> None:
    import http.server

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        found = probe(f"127.0.0.1:{server.server_address[1]}", timeout_s=5)
        assert found.problem is not None and found.problem.startswith("the server there is not a Ray GCS")
    finally:
        server.shutdown()
        server.server_close()


def test_auto_falls_back_to_simulating_when_nothing_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fallback depends on whether a GPU is visible: both answers are checked, whatever this machine has.
    monkeypatch.setattr(discovery, "cuda_visible", lambda: False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no `ray start` address file there
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    target = resolve_target(ClusterConfig(nodes=2, gpus_per_node=2))
    assert target.kind == "simulated" and target.address is None
    assert target.why == (
        "simulated, 2 nodes x 2 GPUs on this machine (no GPU visible here and no running Ray cluster answered: "
        f"RAY_ADDRESS 127.0.0.1:1: connection refused; no {tmp_path / 'ray' / 'ray_current_cluster'} (ray start "
        "writes it))"
    )
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # the dashboard address `ray job submit` uses
    assert "RAY_ADDRESS='http://127.0.0.1:8265' is not HOST:PORT" in resolve_target(ClusterConfig()).why
    # With a GPU visible and nothing answering, a local Ray instance starts instead of a simulated cluster.
    monkeypatch.setattr(discovery, "cuda_visible", lambda: True)
    local = resolve_target(ClusterConfig(nodes=2, gpus_per_node=2))
    assert (local.kind, local.address) == ("local", "local")
    assert local.why.startswith("a new single-node Ray instance on this machine (no running Ray cluster answered")


@pytest.mark.e2e
def test_no_ray_call_after_the_cluster_closed_starts_another_instance(tmp_path: Path) -> None:
    import ray

    with connect(ClusterConfig(nodes=1, gpus_per_node=1, gpu_memory_gib=4, simulate=True), record_dir=tmp_path):
        assert ray.is_initialized()
    # What a trial's thread still winding down after a SIGINT does: it fails, where Ray used to start a new local
    # instance (its agents left running, ~/.ray/auth_token written).
    with pytest.raises(Exception, match="not been started"):
        ray.put(1)
    assert not ray.is_initialized()


# -- address: auto with a real Ray cluster running (ray start --head on 127.0.0.1) -----------------------------------
@pytest.mark.e2e
def test_auto_joins_the_running_cluster(running_ray: tuple[str, Path], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import ray
    import ray._private.ray_constants

    address, tmpdir = running_ray
    address_file = tmpdir / "ray" / "ray_current_cluster"
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)  # the driver on loopback too
    monkeypatch.setenv("RAY_TMPDIR", str(tmpdir))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = ClusterConfig(nodes=2, gpus_per_node=2)  # simulate: auto, address: auto; no GPU visible on this driver
    found = resolve_target(cfg)  # from the address file `ray start` wrote
    assert (found.kind, found.address) == ("existing", address)
    assert found.why == f"the running Ray cluster at {address} (from {address_file})"

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # a dead RAY_ADDRESS: the address file is tried next
    assert resolve_target(cfg).address == address

    monkeypatch.setenv("RAY_ADDRESS", address)
    if ray.is_initialized():
        pytest.fail("another test left this process connected to Ray")
    with connect(cfg) as handle:
        assert (handle.mode, handle.address, handle.simulated) == ("existing", address, None)
        assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]
    printed = capsys.readouterr().err.splitlines()
    assert printed[0] == f"cluster: the running Ray cluster at {address} (from RAY_ADDRESS)"
    assert not ray.is_initialized()


@pytest.mark.e2e
def test_a_simulated_cluster_is_never_joined_nor_hides_ray_start(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "cuda_visible", lambda: False)  # the no-GPU fallback, on any machine
    tmpdir = Path(tempfile.mkdtemp(prefix="swp", dir="/tmp"))  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", str(tmpdir))
    address_file = tmpdir / "ray" / "ray_current_cluster"
    address_file.parent.mkdir(parents=True)
    address_file.write_text("127.0.0.1:1")  # what a user's (now stopped) `ray start` left
    try:
        with SimulatedCluster(1, 1, record_dir=tmp_path) as cluster:
            assert address_file.read_text() == "127.0.0.1:1"  # Ray's test cluster wrote its own address there
            monkeypatch.setenv("RAY_ADDRESS", cluster.address)
            target = resolve_target(ClusterConfig(nodes=1, gpus_per_node=1))
            assert target.kind == "simulated"
            assert f"RAY_ADDRESS {cluster.address}: a simulated cluster of another sweep" in target.why
        assert address_file.read_text() == "127.0.0.1:1"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_stale_cluster_cleanup_kills_only_recorded_processes_of_dead_drivers(tmp_path: Path) -> None:
    import json

    import psutil

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead_driver = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_driver.wait()
    try:
        record = {
            "driver_pid": dead_driver.pid,
            "driver_create_time": 0.0,
            "processes": [[victim.pid, psutil.Process(victim.pid).create_time()]],
        }
        (tmp_path / "cluster-1-a.json").write_text(json.dumps(record))
        assert cleanup_stale_clusters(tmp_path) == [victim.pid]
        assert victim.wait(timeout=5) is not None
        assert bystander.poll() is None
        assert not list(tmp_path.glob("cluster-*.json"))
    finally:
        for proc in (victim, bystander):
            proc.kill()
            proc.wait()


@pytest.fixture
def running_ray() -> Iterator[tuple[str, Path]]:
    """A real Ray head (``ray start --head --block``) on 127.0.0.1, in its own temp folder and process group;
    stopped by that process group's id, never by name."""
    tmpdir = Path(tempfile.mkdtemp(prefix="swr", dir="/tmp"))
    port = _free_port()
    env = {**os.environ, "RAY_TMPDIR": str(tmpdir), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    log = (tmpdir / "ray-start.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port),
         "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "0", "--include-dashboard=false",
         "--disable-usage-stats", "--object-store-memory", str(80 * 2**20)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        address_file = tmpdir / "ray" / "ray_current_cluster"
        deadline = time.monotonic() + 120
        while not address_file.is_file():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start did not come up: {(tmpdir / 'ray-start.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", tmpdir
    finally:
        _stop_group(proc)
        log.close()
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmpdir) in " ".join(p.info["cmdline"] or [])]
        shutil.rmtree(tmpdir, ignore_errors=True)
        assert not left, f"processes of the Ray head left behind: {left}"


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group ``proc`` leads (ray start and every daemon it started), SIGKILL what remains
    (a raylet drains for up to 30 s after SIGTERM; nothing here needs draining)."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _full_listener() -> Iterator[tuple[int, bool]]:
    """A loopback port whose accept queue is full, and whether the kernel then drops new connection attempts
    unanswered (Linux does; a kernel that still completes the handshake makes it a port that never answers)."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket())
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        for _ in range(16):
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            time.sleep(0.05)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.3).close()
            except TimeoutError:
                yield port, True
                return
        yield port, False


@contextlib.contextmanager
def _silent_listener() -> Iterator[int]:
    """A loopback port that accepts TCP connections (the kernel completes the handshake) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


# -- e2e: a simulated cluster ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    cfg = ClusterConfig(nodes=2, gpus_per_node=2, gpu_memory_gib=4, simulate=True)
    record_dir = tmp_path_factory.mktemp("records")
    with connect(cfg, record_dir=record_dir) as handle:
        yield handle
    assert not list(record_dir.glob("cluster-*.json")), "shutdown must delete the cluster record"


def assert_nothing_left(timeout_s: float = 15.0) -> None:
    """No placement group still reserved and no sweeper actor alive (kills and removals are asynchronous)."""
    import ray
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while True:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        actors = [a for a in list_actors(filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)
                  if (a.name or "").startswith("sweeper-") or a.class_name in ("RankActor", "_Probe")]
        if not groups and not actors:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: groups={groups} actors={actors}")
        time.sleep(0.3)


def free_gpus_settled(sim, expected: dict[str, int], timeout_s: float = 15.0) -> dict[str, int]:
    """The free-GPU view once it equals `expected`, or as it stands at the deadline.

    Ray's per-node availability is reported by the raylets and lags a reservation, a removal or a join by a moment.
    """
    deadline = time.monotonic() + timeout_s
    while (free := sim.free_gpus_per_node()) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


@pytest.mark.e2e
def test_inventory_of_the_simulated_cluster(sim) -> None:
    nodes = sim.nodes()
    assert [n.label for n in nodes] == ["sim-0", "sim-1"]
    assert all(n.gpus == 2 and not n.is_head for n in nodes)
    assert free_gpus_settled(sim, {"sim-0": 2, "sim-1": 2}) == {"sim-0": 2, "sim-1": 2}
    gpus = sim.gpu_info()
    assert gpus["sim-0"].source == "simulated" and gpus["sim-0"].memory_gib == 4
    assert sim.simulated is not None and len(sim.simulated.pids()) >= 3
    assert sim.simulated.record_path is not None and sim.simulated.record_path.exists()


@pytest.mark.e2e
def test_the_simulated_cluster_listens_and_talks_on_loopback_only(sim) -> None:
    """Every Ray daemon of the simulated cluster (GCS, raylets, dashboard, agents) and every worker under them has
    only loopback sockets, and Ray lists every node at 127.0.0.1; the driver joined it there. One exception, Ray's
    own and documented in sweeper.cluster.simulated: the dashboard's usage module asks the cloud metadata address
    once at start-up, whatever the usage-stats switch says."""
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
    assert sim.address.startswith("127.0.0.1:")
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert sim.simulated is not None
    daemons = [psutil.Process(pid) for pid in sim.simulated.pids()]
    processes = daemons + [child for d in daemons for child in d.children(recursive=True)]
    sockets = [(p.pid, c) for p in processes for c in _inet_connections(p)]
    assert any(c.status == psutil.CONN_LISTEN for _, c in sockets)
    dashboard = {p.pid for p in processes if any("dashboard.py" in part for part in _cmdline(p))}

    def rays_metadata_probe(pid: int, c: Any) -> bool:
        return pid in dashboard and bool(c.raddr) and c.raddr.ip == METADATA_IP

    outside = [(pid, c.laddr, c.raddr) for pid, c in sockets if not rays_metadata_probe(pid, c)
               and (not _loopback(c.laddr.ip) or (c.raddr and not _loopback(c.raddr.ip)))]
    assert not outside, f"sockets off loopback: {outside}"


METADATA_IP = "169.254.169.254"  # the cloud instance metadata address Ray's usage module probes


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        return process.cmdline()
    return []


def _inet_connections(process: psutil.Process) -> list:
    with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
        return process.net_connections(kind="inet")
    return []


def _loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_a_simulated_cluster_puts_rays_address_switch_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """start holds Ray to loopback (and its usage stats off) for its processes and this driver; shutdown restores
    what was there (a real cluster joined later in the same process advertises the machine's address again).
    Nothing starts here: the two private hooks are called directly."""
    import ray._private.ray_constants as ray_constants

    from sweeper.cluster.simulated import ONE_MACHINE_ENV, USAGE_STATS_ENV

    monkeypatch.setenv(ONE_MACHINE_ENV, "1")
    monkeypatch.delenv(USAGE_STATS_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    cluster = SimulatedCluster(1, 1, record_dir=tmp_path)
    cluster._hold_to_loopback()
    assert (os.environ[ONE_MACHINE_ENV], os.environ[USAGE_STATS_ENV], ray_constants.ENABLE_RAY_CLUSTER) == (
        "0", "0", False)
    cluster._release_loopback()
    assert (os.environ[ONE_MACHINE_ENV], ray_constants.ENABLE_RAY_CLUSTER) == ("1", True)
    assert USAGE_STATS_ENV not in os.environ


@pytest.mark.e2e
def test_placement_keeps_tp_pairs_on_one_node_and_is_removed(sim) -> None:
    import ray

    @ray.remote(num_gpus=1, num_cpus=1)
    class _Probe:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    with trial_placement(sim, 4, 2, timeout_s=30, keep_together=2, name="sweeper-test-tp") as placement:
        assert placement.plan.strategy == "STRICT_SPREAD"
        actors = [_Probe.options(scheduling_strategy=placement.strategy(r)).remote() for r in range(4)]
        nodes = ray.get([a.node.remote() for a in actors])
        assert free_gpus_settled(sim, {"sim-0": 0, "sim-1": 0}) == {"sim-0": 0, "sim-1": 0}
    labels = [sim.label_of(n) for n in nodes]
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[0] != labels[2]
    assert_nothing_left()  # removing the group killed its actors too
    assert free_gpus_settled(sim, {"sim-0": 2, "sim-1": 2}) == {"sim-0": 2, "sim-1": 2}


@pytest.mark.e2e
def test_unsatisfiable_placement_times_out_and_is_removed(sim) -> None:
    started = time.monotonic()
    free = r"free per node: sim-0: 2 GPUs and \d+ CPUs; sim-1: 2 GPUs and \d+ CPUs"
    with pytest.raises(PlacementTimeout, match=r"not reserved within 2s; " + free):
        with trial_placement(sim, 6, 2, timeout_s=2, name="sweeper-test-too-big"):
            pytest.fail("a 3-node placement cannot be ready on 2 nodes")
    assert time.monotonic() - started < 10
    assert_nothing_left()


@pytest.mark.e2e
def test_bundles_pinned_by_node_label_land_there_also_when_packed(sim) -> None:
    """What the Ray floor is for: a STRICT_PACK group (a trial that fits one node) honours its node label."""
    import ray

    nodes = {n.label: n.node_id for n in sim.nodes()}
    with trial_placement(sim, 2, 2, timeout_s=30, name="sweeper-test-pin", nodes=[nodes["sim-1"]]) as placement:
        assert placement.plan.strategy == "STRICT_PACK"
        assert ray.util.placement_group_table(placement.group)["bundles_to_node_id"] == {0: nodes["sim-1"]}
    with pytest.raises(PlacementTimeout):
        with trial_placement(sim, 2, 2, timeout_s=2, name="sweeper-test-pin-nowhere", nodes=["ab" * 28]):
            pytest.fail("no node carries that node id")
    assert_nothing_left()


@pytest.mark.e2e
def test_group_is_removed_when_the_body_raises(sim) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with trial_placement(sim, 2, 2, timeout_s=30, name="sweeper-test-raise"):
            raise RuntimeError("boom")
    assert_nothing_left()


@pytest.mark.e2e
def test_node_join_and_loss(sim) -> None:
    from sweeper.cluster.simulated import wait_for_node_count

    cluster = sim.simulated
    joined = cluster.add_node()
    wait_for_node_count(3)
    assert joined.label == "sim-2"
    assert [n.label for n in sim.nodes()] == ["sim-0", "sim-1", "sim-2"]
    assert free_gpus_settled(sim, {"sim-0": 2, "sim-1": 2, "sim-2": 2})["sim-2"] == 2
    raylet_pid = next(p for p in cluster.pids() if p not in _pids_without(cluster, joined))
    cluster.remove_node(joined)
    wait_for_node_count(2)
    assert [n.label for n in sim.nodes()] == ["sim-0", "sim-1"]
    assert not _pid_alive(raylet_pid)
    assert_nothing_left()


def _pids_without(cluster, node) -> set[int]:
    from sweeper.cluster.simulated import _node_pids

    return {p for n in cluster.nodes if n is not node for p in _node_pids(n.raylet)} | set(
        _node_pids(cluster._cluster.head_node)
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
