"""Reliability against real vLLM CPU servers: an engine killed during a load, Ctrl-C and SIGTERM during a startup,
a test that raises or calls pytest.exit() holding a server, a server nobody holds at session end, two xdist workers
starting servers at once. Nothing may hang, no process may be left, no result may be lost.

Four full server startups (two of them in parallel) and four cut short during startup, about 4 minutes here. The same faults on stub servers, and bad input,
are in test_reliability_unit.py; load-time request errors are unit-tested in test_load.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
from e2e import CACHE_DIR, TOKEN_VAR, processes_with_token, record, run_inner
from stubs.helpers import Figures, described, kill_quietly, popen_pytest, reap, running

from pytest_vllm_mem.launch.server import SERVER_MODULE, STARTING_STOP_GRACE_S
from pytest_vllm_mem.versions import LAUNCHER

pytestmark = pytest.mark.e2e
FIGURES = Figures()


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> Iterator[None]:
    yield
    print("\n" + FIGURES.summary("real vLLM CPU servers (test_e2e_reliability.py)"))
    assert FIGURES.left() == [], f"processes left after the reliability tests: {FIGURES.left()}"


HELPERS = """
import json, os, signal, threading, time
from pathlib import Path
import psutil, pytest
from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.plugin.state import state_key

A = VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)
B = VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=512)

def tree(server):
    root = psutil.Process(server.pid)
    return [root, *root.children(recursive=True)]

def listening(procs):
    return sorted({c.laddr.ip for p in procs for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})

def save(name, **data):
    Path(name).write_text(json.dumps(data))
"""

ENGINE_DEATH = (
    HELPERS
    + """
@pytest.mark.parametrize("vllm_config", [A], ids=["A"])
def test_engine_dies_during_load(vllm_server, vllm_load):
    procs = tree(vllm_server)
    engine = next((p for p in procs[1:] if "EngineCore" in p.name()), procs[1])
    info = {"pids": [p.pid for p in procs], "engine": engine.name(), "listening": listening(procs),
            "argv": psutil.Process(vllm_server.pid).cmdline()}
    killed = {}

    def kill_engine():
        time.sleep(3)  # the load is running by then
        killed["at"] = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)

    threading.Thread(target=kill_engine, daemon=True).start()
    try:
        vllm_load(num_prompts=20000, concurrency=16, max_tokens=64, timeout_s=120)
    finally:
        returned = time.monotonic()
        save("crash.json", killed="at" in killed, kill_to_fail_s=returned - killed.get("at", returned), **info)

@pytest.mark.parametrize("vllm_config", [B], ids=["B"])
def test_next_config_starts(vllm_server, vllm_load):
    crashed = json.loads(Path("crash.json").read_text())
    assert vllm_server.pid not in crashed["pids"]
    assert vllm_load(num_prompts=16, concurrency=4, max_tokens=16).ok
    procs = tree(vllm_server)
    save("next.json", pids=[p.pid for p in procs], listening=listening(procs))

@pytest.mark.parametrize("vllm_config", [B], ids=["B"])
def test_raises_holding_a_server(vllm_server):
    assert vllm_server.pid == json.loads(Path("next.json").read_text())["pids"][0]
    raise RuntimeError("boom after getting a server")

@pytest.mark.parametrize("vllm_config", [B], ids=["B"])
def test_exits_holding_a_server_nobody_else_holds(vllm_server, request):
    save("orphan.json", pids=[p.pid for p in tree(vllm_server)])
    request.config.stash[state_key].pool.running.clear()  # now only the session-end sweep can stop it
    pytest.exit("stop after getting a server")

def test_never_runs():
    pass
