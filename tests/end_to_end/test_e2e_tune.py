"""The tuner's command line against real vLLM CPU servers: it finds the boundary between a utilization that fails at
startup (the CPU backend refuses to start when utilization * memory is below the worker's non-KV memory) and one
that starts and serves, within a few startups, and leaves no server behind, also when interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from e2e import CACHE_DIR, TOKEN_VAR, processes_with_token
from stubs.helpers import default_sigint, reap

pytestmark = pytest.mark.e2e

MAX_STARTUPS = 5


def tune_command(tmp_path: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest_vllm_mem",
        "tune",
        "--model",
        "tiny",
        "--cache-dir",
        str(CACHE_DIR),
        "--log-dir",
        str(tmp_path / "logs"),
        *args,
    ]


def run_env(token: str) -> dict[str, str]:
    return {**os.environ, TOKEN_VAR: token, "PYTHONUNBUFFERED": "1"}


def assert_no_server_left(token: str) -> None:
    leftovers = processes_with_token(token)
    for proc in leftovers:  # stop them (by pid) before failing, so one bug does not poison the rest of the suite
        proc.kill()
    assert not leftovers, f"vLLM processes outlived the tuner: {[p.pid for p in leftovers]}"


def test_tuner_finds_the_startup_boundary_on_cpu(tmp_path: Path) -> None:
    # On the 8gb tier the grid is 0.01, 0.09, 0.17, 0.25: 0.01 (80 MB) surely fails, 0.17 (1.36 GB) surely
    # starts; 0.09 (720 MB) sits near the ~0.75 GiB the tiny model's worker uses before its KV cache.
    token = uuid.uuid4().hex
    out = tmp_path / "tune.json"
    command = tune_command(
        tmp_path,
        "--tier",
        "8gb",
        "--low",
        "0.01",
        "--high",
        "0.25",
        "--resolution",
        "0.08",
        "--max-startups",
        str(MAX_STARTUPS),
        "--flag",
        "max_model_len=1024",
        "--num-prompts",
        "16",
        "--concurrency",
        "4",
        "--max-tokens",
        "8",
        "--json",
        str(out),
    )
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=run_env(token), capture_output=True, text=True, timeout=480)
    finally:
        assert_no_server_left(token)
    elapsed = time.monotonic() - started
    output = done.stdout
    print(output, done.stderr[-2000:], f"tuner took {elapsed:.0f} s", sep="\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr

    data = json.loads(out.read_text())
    trials = data["trials"]
    # A trial the plan can decide (a share smaller than the worker's non-KV memory) costs no startup. How many the
    # plan decides depends on the machine's memory node (8.8 to 23.5 GiB seen): on a large node it decides every
    # failing trial and only the working ones start. The contract: the search needs a failing and a working trial,
    # at least one of them a real startup, and counts startups apart from planned trials.
    started_trials = [t for t in trials if t["phase"] != "planned"]
    assert len(trials) >= 2 and 1 <= len(started_trials) <= MAX_STARTUPS, trials
    assert data["startups"] == len(started_trials)
    assert data["planned_trials"] == len(trials) - len(started_trials)
    failing = [t for t in trials if t["outcome"] != "ok"]
    working = [t for t in trials if t["outcome"] == "ok"]
    assert any(t["outcome"] == "host_memory" and t["side"] == "too_low" for t in failing), trials
    assert working and all(t["kv_cache_tokens"] > 0 and t["output_throughput"] > 0 for t in working)
    recommended = data["recommended_utilization"]
    assert recommended == min(t["gpu_memory_utilization"] for t in working)  # CPU: the lowest working value
    assert all(t["gpu_memory_utilization"] < recommended for t in failing)
    assert data["converged"] and data["first_failing_utilization"] < recommended
    assert data["goal"] == "lowest" and data["tier"] == "8gb"
    assert 0 < data["headroom_bytes"] < 8 * 10**9

    # Progress: a "starting trial" line before each result line, then the boundary and the recommended command.
    lines = output.splitlines()
    for number in range(1, len(trials) + 1):
        start = lines.index(
            next(line for line in lines if line.startswith(f"starting trial {number}/{MAX_STARTUPS}: "))
        )
        result = lines.index(next(line for line in lines if line.startswith(f"trial {number}/{MAX_STARTUPS}  ")))
        assert start < result
    assert "tier emulation: each value is scaled by" in output
    assert "host_memory" in output
    # Failed at a real startup, or decided by the plan without one (both name the share and what uses it up).
    assert (
        "at startup: the worker's share of host memory" in output
        or "at startup: planned, no startup: the worker's non-KV memory" in output
    ), output
    assert f"recommended: vllm serve tiny --max-model-len 1024 --gpu-memory-utilization {recommended:g}" in output
    assert "of the 8gb tier = " in output and "GiB free)" in output


def test_interrupted_tuner_stops_its_server_and_exits_130(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    command = tune_command(
        tmp_path, "--low", "0.2", "--high", "0.3", "--resolution", "0.1", "--flag", "max_model_len=1024"
    )
    process = subprocess.Popen(
        command,
        env=run_env(token),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,  # a Ctrl-C test needs SIGINT handled, also when the suite inherited it ignored
    )
    assert process.stdout is not None
    try:
        for line in process.stdout:  # wait for the first startup to begin, then for its server processes
            if line.startswith("starting trial 1/"):
                break
        # The tuner, the API server and its EngineCore: interrupt once the server has children of its own.
        deadline = time.monotonic() + 120
        while len(processes_with_token(token)) < 3:
            assert time.monotonic() < deadline and process.poll() is None, "the trial's server never started"
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        _stdout, stderr = process.communicate(timeout=90)
    finally:
        reap(process)  # killed if still running, its pipes closed and waited for (else a ResourceWarning)
        assert_no_server_left(token)
    assert process.returncode == 130, stderr[-3000:]
    assert "interrupted: the running server was stopped" in stderr
    assert "Traceback" not in stderr
