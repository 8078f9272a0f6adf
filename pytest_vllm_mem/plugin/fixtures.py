"""The fixtures a test uses: vllm_config, vllm_server, vllm_start, vllm_load."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pytest_vllm_mem.baseline.results import NodeRecord, TestRecord, failure_dict
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.launch.launcher import RunningServer, is_running
from pytest_vllm_mem.launch.ray_cluster import ClusterError
from pytest_vllm_mem.launch.server import Server, VLLMServer, VLLMStartupError
from pytest_vllm_mem.launch.standins import FailedServer, PlannedServer
from pytest_vllm_mem.load.client import LoadResult, LoadSpec, planned_load_result
from pytest_vllm_mem.load.measure import load_failure_message, measure_load, wait_for_quiet_host, warm_up
from pytest_vllm_mem.plan.preflight import Unplannable, plan_record
from pytest_vllm_mem.plugin.state import SessionState, state_key
from pytest_vllm_mem.plugin.terminal import Renderer, pytest_renderer
from pytest_vllm_mem.progress import (
    NotStarted,
    Observer,
    ServerReused,
    config_label,
    observing,
    send,
)

if TYPE_CHECKING:
    from pytest_vllm_mem.tune.search import TuneResult


def _state(request: pytest.FixtureRequest) -> SessionState:
    return request.config.stash[state_key]


progress_key = pytest.StashKey[Renderer | None]()


def _observer(request: pytest.FixtureRequest, server: RunningServer | None = None) -> Observer | None:
    """Where this test's startup or load is shown live (--vllm-progress); None when progress is off."""
    config = request.config
    if progress_key not in config.stash:  # built at first use: the terminal reporter exists by then
        settings = _state(request).settings
        config.stash[progress_key] = (
            None
            if settings.vllm_preflight  # plans start nothing: nothing to show
            else pytest_renderer(config, settings.vllm_progress)
        )
    renderer = config.stash[progress_key]
    if renderer is None:
        return None
    tier = _state(request).tier
    if server is None:
        return Observer(renderer, request.node.nodeid, tier.bytes, tier.name)
    return Observer(renderer, request.node.nodeid, tier.bytes, tier.name, server.peak_between, lambda: server.loads_run)


def _start(request: pytest.FixtureRequest, config: VLLMConfig) -> RunningServer | PlannedServer:
    """state.start(config), its startup shown live; a reused server, or one not started, in one line. A config
    --vllm-preflight cannot plan skips the test with the reason."""
    state = _state(request)
    observer = _observer(request)
    try:
        if observer is None:
            return state.start(config)
        with observing(observer):
            try:
                server = state.start(config)
            except VLLMStartupError as error:
                if observer.startups == 0:  # refused before a launch: bad flag, failed earlier, memory held
                    summary = error.diagnosis.summary
                    send(observer, NotStarted(observer.test_id, config_label(config), error.kind, summary))
                raise
    except Unplannable as why:
        pytest.skip(str(why))
    if observer.startups == 0 and not isinstance(server, PlannedServer):  # the pool handed out a running server
        send(
            observer,
            ServerReused(observer.test_id, config_label(config), server.pid, time.monotonic() - server.started_at),
        )
    return server


def record_for(request: pytest.FixtureRequest, server_or_error: Server | VLLMStartupError) -> TestRecord:
    """The test's record, created on first use of a server (or of a failed startup)."""
    state = _state(request)
    nodeid = request.node.nodeid
    if nodeid in state.records:
        return state.records[nodeid]
    # A server and a startup error both know what was asked for (config) and what ran (launched).
    config, launched = server_or_error.config, server_or_error.launched
    memory = server_or_error.memory
    server = server_or_error.server if isinstance(server_or_error, VLLMStartupError) else server_or_error
    record = TestRecord(
        test_id=nodeid,
        config=str(config),
        launched=str(launched),
        tier=state.tier.name,
        server_pid=server.pid if server is not None else None,
        tier_bytes=state.tier.bytes,
        device=state.device.name,
        backend=state.device.backend,
        vllm_version=(memory.vllm_version if memory and memory.vllm_version else state.parser_table.version),
        **_server_figures(server_or_error),
    )
    record.plan = plan_record(state.plans, launched, record.memory)
    if not isinstance(server_or_error, VLLMStartupError):
        record.notes.extend(server_or_error.notes)
    # Failed startups are plotted too: memory climbing until the OOM is the most telling timeline.
    if server is not None and is_running(server):
        state.servers[nodeid] = server
        record.nodes = placement(server, record.nodes)
    state.records[nodeid] = record
    return record


