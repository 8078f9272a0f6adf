"""A suite of two configs run whole, then as --vllm-shard=1/2 and 2/2, with real vLLM CPU servers: each shard runs
one config's tests, and `python -m pytest_vllm_mem merge` of the two shards' folders gives the records, the baseline
and the calibration of the whole run. Four server startups in all (2 configs x (whole + shards)), tiny loads.

The measured figures differ between any two runs, so the merged files are compared with the whole run's by
structure: test ids, configs, outcomes, metrics measured, baseline keys and entries' figures. The merged summary's
percentiles are checked for exactness against a recomputation from the shards' raw per-request samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from e2e import run_inner

from pytest_vllm_mem.baseline.metrics import METRICS

pytestmark = pytest.mark.e2e

INNER = """
import pytest
from pytest_vllm_mem import VLLMConfig

# Different max_num_seqs: a flag that shapes the profile run, so each config has its own calibration entry.
CONFIGS = [
    VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024, max_num_seqs=4),
    VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=1024, max_num_seqs=8),
]
IDS = ["seqs4", "seqs8"]

@pytest.mark.parametrize("vllm_config", CONFIGS, ids=IDS)
def test_serves(vllm_server, vllm_load):
    assert vllm_load(num_prompts=8, concurrency=4, max_tokens=8).ok

@pytest.mark.parametrize("vllm_config", CONFIGS, ids=IDS)
def test_serves_again(vllm_server, vllm_load):
    assert vllm_load(num_prompts=6, concurrency=2, max_tokens=6).ok
