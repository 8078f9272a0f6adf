"""TestRecord: what one test measured (startup, memory figures, loads), and the metrics the baseline gate compares."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .diagnose import Diagnosis

RECORD_PROPERTY = "vllm_mem_record"  # key in item.user_properties: survives pytest-xdist report serialization


@dataclass
class TestRecord:
    __test__ = False  # Not a test class; pytest warned "cannot collect test class" where it was imported

    test_id: str
    config: str  # the command line the test asked for
    launched: str  # the command line that ran (tier emulation, model override)
    tier: str
    tier_bytes: int
    device: str
    backend: str
    vllm_version: str | None
    server_pid: int | None = None  # the server this test used (None when none was launched, e.g. a bad flag)
    startup: dict[str, Any] = field(default_factory=dict)  # StartupOutcome.to_dict()
    memory: dict[str, Any] = field(default_factory=dict)  # StartupMemory.to_dict()
    loads: list[dict[str, Any]] = field(default_factory=list)  # LoadResult.to_dict() per load
    failure: dict[str, Any] | None = None  # {"kind", "summary", "root_cause", "advice"}
    notes: list[str] = field(default_factory=list)  # emulation, overrides, leftover memory
    comparisons: list[dict[str, Any]] = field(default_factory=list)  # baseline.Comparison as dicts
    passed: bool | None = None  # the test's own outcome: only passing tests update baselines
    baseline_status: str = "none"  # "none" (gate off), "missing", "compared", "updated"
    plot: str | None = None
    timeline: dict[str, Any] | None = None  # samples and markers, for plots (not written to results JSON)

    @property
    def outcome(self) -> str:
        """The server's story in one word: a failure kind, "regressed", "failed" (the test's own assertion), "ok"."""
        if self.failure:
            return self.failure["kind"]
        if self.baseline_status == "compared" and any(c["status"] == "regressed" for c in self.comparisons):
            return "regressed"
        if self.passed is False:
            return "failed"
        return "ok" if self.startup.get("ok") else "not started"

    @property
    def peak_memory_bytes(self) -> int:
        peaks = [self.startup.get("peak_memory_bytes") or 0]
        peaks += [load.get("peak_memory_bytes") or 0 for load in self.loads]
        return max(peaks)

    def metrics(self) -> dict[str, float]:
        """The gated metrics: medians over this test's loads (repeat=N), None-free."""
        values: dict[str, float] = {}
        if self.startup.get("peak_memory_bytes"):
            values["startup_peak_memory"] = float(self.startup["peak_memory_bytes"])
        if self.memory.get("kv_cache_tokens"):
            values["kv_cache_tokens"] = float(self.memory["kv_cache_tokens"])
        ok_loads = [load for load in self.loads if load.get("completed")]
        pick = {
            "load_peak_memory": lambda d: d.get("peak_memory_bytes"),
            "output_throughput": lambda d: d.get("output_throughput"),
            "request_throughput": lambda d: d.get("request_throughput"),
            "ttft_p50": lambda d: d["ttft_ms"]["p50"],
            "ttft_p99": lambda d: d["ttft_ms"]["p99"],
            "tpot_p50": lambda d: d["tpot_ms"]["p50"],
        }
        for name, get in pick.items():
            samples = [v for v in (get(load) for load in ok_loads) if v]
            if samples:
                values[name] = float(statistics.median(samples))
        return values

    def metric_samples(self) -> dict[str, list[float]]:
        """Every load's value per metric: the spread a baseline stores next to the median."""
        per_load = [TestRecord.metrics(_single(self, load)) for load in self.loads if load.get("completed")]
        names = {name for metrics in per_load for name in metrics}
        return {name: [m[name] for m in per_load if name in m] for name in sorted(names)}

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "timeline"}
        data["outcome"] = self.outcome
        data["peak_memory_bytes"] = self.peak_memory_bytes
        data["metrics"] = self.metrics()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TestRecord":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def failure_dict(diagnosis: "Diagnosis", advice: list[str], log_path: Path | None) -> dict[str, Any]:
    """A failure as the record (and the results JSON) keeps it."""
    return {"kind": diagnosis.kind, "summary": diagnosis.summary, "root_cause": list(diagnosis.root_cause),
            "advice": list(advice), "log": str(log_path) if log_path else None}


def _single(record: TestRecord, load: dict[str, Any]) -> TestRecord:
    return dataclasses.replace(record, loads=[load], comparisons=[], timeline=None)
