"""Faults on real vLLM CPU servers: pytest SIGKILLed during a startup and during a load (the lifeline stops every
server process and removes their /dev/shm segments), and two xdist workers asked to start a server on one device at
once (the per-device startup lock makes them take turns).

Three inner sessions: one cut short during a startup, one full startup cut during its load, two startups in turn;
about 3 minutes here. The same on stand-ins is in test_faults_unit.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from e2e import CACHE_DIR, TOKEN_VAR, SessionWatcher, processes_with_token, run_inner
from stubs.helpers import described, kill_quietly, popen_pytest, reap, running

from pytest_vllm_mem.launch import lifeline

pytestmark = pytest.mark.e2e

CONFIG = """
import json, os, time
from pathlib import Path
import psutil, pytest
from pytest_vllm_mem import VLLMConfig

A = VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)
"""

KILLED = (
    CONFIG
    + """
@pytest.mark.parametrize("vllm_config", [A], ids=["A"])
def test_killed(vllm_server, vllm_load):
    Path("loading").write_text(str(vllm_server.pid))
    vllm_load(num_prompts=100000, concurrency=8, max_tokens=64, timeout_s=600)
"""
)


def _shm(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes have mapped or open, read here from /proc (not through the plugin)."""
    found: set[str] = set()
    for pid in pids:
        try:
            found |= {
                line.split(None, 5)[5].strip()
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if "/dev/shm/" in line and len(line.split(None, 5)) == 6
            }
            found |= {
                os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd).startswith("/dev/shm/")
            }
        except OSError:
            continue
    return {path.removesuffix(" (deleted)") for path in found}


def _read(trace: Path) -> str:
    return trace.read_text() if trace.exists() else f"(the watchdog wrote no trace to {trace})"


def _ours(token: str, watcher: SessionWatcher, pytest_pid: int) -> list[psutil.Process]:
    """Every process of the inner session but pytest: servers (by token, and by session: vLLM's renamed engine shows
    no token), the lifeline's watchdog (it inherits the token)."""
    found = {proc.pid: proc for proc in processes_with_token(token)}
    found.update((proc.pid, proc) for proc in watcher.leftovers())
    found.pop(pytest_pid, None)
    return [proc for proc in found.values() if running([proc.pid])]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("phase", ["startup", "load"])
def test_sigkill_of_pytest_leaves_no_server_process_and_no_segment(pytester: pytest.Pytester, phase: str) -> None:
    """A runner's hard cancel or the OOM killer: SIGKILL to pytest, nothing of its servers may be left."""
    pytester.makepyfile(test_inner=KILLED)
    token = f"faults-{phase}-{os.getpid()}-{time.time_ns()}"
    trace = pytester.path / "lifeline.trace"  # what the watchdog did and when, for a failure message
    env = {**os.environ, TOKEN_VAR: token, lifeline.TRACE_VAR: str(trace)}
    log = pytester.path / "inner.log"
    before = set(os.listdir("/dev/shm"))
    seen: dict[int, psutil.Process] = {}
    segments: set[str] = set()
    with SessionWatcher(token) as watcher:
        process = popen_pytest(pytester.path, [f"--vllm-cache-dir={CACHE_DIR}", "-s"], env, log)
        try:
            deadline = time.monotonic() + 300
            while True:  # startup: until the engine runs; load: until the load has run for 2 s
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                procs = _ours(token, watcher, process.pid)
                seen.update((proc.pid, proc) for proc in procs)
                segments |= _shm(list(seen))
                if phase == "startup" and any("EngineCore" in described(proc) for proc in procs):
                    break
                if phase == "load" and (pytester.path / "loading").exists():
                    time.sleep(2)
                    break
                time.sleep(0.2)
            procs = _ours(token, watcher, process.pid)
            seen.update((proc.pid, proc) for proc in procs)
            segments |= _shm(list(seen))
            watchdogs = [proc.pid for proc in procs if "lifeline" in described(proc)]
            servers = [pid for pid in seen if pid not in watchdogs]
            killed = time.monotonic()
            process.send_signal(signal.SIGKILL)
            process.wait(10)
            deadline = killed + 30
            while running(servers) or _ours(token, watcher, process.pid):
                assert time.monotonic() < deadline, f"left 30 s after SIGKILL: {running(list(seen))}\n{_read(trace)}"
                time.sleep(0.05)
            processes_gone = time.monotonic() - killed
            while {path for path in segments if os.path.exists(path)}:
                assert time.monotonic() < deadline, (
                    f"segments left: {[p for p in segments if os.path.exists(p)]}\n{_read(trace)}"
                )
                time.sleep(0.05)
            segments_gone = time.monotonic() - killed
        finally:
            reap(process)  # killed if still running, and waited for: an unreaped Popen is a ResourceWarning
            kill_quietly(list(seen) + [proc.pid for proc in watcher.leftovers()])
    # Named semaphores (sem.mp-*) too: they are the resource tracker's to remove, and it does when it is killed last.
    new = sorted(set(os.listdir("/dev/shm")) - before)
    assert len(watchdogs) == 1, [described(psutil.Process(pid)) for pid in running(watchdogs)]
    assert len(servers) >= 3  # the API server, its engine, multiprocessing's resource tracker
    if phase == "load":  # a serving vLLM has its message queues in shared memory: the clean-up is needed
        assert any(path.startswith("/dev/shm/psm_") for path in segments), segments
    assert processes_with_token(token) == []
    assert processes_gone < 10 and segments_gone < 10, _read(trace)
    assert new == [], f"new in /dev/shm after the SIGKILL of pytest and its clean-up: {new}"
    print(
        f"[faults] SIGKILL of pytest during a {phase}: {len(servers)} server processes gone after "
        f"{processes_gone:.2f} s, {len(segments)} segments ({', '.join(sorted(segments))}) gone after "
        f"{segments_gone:.2f} s; new in /dev/shm since the start: {new or 'nothing'}"
    )


