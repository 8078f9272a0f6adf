"""Stand-ins that honour the package's protocols, for unit tests that need a server object but no process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pytest_vllm_mem.baseline.results import NodeRecord
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import StartupMemory
from pytest_vllm_mem.launch.server import StartupOutcome

T = TypeVar("T")


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
