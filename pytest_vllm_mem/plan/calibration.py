"""Calibration: the overheads a real startup logged, kept so the next plan of the same model is exact up to the
KV arithmetic.

What the plan has to estimate (activation peak + non-torch memory, the CUDA graph pool; on the CPU the worker's
non-KV RSS and the other processes' RSS) is what vLLM's startup log and the measured peak reveal. They depend on the
model, the vLLM release, the device and the flags that shape the profile run, so entries are keyed by all four and
reused only there. The file lives beside the baselines (`calibration.json`), written atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_vllm_mem.plan.memory_plan import Calibration, Plan
from pytest_vllm_mem.units import GIB

# Flags that change the overheads (profile batch, graph capture, sharding, dtypes); others do not. Pipeline stages and
# expert parallelism change what one GPU holds (its layers, its experts and the all-to-all buffers), so a startup of
# one split says nothing exact about another.
SHAPE_FLAGS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "enforce_eager",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "enable_expert_parallel",
    "dtype",
    "quantization",
    "enable_lora",  # LoRA slot buffers sit in the weights a startup logs (lora.py)
    "max_loras",
    "max_lora_rank",
    "kv_cache_dtype",
    "compilation_config",
    "cuda_graph_sizes",
    "speculative_config",
)
FORMAT_VERSION = 1


def calibration_key(model: str, vllm_version: str | None, device: str, flags: Mapping[str, Any] | None = None) -> str:
    shape = ",".join(f"{k}={flags[k]}" for k in SHAPE_FLAGS if flags and flags.get(k) not in (None, False))
    return f"{model}|{vllm_version or '?'}|{device}|{shape}"


def from_startup(result: Plan, memory: Mapping[str, Any], peak_bytes: int | None = None) -> Calibration | None:
    """The overheads implied by one startup's logged figures (StartupMemory.to_dict()), None when it logged too
    little. GPU: activation + non-torch = requested - weights - KV - graphs (where graphs are in the budget)."""
    weights = memory.get("weights_gib")
    kv = memory.get("kv_cache_gib")
    if result.backend == "cpu":
        non_kv = memory.get("non_kv_gib")
        requested = memory.get("requested_gib")
        if non_kv is None:
            return None
        other = None
        if peak_bytes and requested is not None:
            other = max(0, peak_bytes - int(requested * GIB))
        return Calibration(cpu_non_kv_bytes=int(non_kv * GIB), cpu_other_bytes=other)
    if weights is None or kv is None:
        return None
    graph = memory.get("graph_capture_gib") or 0.0
    in_budget = graph if result.graph_in_budget else 0.0
    overhead = result.requested_bytes / GIB - weights - kv - in_budget
    return Calibration(
        activation_bytes=int(max(0.0, overhead) * GIB),
        non_torch_bytes=0,
        graph_bytes=int(graph * GIB),
        weights_bytes=int(weights * GIB),
    )


class CalibrationStore:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> Calibration | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict):
            return None
        known = set(Calibration.__dataclass_fields__)
        return Calibration(**{k: v for k, v in entry.items() if k in known})

    def find(
        self, model: str, vllm_version: str | None, flags: Mapping[str, Any] | None = None, device: str | None = None
    ) -> Calibration | None:
        """The entry for this model, release and flag shape: on `device`, or on any device when it is None."""
        if device is not None:
            return self.get(calibration_key(model, vllm_version, device, flags))
        want = calibration_key(model, vllm_version, "", flags).split("|")
        for key in sorted(self._read()):
            parts = key.split("|")
            if len(parts) == 4 and parts[:2] == want[:2] and parts[3] == want[3]:
                return self.get(key)
        return None

    def put(self, key: str, calibration: Calibration) -> None:
        entries = self._read()
        entries[key] = {k: v for k, v in calibration.__dict__.items() if v is not None}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(handle, "w") as out:
            json.dump({"format": FORMAT_VERSION, "entries": entries}, out, indent=2, sort_keys=True)
            out.write("\n")
        os.replace(tmp, self.path)
