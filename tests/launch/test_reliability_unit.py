"""Reliability without vLLM: faults, hangs, bad input and interruptions never hang the run, never leave a process
and never lose a result. Servers here are stubs (tests/stubs/) run through the stub interpreter `fake-python`: a
healthy OpenAI-style server that starts in well under a second, and one that never becomes healthy. The same
scenarios against real vLLM CPU servers are in test_e2e_reliability.py; load-time request errors (HTTP 5xx/4xx,
dropped connections, deadlines, aborts) are unit-tested in test_load.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from e2e import TOKEN_VAR, processes_with_token, record, run_inner
from stubs.helpers import (
    FAKE_PYTHON,
    STUB_ENV,
    Figures,
    kill_quietly,
    popen_pytest,
    running,
    stub_args,
    tree_pids,
    wait_gone,
)

from pytest_vllm_mem import VLLMConfig, VLLMStartupError
from pytest_vllm_mem.launch import server as server_module
from pytest_vllm_mem.launch.pool import ServerPool
from pytest_vllm_mem.launch.server import LaunchSettings, VLLMServer, free_port, launch, stop_all_servers
from pytest_vllm_mem.load.client import LoadSpec
from pytest_vllm_mem.load.measure import measured_load
from pytest_vllm_mem.memory import MemoryProbe, detect_device, make_probe

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_vllm_mem"
FIGURES = Figures()


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> Iterator[None]:
    yield
    print("\n" + FIGURES.summary("stub servers (test_reliability_unit.py)"))


@pytest.fixture(scope="module")
def probe() -> Iterator[MemoryProbe]:
    probe = make_probe(detect_device(0))
    yield probe
    probe.close()


@pytest.fixture
def stub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in STUB_ENV.items():
        monkeypatch.setenv(key, value)


def settings(tmp_path: Path, **overrides: Any) -> LaunchSettings:
    values: dict[str, Any] = {
        "python": str(FAKE_PYTHON),
        "log_dir": tmp_path / "logs",
        "startup_timeout_s": 30.0,
        "stop_grace_s": 5.0,
        "health_poll_s": 0.1,
    }
    return LaunchSettings(**{**values, **overrides})


def stub(name: str, **env: str) -> dict[str, str]:
    return {"VLLM_STUB": name, **env}


def listening_addresses(pids: Iterable[int]) -> set[str]:
    addresses: set[str] = set()
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    addresses.add(conn.laddr.ip)
        except psutil.Error:
            continue
    return addresses


# --- Safety: loopback only, no shell --------------------------------------------------------------------------------


def test_free_port_gives_distinct_usable_loopback_ports() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) >= 18  # the kernel may hand a port out again once it is closed, rarely
    for port in ports[:3]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free, and on the loopback interface


@pytest.mark.parametrize("value", ["$(touch /tmp/pwned)", "; rm -rf x", "a b\nc", "`id`", "' \" \\"])
def test_flag_values_stay_one_argv_item(value: str) -> None:
    args = VLLMConfig("m", chat_template=value, served_model_name=("x", value)).cli_args()
    assert args == ["--model", "m", "--chat-template", value, "--served-model-name", "x", value]


def test_the_package_never_starts_a_shell() -> None:
    for path in PACKAGE.glob("*.py"):
        source = path.read_text()
        for pattern in (r"shell\s*=\s*True", r"os\.system\(", r"os\.popen\(", r"\bpty\.spawn\("):
            assert not re.search(pattern, source), f"{path.name}: {pattern}"


def test_launch_binds_loopback_and_passes_hostile_values_unchanged(
    tmp_path: Path, probe: MemoryProbe, stub_env: None
) -> None:
    marker = tmp_path / "pwned"
    hostile = [f"$(touch {marker})", f"; touch {marker}; echo", f"`touch {marker}`"]
    config = VLLMConfig(
        "stub-model",
        env=stub("fake_server.py"),
        chat_template=hostile[0],
        served_model_name=hostile[1],
        hf_token=hostile[2],
    )
    server = launch(config, config, settings(tmp_path), probe)
    try:
        argv = psutil.Process(server.pid).cmdline()
        for value in hostile:
            assert value in argv  # one argv item each, exactly as written
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert listening_addresses(tree_pids(server.pid)) == {"127.0.0.1"}
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop(5)
    assert not marker.exists()
    FIGURES.fault("hostile flag values (shell injection)")


def test_an_interrupt_before_the_server_is_registered_stops_it(
    tmp_path: Path, probe: MemoryProbe, stub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or a CI cancel) right after the process started, while the watchdog is being told about it (the first
    launch starts the watchdog there): nothing has registered the server for cleanup yet, so launch stops it."""
    import pytest_vllm_mem.launch.server as server_module

    started: list[int] = []

    class Interrupted:
        def watch(self, pid: int) -> None:
            started.append(pid)
            raise KeyboardInterrupt

    monkeypatch.setattr(server_module, "lifeline", Interrupted)
    config = VLLMConfig("stub-model", env=stub("fake_server.py"))
    with pytest.raises(KeyboardInterrupt):
        launch(config, config, settings(tmp_path), probe)
    assert started and running(started) == []