"""

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def run_part(pytester: pytest.Pytester, folder: Path, *args: str) -> pytest.RunResult:
    """One inner run writing its results, baseline and calibration into `folder` (as one CI job's artifact)."""
    folder.mkdir()
    result, _ = run_inner(
        pytester,
        f"--vllm-baseline={folder / 'baselines.json'}",
        "--vllm-update-baseline",
        f"--vllm-results={folder / 'results.json'}",  # after run_inner's own: the last one counts
        *args,
    )
    return result


# Whether a streamed latency (TTFT, TPOT) is recorded depends on the run, not on the merge: a load whose token delivery
# coalesced keeps none (metrics.coalesced_load: when the 2 shared cores starve the load client, the chunks reach it in
# bursts), and a TPOT of zero, when a request's tokens came in one read, is not recorded (metrics.Metric.read); a
# fresh-machine CI run saw each (tpot_p50 missing from one run; on a6edaa, a streamed latency kept by one run only).
RUN_DEPENDENT = {name for name, metric in METRICS.items() if metric.streamed}


def measured(metrics: Any) -> list[str]:
    """The metric names a record or baseline entry holds, less those whose presence depends on the run."""
    return sorted(set(metrics) - RUN_DEPENDENT)


def shape(test: dict[str, Any]) -> dict[str, Any]:
    """What a test's record must share with the same test's record of another run."""
    return {
        "config": test["config"],
        "launched": test["launched"],
        "outcome": test["outcome"],
        "passed": test["passed"],
        "metrics": measured(test["metrics"]),
        # One TTFT, E2EL and TPOT sample per request (8 tokens each); ITL per token chunk, which vLLM sometimes
        # coalesces: their number varies between runs.
        "loads": [
            (
                load["num_prompts"],
                load["completed"],
                {name: len(load["samples_us"][name]) for name in ("ttft", "tpot", "e2el")},
                bool(load["samples_us"]["itl"]),
            )
            for load in test["loads"]
        ],
    }


def keys(value: Any) -> Any:
    """The nested keys of a JSON object, without its numbers."""
    return {key: keys(child) for key, child in value.items()} if isinstance(value, dict) else None


def test_two_shards_merge_into_the_whole_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    whole, first, second, merged = (pytester.path / name for name in ("whole", "shard-1", "shard-2", "merged"))

    run_part(pytester, whole).assert_outcomes(passed=4)
    run_part(pytester, first, "--vllm-shard=1/2").assert_outcomes(passed=2, deselected=2)
    run_part(pytester, second, "--vllm-shard=2/2").assert_outcomes(passed=2, deselected=2)

    check_shards_and_merge(whole, first, second, merged)


def check_shards_and_merge(whole: Path, first: Path, second: Path, merged: Path) -> None:
    """The shards' and the merged files against the whole run's (a function of the four folders, so that it can be
    run again on a kept run's folders)."""
    shards = [json.loads((folder / "results.json").read_text()) for folder in (first, second)]
    # Each shard ran one config's two tests, with one server: the split keeps a config's tests together.
    for shard in shards:
        assert len({test["launched"] for test in shard["tests"]}) == 1 and len(shard["tests"]) == 2
        assert shard["server_startups"] == 1

    done = subprocess.run(
        [sys.executable, "-m", "pytest_vllm_mem", "merge", str(merged), str(first), str(second)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "results: 4 tests from 2 files" in done.stdout

    # Records: the same tests, configs, outcomes and metrics as the whole run, sorted by test id.
    expected = json.loads((whole / "results.json").read_text())
    result = json.loads((merged / "results.json").read_text())
    assert [test["test_id"] for test in result["tests"]] == sorted(test["test_id"] for test in expected["tests"])
    by_id = {test["test_id"]: test for test in expected["tests"]}
    for test in result["tests"]:
        assert shape(test) == shape(by_id[test["test_id"]])
    # The merge itself loses nothing: each merged record is its shard's record, metric for metric.
    shard_records = {test["test_id"]: test for shard in shards for test in shard["tests"]}
    for test in result["tests"]:
        assert test["metrics"] == shard_records[test["test_id"]]["metrics"]
    assert result["server_startups"] == expected["server_startups"] == 2
    assert {key: result[key] for key in ("tier", "device", "backend", "vllm_version")} == {
        key: expected[key] for key in ("tier", "device", "backend", "vllm_version")
    }
    assert keys(result["summary"]) == keys(expected["summary"])
    assert result["summary"]["outcomes"] == expected["summary"]["outcomes"] == {"ok": 4}
    for field in ("tests", "loads", "requests", "completed"):
        got = result["summary"].get(field, result["summary"]["load"].get(field))
        assert got == expected["summary"].get(field, expected["summary"]["load"].get(field))

    # Percentiles: exactly those of the shards' pooled raw samples, not an average of the shards' summaries.
    for name in LATENCIES:
        pooled = [
            value
            for shard in shards
            for test in shard["tests"]
            for load in test["loads"]
            for value in load["samples_us"][name]
        ]
        assert pooled, name
        ms = np.asarray(sorted(pooled), dtype=float) / 1000.0
        summary = result["summary"]["load"][f"{name}_ms"]
        assert summary["p50"] == float(np.percentile(ms, 50)) and summary["p99"] == float(np.percentile(ms, 99))
        assert summary["p90"] == float(np.percentile(ms, 90)) and summary["mean"] == sum(pooled) / len(pooled) / 1000

    # Baseline: the same keys (test id, environment) and, per entry, the same figures, runs and config.
    whole_baseline = json.loads((whole / "baselines.json").read_text())["baselines"]
    merged_baseline = json.loads((merged / "baselines.json").read_text())["baselines"]
    assert {(t, env) for t, envs in merged_baseline.items() for env in envs} == {
        (t, env) for t, envs in whole_baseline.items() for env in envs
    }
    assert len(merged_baseline) == 4
    for test_id, envs in merged_baseline.items():
        for env, entry in envs.items():
            other = whole_baseline[test_id][env]
            assert measured(entry["metrics"]) == measured(other["metrics"])
            assert (entry["runs"], entry["config"]) == (other["runs"], other["config"])

    # Calibration: one entry per config, as the whole run wrote.
    whole_calibration = json.loads((whole / "calibration.json").read_text())["entries"]
    merged_calibration = json.loads((merged / "calibration.json").read_text())["entries"]
    assert sorted(merged_calibration) == sorted(whole_calibration) and len(merged_calibration) == 2
