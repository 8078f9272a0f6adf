"""TestRecord: what one test measured (startup, memory figures, loads), and the metrics the baseline gate compares."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from pytest_vllm_mem.baseline.metrics import quiet_loads, record_samples
from pytest_vllm_mem.kinds import FailureKind

if TYPE_CHECKING:
    from pytest_vllm_mem.diagnosis.diagnose import Diagnosis


class StartupRecord(TypedDict):
    """launch.server.StartupOutcome as a test record and the results JSON keep it."""

    ok: bool
    kind: str
    duration_s: float
    peak_memory_bytes: int
    peak_memory_per_gpu: list[int]


class NodeRecord(TypedDict):
    """One rank of a server on a cluster: the node it ran on and its memory peak there (since the rank started)."""

    rank: int
    node_id: str  # the cluster's id of the node (Ray's node id)
    address: str  # the node's IP as the cluster knows it
    hostname: str
    peak_memory_bytes: int  # the rank's total over its devices
    peak_memory_per_gpu: list[int]  # each of its GPUs' own peak; [] on the CPU backend


RECORD_PROPERTY = "vllm_mem_record"  # key in item.user_properties: survives pytest-xdist report serialization


class FailureRecord(TypedDict):
    """Why the test's server failed, as the record and the results JSON keep it (failure_dict)."""

    kind: FailureKind
    summary: str
    phase: str | None  # diagnose.PHASES (or "usage"/"arguments" for a bad flag); None where the log shows none
    root_cause: list[str]
    advice: list[str]
    log: str | None  # the server log, None when no server was launched


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
    startup: StartupRecord | dict[str, Any] = field(default_factory=dict)  # StartupOutcome.to_dict(); {}: none
    memory: dict[str, Any] = field(default_factory=dict)  # StartupMemory.to_dict()
    loads: list[dict[str, Any]] = field(default_factory=list)  # LoadResult.to_dict() per load
    # Fresh servers of the gate's confirmation, {"startup": ..., "memory": ...} each: their figures are samples too.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    failure: FailureRecord | None = None
    notes: list[str] = field(default_factory=list)  # emulation, overrides, leftover memory
    comparisons: list[dict[str, Any]] = field(default_factory=list)  # compare.Comparison.to_dict() per metric
    baseline: dict[str, Any] | None = None  # compare.BaselineMatch.to_dict(): the entry compared with
    passed: bool | None = None  # the test's own outcome: only passing tests update baselines
    baseline_status: str = "none"  # "none" (gate off), "missing", "compared", "updated"
    plot: str | None = None
    plan: dict[str, Any] | None = None  # plan.Plan.to_dict() of the launched config (preflight.py), or {"error": why}
    nodes: list[NodeRecord] = field(default_factory=list)  # on a cluster: where each rank ran; [] on this machine
    # Plain data only (written to JSON, sent by pytest-xdist): the live server stays on the session state.

    @property
    def outcome(self) -> str:
        """The server's story in one word: a failure kind, "regressed", "failed" (the test's own assertion), "ok"."""
        if self.failure:
            return self.failure["kind"]
        if self.baseline_status == "compared" and any(c["status"] == "regressed" for c in self.comparisons):
            return "regressed"
        if self.passed is False:
            return "failed"
        if self.startup.get("kind") == "planned":
            return "planned"  # --vllm-preflight: predicted to fit, nothing measured
        return "ok" if self.startup.get("ok") else "not started"

    @property
    def peak_memory_bytes(self) -> int:
        peaks = [self.startup.get("peak_memory_bytes") or 0]
        peaks += [load.get("peak_memory_bytes") or 0 for load in self.loads]
        return max(peaks)

    @property
    def peak_memory_per_gpu(self) -> list[int]:
        """Each GPU's own peak over startup and loads, in the server's device order; [] on the CPU backend."""
        columns = [self.startup.get("peak_memory_per_gpu") or []]
        columns += [load.get("peak_memory_per_gpu") or [] for load in self.loads]
        width = max(len(column) for column in columns)
        return [max(column[i] for column in columns if i < len(column)) for i in range(width)]

    @property
    def largest_gpu_peak_bytes(self) -> int:
        """What a tier limits: the fullest GPU's peak (a TP=2 server's total is spread over two cards), over every
        node of a multi-node server; without per-GPU figures (the CPU backend, older records) the fullest node's
        total. Rank 0 is measured by the startup and the loads themselves; the other ranks' peaks are each rank's
        since it started (read at the test's end)."""
        others = [node for node in self.nodes if node["rank"] > 0]
        per_gpu = [*self.peak_memory_per_gpu, *(peak for node in others for peak in node["peak_memory_per_gpu"])]
        if per_gpu:
            return max(per_gpu)
        return max([self.peak_memory_bytes, *(node["peak_memory_bytes"] for node in others)])

    def metrics(self) -> dict[str, float]:
        """Every catalogue figure measured: the median over this test's completed loads (repeat=N) for load
        figures, the server's value for startup figures."""
        return {name: float(statistics.median(values)) for name, values in self.metric_samples().items()}

    def metric_samples(self) -> dict[str, list[float]]:
        """Every figure's samples: one per completed load, or one per server; the spread a baseline stores."""
        return record_samples(self)

    def quiet(self) -> tuple[TestRecord, int]:
        """This record as the gate judges it, and how many loads it left out: the loads a busy runner ran
        (metrics.busy_load) are dropped when quiet ones exist; with none quiet, every load stays."""
        quiet = [dict(load) for load in quiet_loads(self.loads)]
        if len(quiet) == len(self.loads):
            return self, 0
        return dataclasses.replace(self, loads=quiet), len(self.loads) - len(quiet)

    @property
    def sessions(self) -> int:
        """The servers this record's loads ran on: 1, more after the gate's confirmation on fresh servers (each load
        carries its server's number as `session`)."""
        return len({load.get("session", 0) for load in self.loads}) or 1

    @property
    def upgraded_from(self) -> str | None:
        """The vLLM version of the baseline compared with, when it is not the version that ran."""
        old = self.baseline.get("vllm_version") if self.baseline else None
        return old if old and old != self.vllm_version else None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["outcome"] = self.outcome
        data["peak_memory_bytes"] = self.peak_memory_bytes
        data["peak_memory_per_gpu"] = self.peak_memory_per_gpu  # [] on the CPU backend
        data["largest_gpu_peak_bytes"] = self.largest_gpu_peak_bytes  # what a tier limits
        data["metrics"] = self.metrics()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def failure_dict(diagnosis: Diagnosis, advice: list[str], log_path: Path | None) -> FailureRecord:
    """A failure as the record (and the results JSON) keeps it."""
    return {
        "kind": diagnosis.kind,
        "summary": diagnosis.summary,
        "phase": diagnosis.phase,
        "root_cause": list(diagnosis.root_cause),
        "advice": list(advice),
        "log": str(log_path) if log_path else None,
    }