# --- Hangs and stubborn processes -----------------------------------------------------------------------------------


def test_startup_hang_times_out_and_stops_the_whole_tree(tmp_path: Path, probe: MemoryProbe, stub_env: None) -> None:
    pids_file = tmp_path / "hang.pids"
    config = VLLMConfig("stub-model", env=stub("hang_server.py", HANG_PIDS_FILE=str(pids_file)))
    started = time.monotonic()
    with pytest.raises(VLLMStartupError) as error:
        launch(config, config, settings(tmp_path, startup_timeout_s=2.0), probe)
    elapsed = time.monotonic() - started
    pids = [int(pid) for pid in pids_file.read_text().split()]
    FIGURES.saw(pids)
    assert error.value.kind == "timeout"
    assert "did not become healthy within 2 s" in str(error.value)
    assert "waiting for a lock that is never released" in str(error.value)  # the log tail is quoted
    # The stub, its child in the group and its child in a session of its own: all stopped when launch() returns.
    assert running(pids) == []
    # Timeout + one health request + a prompt exit on SIGTERM, with a margin a busy machine cannot use up; a launch that
    # did not stop the tree would wait on the stub forever (it is also checked directly above).
    assert elapsed < 2.0 + 2.0 + 20.0
    FIGURES.fault("startup hang (in-process launch)", elapsed - 2.0)


def test_server_that_ignores_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path, probe: MemoryProbe, stub_env: None
) -> None:
    pids_file = tmp_path / "hang.pids"
    config = VLLMConfig("stub-model", env=stub("hang_server.py", HANG_PIDS_FILE=str(pids_file), HANG_IGNORE_TERM="1"))
    started = time.monotonic()
    with pytest.raises(VLLMStartupError):
        launch(config, config, settings(tmp_path, startup_timeout_s=1.0, stop_grace_s=1.0), probe)
    elapsed = time.monotonic() - started
    pids = [int(pid) for pid in pids_file.read_text().split()]
    FIGURES.saw(pids)
    assert running(pids) == []
    assert elapsed < 1.0 + 2.0 + 1.0 + 20.0  # the grace then SIGKILL; the stub itself never exits
    FIGURES.fault("server ignoring SIGTERM", elapsed - 1.0)


def test_stop_is_idempotent_and_quick_for_a_dead_server(tmp_path: Path, probe: MemoryProbe, stub_env: None) -> None:
    config = VLLMConfig("stub-model", env=stub("fake_server.py"))
    server = launch(config, config, settings(tmp_path), probe)
    os.killpg(server.pid, signal.SIGKILL)
    server.process.wait(5)
    started = time.monotonic()
    server.stop(30)
    server.stop(30)
    assert time.monotonic() - started < 15  # neither stop waited its 30 s grace on a dead server
    assert server.pid not in server_module._LIVE


# --- Startup figures -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("served", "expected"), [("4321", 4321), (None, None)])
def test_the_kv_cache_blocks_of_a_healthy_server_come_from_its_metrics(
    tmp_path: Path, probe: MemoryProbe, stub_env: None, served: str | None, expected: int | None
) -> None:
    """V1 logs no block count: the plugin reads vLLM's /metrics once the server is healthy (none served: None)."""
    config = VLLMConfig("stub-model", env=stub("fake_server.py", **({"FAKE_KV_BLOCKS": served} if served else {})))
    server = launch(config, config, settings(tmp_path), probe)
    try:
        assert server.memory is not None and server.memory.kv_cache_blocks == expected
    finally:
        server.stop(5)


