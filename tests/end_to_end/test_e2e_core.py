"""Core contract against real vLLM CPU servers: start, serve a load, classify a memory-starved startup, reject a bad
flag fast, reuse servers, leave no process. One inner session, two server startups."""

from __future__ import annotations

import json

import pytest
from e2e import record, run_inner

from pytest_vllm_mem.baseline.metrics import coalesced_load

pytestmark = pytest.mark.e2e

INNER = """
import os, time
from pathlib import Path
import pytest
from pytest_vllm_mem import VLLMConfig, VLLMStartupError

OK = VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)
# 2% of the host memory vLLM sees is less than its non-KV overhead: the CPU backend refuses to start.
STARVED = VLLMConfig("tiny", gpu_memory_utilization=0.02, max_model_len=1024)
PIDS = Path("pids.txt")

@pytest.mark.parametrize("vllm_config", [OK], ids=["A"])
def test_fits(vllm_server, vllm_load):
    PIDS.write_text(str(vllm_server.pid))
    assert vllm_server.url.startswith("http://127.0.0.1:")
    assert vllm_server.startup.ok and vllm_server.memory.kv_cache_tokens > 0
    result = vllm_load(num_prompts=48, concurrency=16, max_tokens=32)
    assert result.ok, result.errors

@pytest.mark.parametrize("vllm_config", [OK], ids=["again"])
def test_reused(vllm_server, vllm_load):
    assert str(vllm_server.pid) == PIDS.read_text()
    assert vllm_load(num_prompts=16, concurrency=4, max_tokens=16).ok

@pytest.mark.parametrize("vllm_config", [OK], ids=["bench"])
def test_benchmark_rounds(vllm_server, vllm_load, benchmark):
    assert vllm_load(num_prompts=16, concurrency=8, max_tokens=16, repeat=2).ok

def test_bad_flag_fails_fast(vllm_start):
    started = time.monotonic()
    with pytest.raises(VLLMStartupError) as error:
        vllm_start(VLLMConfig("tiny", swap_space=4))
    assert error.value.kind == "bad_flag"
    assert time.monotonic() - started < 5
    assert "--swap-space" in str(error.value)

def test_starved_is_classified_at_exit(vllm_start):
    with pytest.raises(VLLMStartupError) as error:
        vllm_start(STARVED)
    detected = time.time()
    assert error.value.kind == "host_memory"
    exited = os.path.getmtime(error.value.log_path)  # the server's last log write: when it died
    Path("detect_delay.txt").write_text(f"{detected - exited:.2f}")
    assert detected - exited < 5

@pytest.mark.parametrize("vllm_config", [STARVED], ids=["starved"])
def test_starved_fails_the_test(vllm_server):
    pass
"""


def test_core_contract(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    bench = pytester.path / "bench.json"
    result, data = run_inner(pytester, f"--benchmark-json={bench}")
    result.assert_outcomes(passed=5, failed=1)
    output = result.stdout.str()

    # The starved config fails its test with kind, root cause, command line and next step, and no traceback.
    assert "vLLM startup failed [host_memory]" in output
    assert "Available memory on node" in output  # the root-cause line copied from vLLM's log
    assert "command: vllm serve" in output and "--gpu-memory-utilization 0.02" in output
    assert "next step: " in output
    assert "Traceback" not in output.split("short test summary")[0].split("test_starved_fails_the_test")[-1]

    fits = record(data, "test_fits[A]")
    metrics = fits["metrics"]
    load = fits["loads"][0]
    assert load["completed"] == 48 and load["failed"] == 0
    assert metrics["output_throughput"] > 0 and metrics["request_throughput"] > 0
    assert 0 < load["ttft_ms"]["p50"] <= load["ttft_ms"]["p99"]
    # A TPOT of 0 is a real reading when the starved client got a request's tokens in one read (metrics.coalesced_load).
    assert (load["tpot_ms"]["p50"] > 0 or coalesced_load(load)) and load["e2el_ms"]["p50"] > 0
    assert load["peak_memory_bytes"] > 100 * 2**20 and fits["startup"]["peak_memory_bytes"] > 100 * 2**20
    assert fits["memory"]["kv_cache_tokens"] > 0 and fits["memory"]["vllm_version"]
    assert fits["memory"]["kv_cache_blocks"] > 0  # from the server's /metrics: V1 logs no block count
    # Equal configs share one server: two failures and one healthy server means three startups would be a bug.
    assert data["server_startups"] == 2
    assert data["leaked_server_pids"] == []
    # pytest-benchmark saw the loads as rounds, with the serving figures attached.
    (benchmark,) = json.loads(bench.read_text())["benchmarks"]
    assert benchmark["stats"]["rounds"] == 2 and benchmark["extra_info"]["output_throughput"] > 0
    delay = float((pytester.path / "detect_delay.txt").read_text())
    print(f"failure detected {delay:.2f} s after the server's last log line")
