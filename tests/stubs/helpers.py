"""Shared by the reliability tests: the stub interpreter and its flag table, process checks, and the figures the
tests print (fault scenarios covered, time from fault to failed test, processes left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import psutil

STUBS = Path(__file__).resolve().parent
FAKE_PYTHON = STUBS / "fake-python"  # --vllm-python: `-c` goes to the real interpreter, a launch to a stub
STUB_ENV = {"VLLM_STUB_PYTHON": sys.executable}  # the environment an inner session needs to run the stubs

# The flags the stub configs use, as vLLM's parser describes them (see flagcheck._DUMP_SCRIPT).
_STUB_FLAGS = {
    "--max-model-len": {"takes_value": True, "optional_value": False, "choices": None},
    "--gpu-memory-utilization": {"takes_value": True, "optional_value": False, "choices": None},
    "--served-model-name": {"takes_value": True, "optional_value": False, "choices": None},
    "--chat-template": {"takes_value": True, "optional_value": False, "choices": None},
    "--hf-token": {"takes_value": True, "optional_value": True, "choices": None},
    "--enforce-eager": {"takes_value": False, "optional_value": False, "choices": None},
}


def ensure_stub_executable() -> None:
    """A checkout or an archive can drop the executable bit; --vllm-python must be executable."""
    if not os.access(FAKE_PYTHON, os.X_OK):
        FAKE_PYTHON.chmod(0o755)


def seed_flag_table(cache_dir: Path) -> Path:
    """Write the stub interpreter's flag table where flagcheck looks for it, so that a stub session never imports
    vLLM (which takes seconds and needs vLLM installed). Without the seed the stub delegates `-c` to the real
    interpreter, which still works, only slower."""
    from pytest_vllm_mem.launch.flagcheck import _TABLE_FORMAT, _install_fingerprint

    ensure_stub_executable()
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"vllm-options-v{_TABLE_FORMAT}-{_install_fingerprint(str(FAKE_PYTHON))}.json"
    path.write_text(
        json.dumps({"version": "0.0.0-stub", "options": _STUB_FLAGS, "defaults": {"gpu_memory_utilization": 0.9}})
    )
    return path


def stub_args(cache_dir: Path) -> list[str]:
    """Inner-session options that run every server through the stubs (they come after run_inner's own options:
    the last --vllm-cache-dir wins). No confirmation on fresh servers: a stub's timings are noise (TTFT of a few ms),
    so a comparison may read suspect, and each confirmation session waits up to 60 s for a runner busy with the other
    xdist worker to quiet down: in a fresh-clone CI run test_paths' second inner run timed out at 120 s that way.
    Confirmation is tested in tests/plugin/test_gate.py and on real servers in test_e2e_gate.py."""
    seed_flag_table(cache_dir)
    return [f"--vllm-python={FAKE_PYTHON}", f"--vllm-cache-dir={cache_dir}", "--vllm-confirm-sessions=0"]


def running(pids: Iterable[int]) -> list[int]:
    """The pids that still run (zombies do not count: they hold nothing but a process-table entry)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.Error:
            continue
    return alive


def described(proc: psutil.Process) -> str:
    """A process's name and command line, or "" once it has exited: a listing of processes goes stale while it is read
    (a fresh-clone CI run failed on a compile helper that exited between the listing and its cmdline)."""
    try:
        return f"{proc.name()} {' '.join(proc.cmdline())}"
    except psutil.Error:
        return ""


def wait_gone(pids: Collection[int], timeout_s: float) -> float:
    """Seconds until none of `pids` runs; raises AssertionError naming the survivors after `timeout_s`."""
    started = time.monotonic()
    while running(pids):
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"processes still running after {timeout_s} s: {running(pids)}")
        time.sleep(0.05)
    return time.monotonic() - started


def tree_pids(root: int) -> list[int]:
    try:
        return [root, *(child.pid for child in psutil.Process(root).children(recursive=True))]
    except psutil.Error:
        return [root]


def kill_quietly(pids: Iterable[int]) -> None:
    """Stop leftovers by pid (a failed test must not leave them to the next one)."""
    for pid in running(pids):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def reap(process: subprocess.Popen[Any]) -> None:
    """Kill `process` (if still running), wait for it and close its pipes: a Popen left unwaited, or with a pipe
    open, is a ResourceWarning when collected, which filterwarnings = error turns into a failure of whichever test
    is running then."""
    process.kill()
    with process:  # Popen.__exit__ closes stdout, stderr and stdin, then waits
        pass


def popen_pytest(cwd: Path, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """An inner pytest we can signal ourselves (pytester's runners cannot be interrupted mid-run). SIGINT is reset to
    its default in it: a suite started in the background by a shell without job control (`bash .ci/run &`) inherits
    SIGINT ignored, and Python then never turns a SIGINT into KeyboardInterrupt, so a Ctrl-C test would test nothing
    (it failed that way in two background CI runs of this suite)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=default_sigint,
        )


def default_sigint() -> None:
    """preexec_fn: the child turns SIGINT into KeyboardInterrupt, whatever this process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Figures:
    """What the reliability tests measured, for docs/reliability.md: fault scenarios, fault-to-failure times, leftovers.

    Every pid a test saw is remembered; `left()` says which of them still run (the suite's end figure)."""

    def __init__(self) -> None:
        self.scenarios: dict[str, float | None] = {}
        self.pids: set[int] = set()

    def fault(self, name: str, seconds: float | None = None) -> None:
        self.scenarios[name] = seconds
        if seconds is not None:
            print(f"[reliability] {name}: {seconds:.2f} s from fault to failed test / stopped processes")

    def saw(self, pids: Iterable[int | str]) -> None:
        self.pids.update(int(pid) for pid in pids)

    def left(self) -> list[int]:
        return running(self.pids)

    def summary(self, title: str) -> str:
        timed = {name: s for name, s in self.scenarios.items() if s is not None}
        longest = max(timed.items(), key=lambda item: item[1]) if timed else ("-", 0.0)
        return (
            f"[reliability] {title}: {len(self.scenarios)} fault scenarios tested; longest time from fault to "
            f"failed test {longest[1]:.2f} s ({longest[0]}); processes left after the tests: {len(self.left())} "
            f"(of {len(self.pids)} seen)"
        )