# --- Ports ----------------------------------------------------------------------------------------------------------


def test_a_taken_port_is_retried_on_a_fresh_one(
    tmp_path: Path, probe: MemoryProbe, stub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(server_module, "free_port", lambda: next(ports, None) or free_port())
        config = VLLMConfig("stub-model", env=stub("fake_server.py"))
        server = launch(config, config, settings(tmp_path), probe)
        try:
            assert server.port != taken and server.alive()
            assert any(f"port {taken} was taken" in note for note in server.notes)
        finally:
            server.stop(5)
    FIGURES.fault("port taken between free_port() and the server's bind")


def test_a_port_that_stays_taken_fails_as_a_crash_naming_the_port_error(
    tmp_path: Path, probe: MemoryProbe, stub_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: the bind fails, health probes are refused at once
        monkeypatch.setattr(server_module, "free_port", lambda: held.getsockname()[1])
        config = VLLMConfig("stub-model", env=stub("fake_server.py"))
        with pytest.raises(VLLMStartupError) as error:
            launch(config, config, settings(tmp_path), probe)
    assert error.value.kind == "crash"
    assert "Address already in use" in str(error.value)
    assert len(list((tmp_path / "logs").iterdir())) == server_module.PORT_ATTEMPTS


# --- Engine death ---------------------------------------------------------------------------------------------------


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_dead_engine_fails_the_load_at_once_and_the_pool_replaces_the_server(
    tmp_path: Path, probe: MemoryProbe, stub_env: None
) -> None:
    """vLLM's API server outlives its EngineCore by about a second, answering 500s: the server counts as dead as
    soon as its engine is, so the load stops and is diagnosed, and the pool never hands the server out again."""
    config = VLLMConfig("stub-model", env=stub("fake_server.py"))
    pool = ServerPool(settings(tmp_path), probe)
    server = pool.acquire(config, config, {})
    assert isinstance(server, VLLMServer)  # a local pool's server
    engine = sleeper()  # stands in for VLLM::EngineCore, which the stub does not have
    server.engine_processes = [psutil.Process(engine.pid)]
    FIGURES.saw([server.pid, engine.pid])
    killed: dict[str, float] = {}

    def kill_engine() -> None:
        time.sleep(0.5)
        killed["at"] = time.monotonic()
        engine.kill()

    threading.Thread(target=kill_engine, daemon=True).start()
    try:
        result = measured_load(server, LoadSpec(num_prompts=3000, concurrency=16, max_tokens=64, timeout_s=60))
        returned = time.monotonic()
        engine.wait(5)
        assert result.failure is not None and result.failure.kind == "crash"
        assert not result.server_alive and result.completed < 3000
        assert returned - killed["at"] < 2.0
        FIGURES.fault("engine killed during a load (stub)", returned - killed["at"])

        replacement = pool.acquire(config, config, {})
        assert replacement.pid != server.pid and replacement.alive()
        assert running([server.pid]) == []  # the broken one was stopped, not just forgotten
    finally:
        kill_quietly([engine.pid])
        pool.release_all()


def test_live_registry_lock_is_reentrant_for_the_sigterm_handler() -> None:
    """The SIGTERM handler stops servers on the main thread, which may be inside `with _LIVE_LOCK` already."""
    code = "from pytest_vllm_mem.launch import server\nwith server._LIVE_LOCK:\n    server.stop_all_servers()\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def test_stop_all_servers_reports_only_live_ones(tmp_path: Path, probe: MemoryProbe, stub_env: None) -> None:
    config = VLLMConfig("stub-model", env=stub("fake_server.py"))
    server = launch(config, config, settings(tmp_path), probe)
    assert stop_all_servers(grace_s=5) == [server.pid]
    assert running([server.pid]) == [] and stop_all_servers(grace_s=5) == []


# --- Inner pytest sessions on stubs ---------------------------------------------------------------------------------

STUB_CONFIGS = """
import os
from pathlib import Path
import pytest
from pytest_vllm_mem import VLLMConfig, VLLMStartupError
from pytest_vllm_mem.plugin.state import state_key

OK = VLLMConfig("stub-model", env={"VLLM_STUB": "fake_server.py"}, max_model_len=1024)
HANG = VLLMConfig("stub-model", env={"VLLM_STUB": "hang_server.py", "HANG_PIDS_FILE": os.path.abspath("hang.pids")},
                  max_model_len=1024)
"""


def inner(
    pytester: pytest.Pytester, body: str, *args: str, timeout: float = 120
) -> tuple[pytest.RunResult, dict[str, Any]]:
    pytester.makepyfile(test_inner=STUB_CONFIGS + body)
    return run_inner(pytester, *stub_args(pytester.path / "cache"), *args, env=STUB_ENV, timeout=timeout)


def test_hang_at_startup_fails_the_test_as_timeout_with_the_log_tail(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [HANG], ids=["hang"])
def test_hangs(vllm_server):
    pass
"""
    started = time.monotonic()
    result, data = inner(pytester, body, "--vllm-startup-timeout=5")
    elapsed = time.monotonic() - started
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "vLLM startup failed [timeout]" in output and "did not become healthy within 5 s" in output
    assert "waiting for a lock that is never released" in output
    assert "Traceback" not in output
    assert record(data, "test_hangs[hang]")["failure"]["kind"] == "timeout"
    pids = [int(pid) for pid in (pytester.path / "hang.pids").read_text().split()]
    FIGURES.saw(pids)
    assert running(pids) == []  # run_inner checked the token too; this names the three stub processes
    assert elapsed < 20
    FIGURES.fault("startup hang (inner session, --vllm-startup-timeout=5)", elapsed - 5)


def interrupt_inner(
    pytester: pytest.Pytester, sig: signal.Signals, body: str, pid_files: list[str], *args: str
) -> tuple[int, str, float, list[int]]:
    """Start an inner pytest, wait until every stub in `pid_files` runs, send `sig` to pytest (only to it, as a CI
    runner does); returns (exit code, output, seconds until the stubs were gone, their pids)."""
    pytester.makepyfile(test_inner=STUB_CONFIGS + body)
    token = f"interrupt-{os.getpid()}-{sig}-{time.time_ns()}"
    # Startups not serialized per device (devicelock): the xdist case needs two stubs hanging in startup at once.
    env = {**os.environ, **STUB_ENV, TOKEN_VAR: token, "PYTEST_VLLM_MEM_DEVICE_LOCK": "off"}
    log = pytester.path / "inner.log"
    process = popen_pytest(
        pytester.path, [*stub_args(pytester.path / "cache"), "--vllm-startup-timeout=120", *args], env, log
    )
    files = [pytester.path / name for name in pid_files]
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not all(path.exists() and path.read_text().strip() for path in files):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        pids = [int(pid) for path in files for pid in path.read_text().split()]
        FIGURES.saw(pids)
        time.sleep(0.5)  # well into the health polling
        sent = time.monotonic()
        process.send_signal(sig)
        gone = wait_gone(pids, 30)
        code = process.wait(30)
        print(f"[reliability] {sig.name}: pytest exited {time.monotonic() - sent:.2f} s after the signal")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)  # reaped here: a Popen left running warns in whichever test collects it
        kill_quietly(pids + [p.pid for p in processes_with_token(token)])
    assert processes_with_token(token) == []
    return code, log.read_text(), gone, pids


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_pytest_during_startup_stops_the_server(pytester: pytest.Pytester, sig: signal.Signals) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [HANG], ids=["hang"])
def test_hangs(vllm_server):
    pass
"""
    code, output, gone, _ = interrupt_inner(pytester, sig, body, ["hang.pids"])
    assert code == pytest.ExitCode.INTERRUPTED, output
    assert "KeyboardInterrupt" in output
    FIGURES.fault(f"{sig.name} to pytest during a server startup (stub)", gone)


def test_sigterm_to_the_xdist_controller_stops_every_workers_server(pytester: pytest.Pytester) -> None:
    """CI cancels the job: SIGTERM reaches the controller only, the workers' servers must still stop."""
    body = """
@pytest.mark.parametrize("case", ["a", "b"])
def test_hangs(case, vllm_start):
    vllm_start(HANG.with_env(HANG_PIDS_FILE=os.path.abspath(f"{case}.pids")))
"""
    code, output, gone, pids = interrupt_inner(pytester, signal.SIGTERM, body, ["a.pids", "b.pids"], "-n", "2")
    assert code == pytest.ExitCode.INTERRUPTED, output
    assert len(pids) == 6
    assert gone < 4  # forwarded to the workers at once, not left to execnet (interrupt after 5 s, kill after 10 s)
    FIGURES.fault("SIGTERM to the xdist controller during two server startups (stub)", gone)


def test_raise_or_pytest_exit_after_getting_a_server_leaves_no_process(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_raises(vllm_server):
    Path("server.pid").write_text(str(vllm_server.pid))
    raise RuntimeError("boom")

@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_exits(vllm_server):
    assert str(vllm_server.pid) == Path("server.pid").read_text()
    pytest.exit("stop after getting a server")

def test_never_runs():
    pass
"""
    result, data = inner(pytester, body)
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "stop after getting a server" in output and "test_never_runs" not in output.split("short test summary")[-1]
    pid = int((pytester.path / "server.pid").read_text())
    FIGURES.saw([pid])
    assert running([pid]) == []
    assert record(data, "test_raises[ok]")["startup"]["ok"]  # the results were written despite the exit
    FIGURES.fault("test raises after getting a server")
    FIGURES.fault("pytest.exit() after getting a server")


def test_session_end_sweep_stops_a_server_nobody_holds(pytester: pytest.Pytester) -> None:
    body = """
def test_orphan(vllm_start, request):
    server = vllm_start(OK)
    Path("orphan.pid").write_text(str(server.pid))
    request.config.stash[state_key].pool.running.clear()  # now only the session-end sweep can stop it
"""
    result, data = inner(pytester, body)
    result.assert_outcomes(passed=1)
    pid = int((pytester.path / "orphan.pid").read_text())
    FIGURES.saw([pid])
    assert f"stopped 1 vLLM server(s) still running at session end: pids [{pid}]" in result.stdout.str()
    assert data["leaked_server_pids"] == [pid]
    assert running([pid]) == []
    FIGURES.fault("server left running at session end (sweep)")


# --- Bad input: one clear message, no traceback, no server ---------------------------------------------------------


def assert_no_traceback(result: pytest.RunResult) -> str:
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output and "pytest_vllm_mem/" not in output, output
    return output


def test_unknown_flag_fails_fast_as_bad_flag(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [OK.with_flags(max_model_length=1024)], ids=["typo"])
def test_typo(vllm_server):
    pass
"""
    started = time.monotonic()
    result, data = inner(pytester, body)
    result.assert_outcomes(failed=1)
    output = assert_no_traceback(result)
    assert "vLLM startup failed [bad_flag]" in output
    assert "--max-model-length is not a flag of vLLM 0.0.0-stub (did you mean --max-model-len?)" in output
    assert not (pytester.path / ".vllm-mem" / "logs").exists()  # rejected before any server started
    assert data["server_startups"] == 0 and time.monotonic() - started < 15
    FIGURES.fault("unknown vLLM flag")


def test_missing_model_folder_is_named(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [VLLMConfig("/nonexistent/model-dir")], ids=["missing"])
def test_missing(vllm_server):
    pass
"""
    result, data = inner(pytester, body)
    result.assert_outcomes(failed=1)
    output = assert_no_traceback(result)
    assert "model folder /nonexistent/model-dir does not exist" in output
    assert data["server_startups"] == 0
    FIGURES.fault("missing model folder")


def test_corrupt_baseline_names_the_file(pytester: pytest.Pytester) -> None:
    baseline = pytester.path / "baselines.json"
    baseline.write_text('{"baselines": {<<<<<<< HEAD')
    body = """
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_serves(vllm_server, vllm_load):
    assert vllm_load(num_prompts=4, concurrency=2, max_tokens=4).ok
"""
    result, _ = inner(pytester, body, f"--vllm-baseline={baseline}")
    result.assert_outcomes(failed=1)
    output = assert_no_traceback(result)
    assert f"Baseline file {baseline} is not valid JSON" in output
    assert baseline.read_text() == '{"baselines": {<<<<<<< HEAD'  # left as it was
    FIGURES.fault("corrupt baseline file")


def test_unwritable_results_path_is_one_line_and_fails_the_run(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_serves(vllm_server, vllm_load):
    assert vllm_load(num_prompts=4, concurrency=2, max_tokens=4).ok
"""
    result, _ = inner(pytester, body, "--vllm-results=/proc/forbidden/x.json")
    result.assert_outcomes(passed=1)
    # The tests ran, but CI would lose the figures silently: the run fails (issue 12).
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    output = assert_no_traceback(result)
    assert "the run fails: a file it was asked to write was not written" in output
    lines = [line for line in output.splitlines() if "/proc/forbidden/x.json" in line]
    assert lines == [
        "error: --vllm-results /proc/forbidden/x.json: could not write the file (No such file or "
        "directory); pass a path in a writable folder"
    ]  # and not listed as written
    FIGURES.fault("results path cannot be written")


def test_unwritable_log_folder_is_one_message(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_serves(vllm_server):
    pass
"""
    result, _ = inner(pytester, body, "--vllm-log-dir=/proc/forbidden/logs")
    result.assert_outcomes(errors=1)
    output = assert_no_traceback(result)
    assert "Cannot write the server log in /proc/forbidden/logs" in output and "--vllm-log-dir" in output
    FIGURES.fault("server log folder cannot be written")


def test_unknown_metric_in_tolerance_marker_is_a_usage_error_before_any_server(pytester: pytest.Pytester) -> None:
    body = """
@pytest.mark.vllm_tolerance(output_troughput="5%")
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_serves(vllm_server):
    pass
"""
    result, _ = inner(pytester, body)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = assert_no_traceback(result)
    assert "@pytest.mark.vllm_tolerance on test_inner.py::test_serves[ok]" in output
    assert "unknown metric 'output_troughput'" in output
    assert not (pytester.path / ".vllm-mem" / "logs").exists()
    FIGURES.fault("unknown metric in @pytest.mark.vllm_tolerance")


@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/false"])
def test_interpreter_without_vllm_is_one_message(pytester: pytest.Pytester, python: str) -> None:
    pytester.makepyfile(
        test_inner=STUB_CONFIGS
        + """
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_serves(vllm_server):
    pass
"""
    )
    result, _ = run_inner(pytester, f"--vllm-python={python}", f"--vllm-cache-dir={pytester.path / 'empty-cache'}")
    result.assert_outcomes(errors=1)
    output = assert_no_traceback(result)
    assert f"Could not read vLLM's argument parser with {python}" in output
    FIGURES.fault(f"--vllm-python without vLLM ({python})")


def test_secrets_never_reach_reports_messages_or_results(pytester: pytest.Pytester) -> None:
    body = """
SECRET_ENV = VLLMConfig("stub-model", env={"HF_TOKEN": "secret123", "VLLM_STUB": "fake_server.py"}, no_such_flag=1)
SECRET_FLAG = HANG.with_flags(hf_token="secret456")

@pytest.mark.parametrize("vllm_config", [SECRET_ENV], ids=["env"])
def test_env_secret(vllm_server):
    pass

@pytest.mark.parametrize("vllm_config", [SECRET_FLAG], ids=["flag"])
def test_flag_secret(vllm_server):
    pass
"""
    result, data = inner(pytester, body, "--vllm-startup-timeout=3")
    result.assert_outcomes(failed=2)
    output = result.stdout.str() + result.stderr.str()
    assert "HF_TOKEN='***'" in output and "--hf-token '***'" in output
    dumped = json.dumps(data)
    for secret in ("secret123", "secret456"):
        assert secret not in output and secret not in dumped
    FIGURES.fault("secrets in env and flags")


def test_each_server_and_load_shape_is_warmed_up_once_before_its_first_measured_load(pytester: pytest.Pytester) -> None:
    """One unmeasured wave (measure.warm_up) before the first load of each shape on a server: the server's access
    log counts every request, the results JSON only the measured ones."""
    body = """
@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_loads(vllm_server, vllm_load):
    assert vllm_load(num_prompts=6, concurrency=2, max_tokens=2, repeat=2).ok  # warm-up of 2, then 6 and 6
    assert vllm_load(num_prompts=5, concurrency=3, max_tokens=2).ok  # another shape: warm-up of 3, then 5
    Path("log.txt").write_text(str(vllm_server.log_path))

@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_reused(vllm_server, vllm_load):
    assert vllm_load(num_prompts=4, concurrency=2, max_tokens=2).ok  # the same server and shape: no warm-up
"""
    result, data = inner(pytester, body)
    result.assert_outcomes(passed=2)
    log = Path((pytester.path / "log.txt").read_text()).read_text()
    assert log.count('"POST /v1/completions HTTP/1.1" 200 OK') == 2 + 6 + 6 + 3 + 5 + 4
    completed = [load["completed"] for test in data["tests"] for load in test["loads"]]
    assert completed == [6, 6, 5, 4]
