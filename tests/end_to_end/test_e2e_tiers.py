"""GPU memory tiers against real vLLM CPU servers: tier markers skip or run, emulating a small tier shrinks the KV
cache vLLM plans, and a server whose peak exceeds the tier fails its test. Three server startups."""

from __future__ import annotations

import pytest
from e2e import record, run_inner

pytestmark = pytest.mark.e2e

INNER = """
import pytest
from pytest_vllm_mem import VLLMConfig

SAME = VLLMConfig("tiny", gpu_memory_utilization=0.15, max_model_len=1024)
# 0.45 of a 2 GB tier is 0.9 GB for vLLM's worker; the API server and engine core add ~1.2 GiB of host memory.
TIGHT = VLLMConfig("tiny", gpu_memory_utilization=0.45, max_model_len=1024)

@pytest.mark.parametrize("vllm_config", [SAME], ids=["same"])
def test_kv_tokens(vllm_server, vllm_load):
    assert vllm_load(num_prompts=8, concurrency=4, max_tokens=8).ok

@pytest.mark.vllm_tier("16gb")
def test_needs_16gb():
    pass

@pytest.mark.vllm_tier(max="4gb")
def test_small_cards_only():
    pass

@pytest.mark.vllm_tier("4gb")
@pytest.mark.parametrize("vllm_config", [SAME], ids=["same"])
def test_fits_4gb(vllm_server):
    pass

@pytest.mark.parametrize("vllm_config", [TIGHT], ids=["tight"])
def test_tight(vllm_server, vllm_load):
    assert vllm_load(num_prompts=8, concurrency=4, max_tokens=8).ok
"""


def test_tiers_skip_emulate_and_fail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)

    result, full = run_inner(pytester, "-k", "test_kv_tokens")
    result.assert_outcomes(passed=1)
    kv_full = record(full, "test_kv_tokens[same]")["memory"]["kv_cache_tokens"]

    result, small = run_inner(pytester, "--vllm-gpu=8gb", "-k", "not tight", "-rs")
    result.assert_outcomes(passed=2, skipped=2)
    output = result.stdout.str()
    assert "needs the 16gb tier; this run is on the 8gb tier" in output
    assert "only for tiers up to 4gb; this run is on the 8gb tier" in output
    emulated = record(small, "test_kv_tokens[same]")
    kv_small = emulated["memory"]["kv_cache_tokens"]
    # 0.15 of 8 GB vs 0.15 of the whole host: vLLM planned a much smaller KV cache under emulation.
    assert kv_small < kv_full * 0.8, (kv_small, kv_full)
    assert any("emulating the 8gb tier" in note for note in emulated["notes"])
    assert small["tier"] == "8gb" and emulated["tier"] == "8gb"
    assert small["server_startups"] == 1  # the 4gb-marked test reused the server
    print(f"KV cache tokens: {kv_full:,} on the whole host, {kv_small:,} emulating 8gb")

    result, tight = run_inner(pytester, "--vllm-gpu=2gb", "-k", "tight")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "exceeds the 2gb tier (1.86 GiB)" in output and "next step:" in output
    assert record(tight, "test_tight[tight]")["peak_memory_bytes"] > 2 * 10**9