def placement(server: RunningServer, known: list[NodeRecord]) -> list[NodeRecord]:
    """Where a cluster server's ranks run and their peaks so far ([] for a server on this machine); what was known
    before when a node no longer answers (the failure itself is the load's or the test's)."""
    try:
        return server.per_node_peaks()
    except ClusterError:
        return known


@pytest.fixture
def vllm_config(request: pytest.FixtureRequest) -> VLLMConfig:
    """The config under test: the ini/CLI default model; override with @pytest.mark.parametrize("vllm_config", ...)."""
    return _state(request).default_config()


@pytest.fixture
def vllm_start(request: pytest.FixtureRequest) -> Callable[[VLLMConfig], RunningServer | PlannedServer]:
    """start(config) -> server, raising VLLMStartupError (with .kind) when it does not come up.

    For tests that assert a config does NOT fit: `with pytest.raises(VLLMStartupError) as e: vllm_start(cfg)`.
    """

    def start(config: VLLMConfig) -> RunningServer | PlannedServer:
        try:
            server = _start(request, config)
        except VLLMStartupError as error:
            record = record_for(request, error)
            record.failure = failure_dict(error.diagnosis, error.advice, error.log_path)
            record.notes.append("startup failure raised to the test (vllm_start)")
            raise
        record_for(request, server)
        return server

    return start


startup_failure_key = pytest.StashKey[VLLMStartupError]()


@pytest.fixture
def vllm_server(request: pytest.FixtureRequest, vllm_config: VLLMConfig) -> Server:
    """A healthy server for vllm_config, reused by later tests with an equal config. A failed startup fails the test
    with its kind, root cause and next step."""
    try:
        server = _start(request, vllm_config)
    except VLLMStartupError as error:
        record_for(request, error).failure = failure_dict(error.diagnosis, error.advice, error.log_path)
        request.node.stash[startup_failure_key] = error
        return FailedServer(error)
    record_for(request, server)
    return server


# One more session of a test's last load on a fresh server, for the gate's confirmation (plugin/gate.py).
remeasure_key = pytest.StashKey[Callable[[], bool]]()


class LoadFailed(AssertionError):
    """The server died or ran out of memory during a load."""


def load_arguments(arguments: dict[str, Any]) -> tuple[LoadSpec, int]:
    """One vllm_load call's keyword arguments -> (the load, how many times it runs); one LoadSpecError (a
    ValueError) naming every unusable or unknown argument and what is accepted."""
    repeat = arguments.get("repeat", 1)  # the fixture's own: how often the load runs, not what one run sends
    unusable = not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1
    why = "must be an integer >= 1 (the load runs that often; the median run is returned)"
    problems: tuple[str, ...] = (f"repeat={repeat!r} {why}",) if unusable else ()
    fields = {name: value for name, value in arguments.items() if name != "repeat"}
    return LoadSpec.of("vllm_load()", fields, problems=problems, also_accepted=("repeat",)), repeat


