"""Stand-ins that honour the package's protocols, for unit tests that need a server object but no process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pytest_vllm_mem.baseline.results import NodeRecord, TestRecord
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import StartupMemory
from pytest_vllm_mem.launch.server import StartupOutcome

T = TypeVar("T")


@dataclass
class Measurement:
    """What a metric reads (baseline.metrics.Measured): a server's startup and memory figures, its loads, and the
    fresh servers of a confirmation."""

    startup: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    loads: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FakeServer:
    """A started server (launch.launcher.RunningServer) with nothing behind it: no process, no sampler, an empty
    log. What a test's load returns is the test's to fake (the tuner's `measure_load`, for one)."""

    launched: VLLMConfig
    startup: StartupOutcome | None = None
    memory: StartupMemory | None = None
    log_path: Path | None = Path("server.log")
    pid: int = 4242
    started_at: float = 0.0
    loads_run: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> VLLMConfig:
        return self.launched

    @property
    def url(self) -> str:
        return "http://127.0.0.1:1"

    @property
    def model_name(self) -> str:
        return self.launched.model

    def alive(self) -> bool:
        return True

    def log_text(self) -> str:
        return ""

    def peak_between(self, since: float) -> int:
        return self.startup.peak_memory_bytes if self.startup else 0

    def per_node_peaks(self) -> list[NodeRecord]:
        return []

    def call(self, function: Callable[..., T], *args: Any) -> T:
        return function(self, *args)

    def stop(self, grace_s: float = 15.0) -> None:
        pass


GIB = 2**30


# A test's record as the results JSON holds it, with one load's figures: for report and seam tests.
def load(throughput: float = 1234.4, completed: int = 8, peak: int = 5 * GIB, ttft_p99: float = 91.6) -> dict[str, Any]:
    return {
        "ok": True,
        "completed": completed,
        "num_prompts": 8,
        "peak_memory_bytes": peak,
        "output_throughput": throughput,
        "request_throughput": 2.5,
        "ttft_ms": {"mean": 40.0, "p50": 40.0, "p90": 80.0, "p99": ttft_p99},
        "tpot_ms": {"mean": 9.0, "p50": 9.0, "p90": 11.0, "p99": 14.0},
    }


def make_record(
    test_id: str = "tests/test_a.py::test_chat[tiny]", *loads: dict[str, Any], **changes: Any
) -> TestRecord:
    record = TestRecord(
        test_id=test_id,
        config="vllm serve m",
        launched="vllm serve m --gpu-memory-utilization 0.27",
        tier="24gb",
        tier_bytes=24 * 10**9,
        device="NVIDIA L4",
        backend="cuda",
        vllm_version="0.32.0",
        startup={"ok": True, "kind": "ok", "duration_s": 31.2, "peak_memory_bytes": 4 * GIB},
        memory={"kv_cache_tokens": 123_456},
        loads=list(loads) if loads else [load()],
        passed=True,
    )
    for name, value in changes.items():
        setattr(record, name, value)
    return record
