"""Latency percentiles from raw per-request samples, and the results file's summary built from them.

Every load keeps its per-request latencies in whole microseconds (`samples_us`: TTFT, TPOT and E2EL per completed
request, ITL per gap between token chunks), and every percentile the plugin reports is computed from such samples by
`latency_summary`. So a summary over several loads, tests or CI shards is recomputed from the pooled samples and
equals what one run over the same requests reports; an average of per-shard p99s does not (a p99 is not additive:
kubernetes-sigs/inference-perf#797). Microseconds: far below the jitter of a request's timing, and whole numbers
keep the results file small (about 6 characters a sample) and the pooled mean exact in any order.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The latencies a load samples, as `vllm bench serve` defines them (load/client.py), and their results-file keys.
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SAMPLES_KEY = "samples_us"
# A JSON array of numbers only, as json.dumps(indent=2) lays it out: one number per line (a string cannot match: its
# newlines are escaped).
_NUMBER_ARRAY = re.compile(r"\[\n\s*-?[0-9][0-9.eE+-]*(?:,\n\s*-?[0-9][0-9.eE+-]*)*\n\s*\]")


def to_us(values_s: Iterable[float]) -> list[int]:
    """Seconds -> whole microseconds (the unit samples are kept in)."""
    return [round(value * 1_000_000) for value in values_s]


def latency_summary(samples_us: Sequence[int]) -> dict[str, float]:
    """Mean, p50, p90 and p99 in milliseconds, as vllm bench computes them (numpy's linear percentile), zeros
    without samples. Independent of the samples' order: the mean is an exact integer sum."""
    if not samples_us:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    import numpy as np

    ms = np.sort(np.asarray(samples_us, dtype=np.int64)).astype(float) / 1000.0
    p50, p90, p99 = np.percentile(ms, (50, 90, 99))
    return {"mean": sum(samples_us) / len(samples_us) / 1000.0, "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def pooled_load(loads: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Request counts and token totals over `loads` (LoadResult.to_dict() each), and each latency's summary over
    the pooled raw samples of those that carry them (`loads_without_samples` counts the others: results files
    written before samples were kept, preflight's planned loads)."""
    pooled: dict[str, list[int]] = {name: [] for name in LATENCIES}
    totals = Counter[str]()
    without = 0
    for load in loads:
        totals["loads"] += 1
        for key, total in (
            ("num_prompts", "requests"),
            ("completed", "completed"),
            ("failed", "failed"),
            ("total_output_tokens", "output_tokens"),
            ("total_input_tokens", "input_tokens"),
        ):
            totals[total] += int(load.get(key) or 0)
        samples = load.get(SAMPLES_KEY)
        if not isinstance(samples, Mapping) or not any(samples.get(name) for name in LATENCIES):
            without += int(bool(load.get("completed")))  # a load that measured requests but kept no samples
            continue
        for name in LATENCIES:
            pooled[name].extend(int(value) for value in samples.get(name, ()))
    summary: dict[str, Any] = {
        key: totals[key] for key in ("loads", "requests", "completed", "failed", "output_tokens", "input_tokens")
    }
    summary["loads_without_samples"] = without
    for name in LATENCIES:
        summary[f"{name}_ms"] = latency_summary(pooled[name])
    return summary


def results_summary(tests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The results file's `summary`: test outcomes, and the load figures pooled over every test and per launched
    server command, recomputed from the tests' records (TestRecord.to_dict() each) whatever process wrote them."""
    by_config: dict[str, list[Mapping[str, Any]]] = {}
    for test in tests:
        by_config.setdefault(str(test.get("launched") or test.get("config") or ""), []).append(test)
    return {
        "tests": len(tests),
        "outcomes": dict(sorted(Counter(str(test.get("outcome")) for test in tests).items())),
        "load": pooled_load(load for test in tests for load in test.get("loads") or ()),
        "configs": {
            command: {
                "tests": len(members),
                "load": pooled_load(load for test in members for load in test.get("loads") or ()),
            }
            for command, members in sorted(by_config.items())
        },
    }


def dumps_results(document: Mapping[str, Any]) -> str:
    """A results document as indented JSON with each array of numbers on one line: the per-request samples would
    otherwise take a line each (about 20 bytes a sample instead of 7)."""
    text = json.dumps(document, indent=2)
    return _NUMBER_ARRAY.sub(lambda match: "[" + " ".join(match.group(0)[1:-1].split()) + "]", text) + "\n"