@pytest.fixture
def vllm_load(request: pytest.FixtureRequest, vllm_server: Server) -> Callable[..., LoadResult]:
    """load(num_prompts=100, concurrency=16, max_tokens=64, prompt_len=32, ignore_eos=True, request_rate=None,
    timeout_s=600.0, request_timeout_s=120.0, repeat=1) -> LoadResult, keywords only (the defaults are LoadSpec's).
    With repeat=N the load runs N times, all are recorded, and the run with the median output throughput is
    returned. Fails the test when the server dies or logs an out-of-memory error."""
    record = record_for(request, vllm_server)
    if isinstance(vllm_server, PlannedServer):  # --vllm-preflight: planned, not measured; no load runs

        def planned(**arguments: Any) -> LoadResult:
            return planned_load_result(load_arguments(arguments)[0])  # checked as a measured load would be

        return planned
    if isinstance(vllm_server, FailedServer):  # the startup failed: a load raises its error (the test fails)

        def failed(**arguments: Any) -> LoadResult:
            raise vllm_server.error

        return failed
    if not is_running(vllm_server):
        raise TypeError(f"vllm_load needs a running server, a FailedServer or a PlannedServer, not {vllm_server!r}")
    served = [vllm_server]  # the server the loads go to: a fresh one after a confirmation restarted it
    state = _state(request)
    # pytest-benchmark, when the test asks for its fixture: the first load call becomes its rounds (one per repeat),
    # so --benchmark-autosave/--benchmark-compare see the loads; the plugin's own gate does not depend on it.
    benchmark = request.getfixturevalue("benchmark") if "benchmark" in request.fixturenames else None
    benchmark_free = [benchmark is not None]

    def load(**arguments: Any) -> LoadResult:
        spec, repeat = load_arguments(arguments)
        results: list[LoadResult] = []

        def one_run() -> None:
            server = served[-1]
            _warm_up_once(state, server, spec)
            observer = _observer(request, server)
            with observing(observer):  # a progress thread reads the load's counters while it runs
                result = measure_load(server, spec)  # next to the server, on its node for a cluster's
            if observer is not None:
                send(observer, result.ended_event(observer.test_id, server.loads_run))
            record.loads.append({**result.to_dict(), "session": len(served) - 1})  # the server it ran on
            if result.failure is not None:
                record.failure = failure_dict(result.failure, result.advice, server.log_path)
                raise LoadFailed(load_failure_message(server, result))
            results.append(result)

        if benchmark_free[0] and benchmark is not None:
            benchmark_free[0] = False  # pytest-benchmark allows one measurement per test
            benchmark.pedantic(one_run, rounds=repeat, iterations=1)
        while len(results) < repeat:  # no benchmark, or it ran fewer rounds (--benchmark-disable runs one)
            one_run()
        chosen = sorted(results, key=lambda r: r.output_throughput)[len(results) // 2]

        def remeasure() -> bool:
            """The gate's confirmation: a fresh server of the same config, and this load as often as it ran."""
            try:
                served.append(_state(request).restart(served[-1].config))
            except VLLMStartupError as error:
                record.notes.append(f"a fresh server for the gate's confirmation did not start: {error.kind}")
                return False
            record.restarts.append(_server_figures(served[-1]))
            # Measured when the neighbours are quiet, if they get so (this machine's: a cluster node's are not seen).
            waited = wait_for_quiet_host(served[-1].pid) if isinstance(served[-1], VLLMServer) else None
            if waited is not None:
                record.notes.append(waited)
            for _ in range(repeat):
                one_run()
            return True

        request.node.stash[remeasure_key] = remeasure  # the last load's; the gate calls it at most once
        if benchmark is not None:
            benchmark.extra_info.update(serving_metrics(chosen))
        return chosen

    return load


def _warm_up_once(state: SessionState, server: RunningServer, spec: LoadSpec) -> None:
    """One unmeasured wave per server and load shape, before its first measured load of that shape (warm_up)."""
    shape = (server.pid, server.started_at, spec.concurrency, spec.prompt_len, spec.max_tokens)
    if shape not in state.warmed:
        warm_up(server, spec)
        state.warmed.add(shape)


def _server_figures(server_or_error: Server | VLLMStartupError) -> dict[str, Any]:
    """A server's (or a failed startup's) startup and memory figures as a record keeps them: the test's own in
    TestRecord.startup and .memory, a confirmation's fresh server's in TestRecord.restarts."""
    startup, memory = server_or_error.startup, server_or_error.memory
    return {"startup": startup.to_dict() if startup else {}, "memory": memory.to_dict() if memory else {}}


def serving_metrics(result: LoadResult) -> dict[str, float]:
    """The figures a benchmark round carries in pytest-benchmark's extra_info."""
    return {
        "output_throughput": result.output_throughput,
        "request_throughput": result.request_throughput,
        "ttft_p50_ms": result.ttft.p50,
        "ttft_p99_ms": result.ttft.p99,
        "tpot_p50_ms": result.tpot.p50,
        "e2el_p50_ms": result.e2el.p50,
        "peak_memory_bytes": result.peak_memory_bytes or 0,
        "completed": result.completed,
        "failed": result.failed,
    }


@pytest.fixture
def vllm_tune(request: pytest.FixtureRequest) -> Callable[..., TuneResult]:
    """tune(config=None, *, low=None, high=None, resolution=0.05, max_startups=6, goal="auto", load=None)
    -> TuneResult: the highest (GPU) or lowest (CPU) gpu_memory_utilization that starts and survives a load on this
    run's tier, by bisection. Each trial starts its own server, so do not combine it with vllm_server in one test."""
    from pytest_vllm_mem.tune.search import TuneError, tune

    state = _state(request)
    terminal = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def progress(line: str) -> None:
        # Each trial can take a minute: show progress live, past pytest's output capture.
        if terminal is None or capture is None:
            print(line)
            return
        with capture.global_and_fixture_disabled():
            terminal.write_line(line)

    def run(config: VLLMConfig | None = None, **options: Any) -> TuneResult:
        try:
            return tune(state, config or state.default_config(), out=progress, **options)
        except TuneError as error:
            pytest.fail(str(error), pytrace=False)

    return run
