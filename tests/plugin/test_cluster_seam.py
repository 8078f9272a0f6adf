"""The launch seam without a cluster: the pool through a launcher, --vllm-cluster picked at session start, the Ray
launcher's refusals and progress, the load dispatched to where the server runs, and where a server ran in the record
and the report (tests/test_e2e_cluster.py runs all of it on a real two-node Ray cluster)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import make_record

from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.baseline.results import NodeRecord, TestRecord
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis
from pytest_vllm_mem.launch.launcher import LaunchRequest, is_running
from pytest_vllm_mem.launch.pool import LocalLauncher, ServerPool, Session, checked_cluster
from pytest_vllm_mem.launch.ray_cluster import ClusterCapacityError, ClusterError, NodeLostError
from pytest_vllm_mem.launch.ray_launcher import RayLauncher
from pytest_vllm_mem.launch.server import (
    LaunchSettings,
    ServerLaunchError,
    StartupOutcome,
    VLLMServer,
    VLLMStartupError,
)
from pytest_vllm_mem.launch.standins import FailedServer
from pytest_vllm_mem.load.client import LoadResult, LoadSpec
from pytest_vllm_mem.load.measure import measure_load, measured_load
from pytest_vllm_mem.plugin.report import peak_cell, placement_lines
from pytest_vllm_mem.plugin.terminal import Renderer
from pytest_vllm_mem.progress import Event, Observer, PlacementWait, StartupBegan, StartupEnded, observing
from pytest_vllm_mem.settings import Settings, UsageError
from pytest_vllm_mem.units import GIB

CONFIG = VLLMConfig("m", max_num_seqs=4)


@dataclass
class FakeServer:
    """A running server as the pool and the fixtures see it (what a launcher returns)."""

    config: VLLMConfig
    launched: VLLMConfig
    url: str = "http://127.0.0.1:1"
    model_name: str = "m"
    pid: int = 4242
    startup: StartupOutcome | None = field(default_factory=lambda: StartupOutcome(True, "started", 30.0, GIB))
    memory: None = None
    notes: list[str] = field(default_factory=list)
    log_path: Path | None = None
    started_at: float = 0.0
    loads_run: int = 0
    stopped: bool = False
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    lost: bool = False

    def alive(self) -> bool:
        return not self.stopped

    def log_text(self) -> str:
        return ""

    def peak_between(self, since: float) -> int:
        return GIB

    def per_node_peaks(self) -> list[NodeRecord]:
        return []

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        self.calls.append((function, *args))
        if self.lost:
            raise NodeLostError("node n1 (10.0.0.2, Ray node abcdef) of rank 1 of the server `m` left the cluster")
        return "measured"

    def stop(self, grace_s: float = 15.0) -> None:
        self.stopped = True


class FakeLauncher:
    def __init__(self, fail: VLLMStartupError | None = None, launches: bool = True) -> None:
        self.requests: list[LaunchRequest] = []
        self.servers: list[FakeServer] = []
        self.fail = fail
        self.launches = launches
        self.closed = False

    def start(self, request: LaunchRequest, settings: LaunchSettings) -> FakeServer:
        self.requests.append(request)
        if self.launches:
            request.on_launch()
        if self.fail is not None:
            raise self.fail
        self.servers.append(FakeServer(request.config, request.launched))
        return self.servers[-1]

    def close(self) -> None:
        self.closed = True


def startup_error(kind: str = "crash") -> VLLMStartupError:
    return VLLMStartupError(Diagnosis(kind, "it died"), CONFIG, None, StartupOutcome(False, kind, 1.0, 0))  # type: ignore[arg-type]


def test_the_pool_starts_through_its_launcher_and_reuses_what_runs(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    pool = ServerPool(LaunchSettings(log_dir=tmp_path), None, capacity=2, launcher=launcher)
    first = pool.acquire(CONFIG, CONFIG, {"tier_bytes": 1})
    assert pool.acquire(CONFIG, CONFIG, {}) is first and pool.startups == 1
    other = VLLMConfig("m", max_num_seqs=8)
    pool.acquire(other, other, {})
    assert [r.launched for r in launcher.requests] == [CONFIG, other]
    assert list(launcher.requests[1].running) == [first]  # the pool's other servers, for the launcher's accounting
    pool.close()
    assert launcher.servers[0] is first and first.alive() is False  # stopped
    assert launcher.closed and not pool.running


def test_only_a_startup_the_launcher_attempted_is_remembered_as_failed(tmp_path: Path) -> None:
    refused = FakeLauncher(fail=startup_error("insufficient_free_memory"), launches=False)
    pool = ServerPool(LaunchSettings(log_dir=tmp_path), None, launcher=refused)
    with pytest.raises(VLLMStartupError):
        pool.acquire(CONFIG, CONFIG, {})
    assert pool.failed == {} and pool.startups == 0  # memory held by others: the next test tries again
    crashed = FakeLauncher(fail=startup_error())
    pool = ServerPool(LaunchSettings(log_dir=tmp_path), None, launcher=crashed)
    for _ in range(2):
        with pytest.raises(VLLMStartupError):
            pool.acquire(CONFIG, CONFIG, {})
    assert len(crashed.requests) == 1 and CONFIG in pool.failed  # the same error again, no second startup


def test_the_default_launcher_is_the_local_one(tmp_path: Path) -> None:
    assert isinstance(ServerPool(LaunchSettings(log_dir=tmp_path), None).launcher, LocalLauncher)


def test_running_servers_are_told_from_the_stand_ins_without_touching_them() -> None:
    failed = FailedServer(startup_error())
    assert not is_running(failed)  # its members raise the startup error: never read
    assert is_running(FakeServer(CONFIG, CONFIG))
    assert callable(VLLMServer.call) and callable(VLLMServer.stop)


def settings(tmp_path: Path, cluster: str) -> Settings:
    return Settings.from_values({"vllm_cluster": cluster}, tmp_path)


def test_local_is_the_default_and_asks_nothing_of_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    session = Session(Settings.from_values({}, tmp_path))
    assert session.settings.vllm_cluster == "local" and session.cluster_address is None


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that accepts connections (stands in for a GCS at session start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_cluster_is_checked_at_session_start(tmp_path: Path, listening: int) -> None:
    session = Session(settings(tmp_path, f"ray://127.0.0.1:{listening}"))
    assert session.cluster_address == f"ray://127.0.0.1:{listening}"
    with pytest.raises(UsageError, match="the tuner starts its trial servers on this machine"):
        session.launch(CONFIG)


@pytest.mark.parametrize("value", ["slurm", "ray://host"])
def test_a_bad_cluster_setting_is_one_paragraph(tmp_path: Path, value: str) -> None:
    with pytest.raises(UsageError) as error:
        Session(settings(tmp_path, value))
    assert repr(value) in str(error.value) and "\n" not in str(error.value)


def test_an_unreachable_cluster_or_missing_ray_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(UsageError, match="cannot be reached"):
        checked_cluster(f"ray://127.0.0.1:{port}")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"pytest-vllm-mem\[ray\]"):
        checked_cluster("ray")


class FakeCluster:
    def __init__(self, fail: Exception | None = None, waits: int = 0) -> None:
        self.fail = fail
        self.waits = waits
        self.closed = False

    def start(self, config: VLLMConfig, launched: VLLMConfig, settings: LaunchSettings, on_wait: Any) -> FakeServer:
        for second in range(self.waits):
            on_wait(float(second))
        if self.fail is not None:
            raise self.fail
        return FakeServer(config, launched)

    def close(self) -> None:
        self.closed = True


def start_on(cluster: FakeCluster) -> tuple[list[Event], list[bool], Any]:
    events: list[Event] = []
    launched: list[bool] = []
    launcher = RayLauncher("127.0.0.1:1", connect=lambda address: cluster)  # type: ignore[arg-type,return-value]
    request = LaunchRequest(CONFIG, CONFIG, {}, on_launch=lambda: launched.append(True))
    observer = Observer(events.append, "t[a]")
    with observing(observer):
        try:
            outcome: Any = launcher.start(request, LaunchSettings())
        except VLLMStartupError as error:
            outcome = error
    assert observer.startups == 1  # a startup, never shown as a reused server
    return events, launched, outcome


def test_a_cluster_startup_shows_its_wait_for_room() -> None:
    events, launched, server = start_on(FakeCluster(waits=12))
    assert isinstance(events[0], StartupBegan) and isinstance(events[-1], StartupEnded) and events[-1].ok
    assert [e.waited_s for e in events if isinstance(e, PlacementWait)] == [0.0, 5.0, 10.0]
    assert launched == [True] and isinstance(server, FakeServer)


def test_a_config_larger_than_the_cluster_fails_its_test_naming_both_figures() -> None:
    why = "`m` cannot run on the Ray cluster: needs 3 node(s) with 1 CPU each; the cluster has 2 such node(s)"
    events, launched, error = start_on(FakeCluster(fail=ClusterCapacityError(why)))
    assert isinstance(error, VLLMStartupError) and error.kind == "cluster_capacity"
    assert "needs 3 node(s) with 1 CPU each; the cluster has 2 such node(s)" in str(error)
    assert "larger cluster" in str(error)  # the next step
    assert launched == [True]  # remembered for the session: the same config fails at once
    assert isinstance(events[-1], StartupEnded) and events[-1].kind == "cluster_capacity"


def test_a_node_lost_during_the_startup_is_its_own_kind() -> None:
    _, _, error = start_on(FakeCluster(fail=NodeLostError("node n1 of rank 1 left the cluster")))
    assert error.kind == "node_lost" and "rank 1" in str(error)


def test_a_cluster_that_refuses_the_connection_is_a_launch_error() -> None:
    def refuse(address: str) -> Any:
        raise ClusterError(f"Cannot connect to the Ray cluster at {address!r}: refused.")

    launcher = RayLauncher("127.0.0.1:1", connect=refuse)
    with pytest.raises(ServerLaunchError, match="Cannot connect to the Ray cluster"):
        launcher.start(LaunchRequest(CONFIG, CONFIG, {}), LaunchSettings())
    launcher.close()  # nothing was connected: nothing to close


def test_a_load_runs_where_the_server_runs() -> None:
    server = FakeServer(CONFIG, CONFIG)
    spec = LoadSpec(num_prompts=4)
    assert measure_load(server, spec) == "measured"  # type: ignore[comparison-overlap]
    assert server.calls == [(measured_load, spec)]  # one call, whichever server it is


def test_a_node_lost_during_a_load_fails_the_load_naming_the_node() -> None:
    result = measure_load(FakeServer(CONFIG, CONFIG, lost=True), LoadSpec(num_prompts=4))
    assert isinstance(result, LoadResult) and not result.ok and result.completed == 0
    assert result.failure is not None and result.failure.kind == "node_lost"
    assert "Ray node abcdef" in result.failure.summary and "rank 1" in result.failure.summary


def node(rank: int, peak: int, per_gpu: list[int] | None = None) -> NodeRecord:
    return {
        "rank": rank,
        "node_id": f"{rank}" * 16,
        "address": f"10.0.0.{rank + 1}",
        "hostname": f"gpu-{rank}",
        "peak_memory_bytes": peak,
        "peak_memory_per_gpu": per_gpu or [],
    }


def test_the_record_names_the_nodes_and_gates_the_fullest() -> None:
    record = make_record(backend="cpu", nodes=[node(0, 4 * GIB), node(1, 6 * GIB)])
    assert record.peak_memory_bytes == 5 * GIB  # rank 0, measured by the startup and the load
    assert record.largest_gpu_peak_bytes == 6 * GIB  # the fullest node is what the tier limits
    data = record.to_dict()
    assert [n["node_id"] for n in data["nodes"]] == ["0" * 16, "1" * 16]
    assert TestRecord.from_dict(data).nodes == record.nodes
    gpus = make_record(nodes=[node(0, 9 * GIB, [4 * GIB, 5 * GIB]), node(1, 13 * GIB, [6 * GIB, 7 * GIB])])
    assert gpus.largest_gpu_peak_bytes == 7 * GIB  # per GPU where the nodes have GPUs
    alone = make_record(nodes=[node(0, 9 * GIB)])
    assert alone.largest_gpu_peak_bytes == make_record().largest_gpu_peak_bytes  # one rank: as a local server


def test_the_report_shows_where_each_server_ran() -> None:
    record = make_record(backend="cpu", nodes=[node(0, 4 * GIB), node(1, 6 * GIB)])
    assert peak_cell(record) == "6.00 GiB / 24gb (per node: 4.00 GiB, 6.00 GiB)"
    lines = placement_lines([record, make_record("t::local")])
    assert lines[0] == "servers on the cluster:"
    assert lines[1] == (
        "  test_chat[tiny]: rank 0 on gpu-0 (10.0.0.1, node 000000000000), peak 4.00 GiB; "
        "rank 1 on gpu-1 (10.0.0.2, node 111111111111), peak 6.00 GiB"
    )
    assert len(lines) == 2 and placement_lines([make_record()]) == []


class Screen:
    width = 120

    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def status(self, text: str) -> None:
        self.lines.append(text)

    def clear_status(self) -> None:
        pass


def test_the_wait_for_room_is_rendered() -> None:
    screen = Screen()
    Renderer(screen, "plain", 0)(PlacementWait("t[a]", "m max-num-seqs=4", 12.0))
    assert screen.lines == ["[vllm-mem]   waiting 12s for room on the cluster (other servers hold it)"]
