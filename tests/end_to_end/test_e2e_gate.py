"""A new user's first two runs through the gate on a real server: record a baseline with the defaults, run again with
the defaults, and the summary states the suite's false-alarm budget; a suspect verdict is re-measured on fresh
servers. The tiny model on the CPU backend, one server per run.

How often a healthy rerun fails is a rate, measured by the gate benchmark over collected sessions
(`benchmarks/gate_noise.py --targets`), not asserted here: on this 2-core runner a whole session can run with its
token delivery stalled (a token-interval median of 0 ms, TTFT p50 over 1 s, 1.7-2.3x the server CPU per token), and
4 of this test's 5 runs on 2026-12-02 failed a healthy rerun that way (tpot_p50 +63.6% and throughput -29.8%
confirmed on two fresh servers; ttft_p50 +183.5% confirmed; ttft_p50 +3384% at once, past reach); the CI run of
a8c007d failed on tpot_p50 +310% against a recording whose delivery had coalesced, whose latencies the gate now leaves
out (metrics.coalesced_load). What this test
asserts is the contract: memory figures agree, and a failure within reach of its limit comes only after the fresh
servers confirmed it."""

from __future__ import annotations

import json
import math

import pytest
from e2e import record, run_inner

from pytest_vllm_mem.baseline.metrics import coalesced_load
from pytest_vllm_mem.baseline.noise import NOISY_GATED

pytestmark = pytest.mark.e2e

NOISE_JUDGED = set(NOISY_GATED)
THROUGHPUT_ONLY = "--vllm-tolerance=ttft_p50=100000%,tpot_p50=100000%,cpu_per_token=100000%"

INNER = """
from pytest_vllm_mem import VLLMConfig
import pytest

@pytest.mark.parametrize("vllm_config", [VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)])
def test_serving(vllm_server, vllm_load):
    # The defaults (repeat=1), on the load shape the gate's noise model was measured with (benchmarks/gate_noise.py:
    # 64 prompts of 64 tokens at concurrency 8, 2-7 s here; a load of 32 x 32 tokens lasts 0.5-1.4 s).
    assert vllm_load(num_prompts=64, concurrency=8, max_tokens=64).ok
"""


def test_record_then_rerun_with_the_defaults(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    baseline = pytester.path / "baselines.json"
    result, data = run_inner(pytester, f"--vllm-baseline={baseline}", "--vllm-update-baseline")
    result.assert_outcomes(passed=1)
    (entry,) = json.loads(baseline.read_text())["baselines"]["test_inner.py::test_serving[vllm_config0]"].values()
    assert entry["runs"] == 1 and "kv_cache_memory" in entry["metrics"]
    # A recording whose token delivery coalesced (a stalled session) keeps no latency (metrics.coalesced_load).
    (recorded,) = record(data, "test_serving[vllm_config0]")["loads"]
    assert ("tpot_p50" in entry["metrics"]) is not coalesced_load(recorded), recorded["itl_ms"]

    result, data = run_inner(pytester, f"--vllm-baseline={baseline}")
    output = result.stdout.str()
    assert "noise-judged comparisons in 1 family" in output and "expected false failures per healthy run" in output
    compared = record(data, "test_serving[vllm_config0]")
    statuses = {c["metric"]: c["status"] for c in compared["comparisons"]}
    assert compared["baseline_status"] == "compared"
    assert statuses["kv_cache_memory"] == "ok" and statuses["kv_cache_tokens"] == "info"
    if compared["outcome"] == "ok":
        result.assert_outcomes(passed=1)
    else:  # a failure within reach of its limit only after the fresh servers confirmed it; beyond it, at once
        result.assert_outcomes(failed=1)
        failing = [c for c in compared["comparisons"] if c["status"] == "regressed"]
        assert failing and {c["metric"] for c in failing} <= NOISE_JUDGED | {"startup_peak_memory", "load_peak_memory"}
        # Whether a metric was within reach is read on the first session; the comparison shown is the final one, on
        # every session (CI: tpot_p50 +262% within reach on the first, +310% past it on all three).
        confirmations = [n for n in compared["notes"] if n.startswith("confirmation:")]
        if confirmations:  # suspect on the first session: decided on the fresh servers' sessions too
            (note,) = confirmations
            fresh = 2 if "on 2 fresh servers" in note else 1
            assert note.endswith("fails") and len(compared["loads"]) == 1 + fresh, compared["notes"]
        else:  # plain: a metric far past its limit decided the test on the first session
            assert any(not c["confirmable"] for c in failing) and len(compared["loads"]) == 1, compared["notes"]

    # A suspect verdict is re-measured on fresh servers (issue 25): the gate stops the server, starts the same config
    # anew for each confirmation session, runs the test's load there, and decides on all sessions. Sessions of one
    # healthy config scattered 0.44-2.6x each other on this runner, so the recorded throughput is made suspect for any
    # plausible session by construction: its median e^3.5 x the fastest session so far, its three runs e^-0.7, 1 and
    # e^0.7 times that. Their spread puts the suspect band (a pass worse at z >= 1.96, up to CONFIRM_REACH x the limit)
    # at log -6.0 to -2.5 of the median (noise.decide, one family): a third session 0.08-2.7x as fast as the fastest.
    # Latency and CPU per token are not gated in this run (tolerances of 100000%), so a stalled session's TTFT cannot
    # fail it plainly first. (A fixed 1.6x the first session failed in CI: a faster third session read a plain pass;
    # e^1 and e^0.6 x the fastest failed here when the third session ran 1.7x the earlier ones.)
    fastest = max(entry["metrics"]["output_throughput"], *(load["output_throughput"] for load in compared["loads"]))
    data = json.loads(baseline.read_text())
    (key,) = data["baselines"]["test_inner.py::test_serving[vllm_config0]"]
    entry = data["baselines"]["test_inner.py::test_serving[vllm_config0]"][key]
    factor = math.exp(3.5) * fastest / entry["metrics"]["output_throughput"]
    for name in ("output_throughput", "request_throughput"):
        entry["metrics"][name] *= factor
        entry["spread"][name] = [entry["metrics"][name] * math.exp(step) for step in (-0.7, 0.0, 0.7)]
    entry["runs"] = 3
    baseline.write_text(json.dumps(data))
    # One fresh server is the contract's smallest case, and one startup fewer on the CI's 2 cores.
    result, data = run_inner(pytester, f"--vllm-baseline={baseline}", THROUGHPUT_ONLY, "--vllm-confirm-sessions=1")
    confirmed = record(data, "test_serving[vllm_config0]")
    (note,) = [n for n in confirmed["notes"] if n.startswith("confirmation:")]
    assert "re-measured on 1 fresh server" in note and len(confirmed["loads"]) == 2
    assert f"suspect test re-measured on fresh servers: {int(note.endswith('passes'))} cleared" in result.stdout.str()
    result.assert_outcomes(passed=int(note.endswith("passes")), failed=int(note.endswith("fails")))