"""
)


def test_engine_death_raise_exit_and_session_end_sweep(pytester: pytest.Pytester) -> None:
    """Scenarios 1 (engine killed during a load), 3c (raise / pytest.exit holding a server), 7 (loopback only on a
    real server) and 8 (session-end sweep). Two startups."""
    pytester.makepyfile(test_inner=ENGINE_DEATH)
    result, data = run_inner(pytester)
    output = result.stdout.str()
    crashed = json.loads((pytester.path / "crash.json").read_text())
    following = json.loads((pytester.path / "next.json").read_text())
    orphan = json.loads((pytester.path / "orphan.json").read_text())
    FIGURES.saw(crashed["pids"] + following["pids"] + orphan["pids"])
    result.assert_outcomes(failed=2, passed=1)

    # 1. The load stops within seconds of the engine's death and fails its test as a crash, without a traceback.
    assert crashed["killed"] and crashed["engine"].startswith("VLLM::EngineCore")
    assert "vLLM failed during the load [crash]" in output
    failure = record(data, "test_engine_dies_during_load[A]")["failure"]
    assert failure["kind"] == "crash"
    assert crashed["kill_to_fail_s"] < 10
    FIGURES.fault("EngineCore killed during a load", crashed["kill_to_fail_s"])
    # ... and the next config got a fresh server (the dead one was not handed out again) that served its load.
    assert record(data, "test_next_config_starts[B]")["passed"] is True
    assert data["server_startups"] == 2

    # 7. Every listening socket of a real server (API server, engine, worker) is on the loopback interface.
    assert crashed["argv"][crashed["argv"].index("--host") + 1] == "127.0.0.1"
    # The launch is `vllm serve MODEL ...` through the CLI's main() (versions.launch_argv), the model positional.
    assert crashed["argv"][1:4] == ["-c", LAUNCHER, "serve"] and not crashed["argv"][4].startswith("-")
    assert crashed["listening"] == ["127.0.0.1"] and following["listening"] == ["127.0.0.1"]

    # 3c. Raising and pytest.exit() while holding a server: the session ends, the results JSON is written.
    assert "boom after getting a server" in output and "stop after getting a server" in output
    assert "test_never_runs" not in output.split("short test summary")[-1]
    FIGURES.fault("test raises holding a real server")
    FIGURES.fault("pytest.exit() holding a real server")

    # 8. The server the pool forgot was found by the session-end sweep, reported, and stopped.
    assert orphan["pids"][0] == following["pids"][0]
    assert f"stopped 1 vLLM server(s) still running at session end: pids [{orphan['pids'][0]}]" in output
    assert data["leaked_server_pids"] == [orphan["pids"][0]]
    FIGURES.fault("server left running at session end (sweep, real server)")
    assert running(crashed["pids"] + following["pids"]) == []  # run_inner also checked every token process


STARTS = (
    HELPERS
    + """
@pytest.mark.parametrize("vllm_config", [A], ids=["A"])
@pytest.mark.parametrize("case", CASES)
def test_starts(case, vllm_server):
    pass
