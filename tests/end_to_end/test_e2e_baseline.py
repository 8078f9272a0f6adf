"""Baselines gate real regressions: record one with a real vLLM CPU server, then the same test id with a clearly
slower config fails for throughput, and with a config that takes clearly more memory fails for memory."""

from __future__ import annotations

import json

import pytest
from e2e import record, run_inner

pytestmark = pytest.mark.e2e

INNER = """
import os
import pytest
from pytest_vllm_mem import VLLMConfig

CASES = {
    "base": VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024),
    # One sequence at a time at concurrency 16: requests queue, output throughput collapses.
    "slow": VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024, max_num_seqs=1),
    # Three times the KV cache reservation: the server's resident memory grows by ~2x.
    "big": VLLMConfig("tiny", gpu_memory_utilization=0.3, max_model_len=1024),
}

@pytest.mark.parametrize("vllm_config", [CASES[os.environ["CASE"]]], ids=["serving"])
def test_serving(vllm_server, vllm_load):
    # Small loads: the slow case serves them one request at a time, and its collapse is far past any limit.
    assert vllm_load(num_prompts=24, concurrency=12, max_tokens=16, repeat=2).ok
"""


def test_baseline_gates_throughput_and_memory(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    baseline = pytester.path / "baselines.json"
    common = [f"--vllm-baseline={baseline}"]

    result, data = run_inner(pytester, *common, "--vllm-update-baseline", env={"CASE": "base"})
    result.assert_outcomes(passed=1)
    stored = json.loads(baseline.read_text())
    (entry,) = stored["baselines"]["test_inner.py::test_serving[serving]"].values()
    assert entry["runs"] == 2 and entry["metrics"]["output_throughput"] > 0
    assert len(entry["spread"]["output_throughput"]) == 2
    assert "baseline: wrote 1 entries" in result.stdout.str()

    result, data = run_inner(pytester, *common, env={"CASE": "slow"})
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "output_throughput" in output and "regressed" in output and "tolerance 10%" in output
    assert "baseline recorded" in output  # provenance
    assert record(data, "test_serving[serving]")["baseline_status"] == "compared"

    result, data = run_inner(pytester, *common, env={"CASE": "big"})
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "startup_peak_memory" in output and "regressed" in output
    # The baseline file was only read by the failing runs: still the one entry written by the first run.
    assert json.loads(baseline.read_text()) == stored
