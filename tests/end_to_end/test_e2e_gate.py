"""A new user's first two runs: record a baseline with the defaults, run again with the defaults, nothing fails, and
the summary states the suite's false-alarm budget (issue 25: a one-test suite failed on ttft_p50 +61.6%, "1 run vs
1, tolerance 20%"). One server per run, the tiny model on the CPU backend."""

from __future__ import annotations

import json
import math

import pytest
from e2e import record, run_inner

pytestmark = pytest.mark.e2e

INNER = """
from pytest_vllm_mem import VLLMConfig
import pytest

@pytest.mark.parametrize("vllm_config", [VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024)])
def test_serving(vllm_server, vllm_load):
    assert vllm_load(num_prompts=32, concurrency=8, max_tokens=32).ok  # the defaults: repeat=1
"""


def test_record_then_rerun_with_the_defaults_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    baseline = pytester.path / "baselines.json"
    result, _ = run_inner(pytester, f"--vllm-baseline={baseline}", "--vllm-update-baseline")
    result.assert_outcomes(passed=1)
    (entry,) = json.loads(baseline.read_text())["baselines"]["test_inner.py::test_serving[vllm_config0]"].values()
    assert entry["runs"] == 1 and "kv_cache_memory" in entry["metrics"]

    result, data = run_inner(pytester, f"--vllm-baseline={baseline}")
    result.assert_outcomes(passed=1)
    output = result.stdout.str()
    assert "noise-judged comparisons in 1 family" in output and "expected false failures per healthy run" in output
    compared = record(data, "test_serving[vllm_config0]")
    statuses = {c["metric"]: c["status"] for c in compared["comparisons"]}
    # "improved" is healthy too: in this session's third CI run the recording session was the slow one (the rerun
    # read +50.4% throughput, CPU per token -32.7%), and the gate rightly called it an improvement, not a failure.
    assert compared["baseline_status"] == "compared" and statuses["output_throughput"] in ("ok", "improved")
    assert statuses["kv_cache_memory"] == "ok" and statuses["kv_cache_tokens"] == "info"

    # A suspect verdict is re-measured on fresh servers (issue 25): the gate stops the server, starts the same config
    # anew for each confirmation session, runs the test's load there, and decides on all sessions. The recorded
    # throughput is raised by hand to e^1.0 (2.7x) the faster of the two sessions so far, so that a healthy third
    # session reads about -63%: the middle (log scale) of the suspect band of a one-run, one-family comparison, a
    # pass worse at z >= 1.96 (log 0.36 at the default session spread 0.13) up to CONFIRM_REACH x its limit (log 1.65).
    # The third session may then run about 0.53-1.85x as fast as the faster earlier one and still be suspect.
    # Raising the first session's figure by a fixed 1.6 failed in CI: the third session ran faster than the cold first
    # one (408, then 506 tok/s), read a plain pass and was never re-measured.
    fastest = max(entry["metrics"]["output_throughput"], compared["metrics"]["output_throughput"])
    data = json.loads(baseline.read_text())
    (key,) = data["baselines"]["test_inner.py::test_serving[vllm_config0]"]
    entry = data["baselines"]["test_inner.py::test_serving[vllm_config0]"][key]
    factor = math.e * fastest / entry["metrics"]["output_throughput"]
    for name in ("output_throughput", "request_throughput"):
        entry["metrics"][name] *= factor
        entry["spread"][name] = [value * factor for value in entry["spread"][name]]
    baseline.write_text(json.dumps(data))
    result, data = run_inner(pytester, f"--vllm-baseline={baseline}")
    confirmed = record(data, "test_serving[vllm_config0]")
    (note,) = [n for n in confirmed["notes"] if n.startswith("confirmation:")]
    fresh = 2 if "on 2 fresh servers" in note else 1
    assert f"re-measured on {fresh} fresh server" in note and len(confirmed["loads"]) == 1 + fresh
    assert f"suspect test re-measured on fresh servers: {int(note.endswith('passes'))} cleared" in result.stdout.str()
    result.assert_outcomes(passed=int(note.endswith("passes")), failed=int(note.endswith("fails")))