TURNS = (
    CONFIG
    + """
@pytest.mark.parametrize("vllm_config", [A], ids=["A"])
@pytest.mark.parametrize("case", ["one", "two"])
def test_turns(case, vllm_server, worker_id):
    Path(f"{case}.json").write_text(json.dumps({
        "worker": worker_id, "launched": vllm_server.started_at,
        "healthy": vllm_server.started_at + vllm_server.startup.duration_s, "log": str(vllm_server.log_path)}))
"""
)

_LOG_TIME = re.compile(r"(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d) ")


def _log_times(path: str) -> tuple[str, str]:
    """When vLLM wrote its first timestamped log line, and its last one before "Application startup complete"
    (MM-DD HH:MM:SS: one-second steps)."""
    first, healthy = "", ""
    for line in Path(path).read_text(errors="replace").splitlines():
        if "Application startup complete" in line:  # uvicorn's line has no time: the last one before it
            return first, healthy
        if match := _LOG_TIME.search(line):
            first, healthy = first or match.group(1), match.group(1)
    raise AssertionError(f"no startup-complete line after a timestamp in {path}")


def test_two_workers_asked_to_start_on_one_device_at_once_take_turns(pytester: pytest.Pytester) -> None:
    """vLLM #10643 and #55827: startups that overlap on one device mis-size each other's KV cache."""
    pytester.makepyfile(test_inner=TURNS)
    # This machine has no GPU: the CPU host is the device (startups on CPUs take turns only when asked).
    result, data = run_inner(pytester, "-n", "2", "--dist", "load", env={"PYTEST_VLLM_MEM_DEVICE_LOCK": "on"})
    result.assert_outcomes(passed=2)
    one, two = sorted(
        (json.loads((pytester.path / f"{case}.json").read_text()) for case in ("one", "two")),
        key=lambda server: server["launched"],
    )
    assert one["worker"] != two["worker"]
    # CLOCK_MONOTONIC is one clock for every process on the machine: the second launch came after the first
    # server was healthy, and its test's record says how long it waited.
    assert two["launched"] >= one["healthy"], (one, two)
    first_log, second_log = _log_times(one["log"]), _log_times(two["log"])
    assert second_log[0] >= first_log[1], (first_log, second_log)  # the logs agree
    waited = [note for test in data["tests"] for note in test.get("notes", []) if "waited" in note]
    assert len(waited) == 1 and "another server's startup on this device" in waited[0], data["tests"]
    print(
        f"[faults] two workers, one device: first server launched 0.00 s, healthy "
        f"{one['healthy'] - one['launched']:.2f} s; second launched {two['launched'] - one['launched']:.2f} s, "
        f"healthy "
        f"{two['healthy'] - one['launched']:.2f} s (logs {first_log[0]}..{first_log[1]} and "
        f"{second_log[0]}..{second_log[1]}); {waited[0]}"
    )
