"""The server's CPU time per load (memory.process_tree) and the figure made of it (LoadResult.cpu_ms_per_token):
real processes, measured with the kernel's own accounting."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from stubs.helpers import reap

from pytest_vllm_mem.load.client import LoadResult, Percentiles
from pytest_vllm_mem.memory import cpu_seconds_between, tree_cpu_times

# A "server" whose child burns CPU for the seconds given, then both sleep.
BURNER = """
import os, sys, time
if os.fork() == 0:
    end = time.process_time() + float(sys.argv[1])
    while time.process_time() < end:
        pass
    print("done", flush=True)
    time.sleep(600)
time.sleep(600)
"""


def test_the_cpu_time_a_tree_spent_between_two_readings_counts_its_children() -> None:
    server = subprocess.Popen([sys.executable, "-c", BURNER, "0.6"], stdout=subprocess.PIPE)
    try:
        time.sleep(0.2)  # the child exists
        before = tree_cpu_times(server.pid)
        assert server.stdout is not None and server.stdout.readline().strip() == b"done"
        after = tree_cpu_times(server.pid)
        spent = cpu_seconds_between(before, after)
        assert len(after) == 2 and spent is not None
        # The child burnt 0.6 s of CPU from its start; part of it before the first reading.
        assert 0.2 < spent <= 0.75, spent
    finally:
        for proc in psutil.Process(server.pid).children(recursive=True):
            proc.kill()
        reap(server)


def test_a_process_lost_between_readings_or_a_gone_server_gives_no_figure() -> None:
    assert cpu_seconds_between({}, {1: 2.0}) is None
    assert cpu_seconds_between({1: 1.0, 2: 1.0}, {1: 2.0}) is None  # pid 2's time left with it
    assert cpu_seconds_between({1: 1.0}, {1: 1.5, 3: 0.25}) == pytest.approx(0.75)  # pid 3 started since
    assert tree_cpu_times(2**22 + 12345) == {}


def _result(tokens: int, cpu_s: float | None) -> LoadResult:
    p = Percentiles(0.0, 0.0, 0.0, 0.0)
    return LoadResult(8, 8, None, 8, 0, [], 1.0, 8.0, float(tokens), tokens, 0, p, p, p, p, server_cpu_s=cpu_s)


def test_cpu_per_token_is_server_cpu_milliseconds_per_generated_token() -> None:
    assert _result(4096, 9.6).cpu_ms_per_token == pytest.approx(9600 / 4096)
    assert _result(4096, 9.6).to_dict()["cpu_ms_per_token"] == pytest.approx(9600 / 4096)
    assert _result(4096, None).cpu_ms_per_token is None  # not measured (GPU backend)
    assert _result(0, 9.6).cpu_ms_per_token is None  # nothing generated