"""
)


def _server_processes(token: str, pytest_pid: int) -> list[psutil.Process]:
    """The inner session's server processes. Found by token and as descendants of those: vLLM renames its engine
    and worker processes with setproctitle, which overwrites /proc/PID/environ, so they show no token. pytest and
    its xdist workers (the children of pytest that are no server) are not servers."""
    pytest_processes = {pytest_pid}
    try:
        for child in psutil.Process(pytest_pid).children():
            if SERVER_MODULE not in " ".join(child.cmdline()):
                pytest_processes.add(child.pid)
    except psutil.Error:
        pass
    found: dict[int, psutil.Process] = {}
    for proc in processes_with_token(token):
        if proc.pid in pytest_processes:
            continue
        found[proc.pid] = proc
        try:
            found.update((child.pid, child) for child in proc.children(recursive=True))
        except psutil.Error:
            continue
    return [proc for proc in found.values() if proc.pid not in pytest_processes and running([proc.pid])]


@pytest.mark.parametrize(
    ("sig", "workers"),
    [(signal.SIGINT, 0), (signal.SIGTERM, 0), (signal.SIGTERM, 2)],
    ids=["SIGINT", "SIGTERM", "SIGTERM-xdist"],
)
def test_interrupting_pytest_during_a_real_startup_stops_every_server_process(
    pytester: pytest.Pytester, sig: signal.Signals, workers: int
) -> None:
    """Scenarios 3a/3b: Ctrl-C (SIGINT) or a CI cancel (SIGTERM) to pytest while vLLM starts (its EngineCore is
    up): every server process is gone within seconds and pytest exits as interrupted. Under xdist the signal
    reaches the controller only, which forwards it to the workers (execnet would interrupt them 5 s later and kill
    them 5 s after that, cutting a worker's stop short and orphaning its server)."""
    cases = ["a", "b"][: max(workers, 1)]
    pytester.makepyfile(test_inner=STARTS.replace("CASES", repr(cases)))
    token = f"reliability-{sig.name}-{workers}-{os.getpid()}-{time.time_ns()}"
    # Startups not serialized per device (devicelock): the xdist case needs both servers starting at once.
    env = {**os.environ, TOKEN_VAR: token, "PYTEST_VLLM_MEM_DEVICE_LOCK": "off"}
    log = pytester.path / "inner.log"
    xdist = ["-n", str(workers)] if workers else []
    process = popen_pytest(pytester.path, [f"--vllm-cache-dir={CACHE_DIR}", "-s", *xdist], env, log)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while True:  # wait until every engine process exists: the servers are well into their startup
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            procs = _server_processes(token, process.pid)
            seen.update(proc.pid for proc in procs)
            if sum("EngineCore" in described(proc) for proc in procs if running([proc.pid])) >= len(cases):
                break
            time.sleep(0.2)
        seen.update(proc.pid for proc in _server_processes(token, process.pid))
        sent = time.monotonic()
        process.send_signal(sig)
        deadline = sent + 60
        while running(seen) or _server_processes(token, process.pid):
            seen.update(proc.pid for proc in _server_processes(token, process.pid))
            assert time.monotonic() < deadline, "server processes outlived the interrupted pytest by 60 s"
            time.sleep(0.05)
        servers_gone = time.monotonic() - sent
        code = process.wait(60)
        exited = time.monotonic() - sent
    finally:
        FIGURES.saw(seen)
        reap(process)  # killed if still running, and waited for: an unreaped Popen is a ResourceWarning
        kill_quietly(list(seen) + [proc.pid for proc in _server_processes(token, process.pid)])
    output = log.read_text()
    assert code == pytest.ExitCode.INTERRUPTED, output[-3000:]
    assert "KeyboardInterrupt" in output
    assert processes_with_token(token) == [] and running(seen) == []
    # A starting server is killed once its engine has exited (vLLM's API server ignores SIGTERM until healthy).
    # The grace for a starting server, then the kill; under xdist well before execnet kills the workers (10 s).
    assert servers_gone < STARTING_STOP_GRACE_S + 4
    name = f"{sig.name} to pytest{' (xdist controller)' if workers else ''} during a real server startup"
    FIGURES.fault(name, servers_gone)
    print(
        f"[reliability] {name}: {len(seen)} processes gone {servers_gone:.2f} s after the signal, "
        f"pytest exited after {exited:.2f} s"
    )


PARALLEL = (
    HELPERS
    + """
@pytest.mark.parametrize("vllm_config", [A], ids=["A"])
@pytest.mark.parametrize("case", ["one", "two"])
def test_parallel(case, vllm_server, vllm_load, worker_id):
    env = psutil.Process(vllm_server.pid).environ()
    save(f"server-{case}.json", worker=worker_id, port=vllm_server.port, pids=[p.pid for p in tree(vllm_server)],
         log=str(vllm_server.log_path), cache_root=env.get("VLLM_CACHE_ROOT"))
    other = Path(f"server-{'two' if case == 'one' else 'one'}.json")
    deadline = time.monotonic() + 300
    while not other.exists():  # both servers run at once before either load starts
        assert time.monotonic() < deadline, "the other worker's server never came up"
        time.sleep(0.2)
    assert psutil.pid_exists(json.loads(other.read_text())["pids"][0])
    assert vllm_load(num_prompts=16, concurrency=4, max_tokens=16).ok
"""
)


def test_two_xdist_workers_start_real_servers_at_once(pytester: pytest.Pytester) -> None:
    """Scenario 4: two workers, two servers at the same time on this host: distinct ports and logs, one shared
    compile cache, and both records in the controller's results JSON and in the one baseline file."""
    pytester.makepyfile(test_inner=PARALLEL)
    baseline = pytester.path / "baselines.json"
    result, data = run_inner(
        pytester, "-n", "2", "--dist", "load", "--vllm-update-baseline", f"--vllm-baseline={baseline}"
    )
    servers = [json.loads((pytester.path / f"server-{case}.json").read_text()) for case in ("one", "two")]
    FIGURES.saw([pid for server in servers for pid in server["pids"]])
    result.assert_outcomes(passed=2)
    one, two = servers
    assert one["worker"] != two["worker"]
    assert one["port"] != two["port"]
    assert one["log"] != two["log"] and all(os.path.exists(server["log"]) for server in servers)
    assert one["cache_root"] == two["cache_root"] == str(CACHE_DIR / "vllm")  # shared, used at once
    ids = {f"test_inner.py::test_parallel[{case}-A]" for case in ("one", "two")}
    assert {test["test_id"] for test in data["tests"]} == ids
    assert all(test["passed"] and test["loads"] for test in data["tests"])
    stored = json.loads(baseline.read_text())["baselines"]
    assert set(stored) == ids
    assert "baseline: wrote 2 entries" in result.stdout.str()
    FIGURES.fault("two servers starting at once (xdist)")
    print(f"[reliability] xdist: ports {one['port']} and {two['port']}, workers {one['worker']} and {two['worker']}")
