"""The batch limits vLLM picks when the user gives none: max_num_batched_tokens and max_num_seqs from the device.

One rule for every caller (the plan, the GPU checks), after vLLM's `EngineArgs.get_batch_defaults` (vllm 0.32
engine/arg_utils.py) for the `vllm serve` usage context, with the releases each branch arrived in:

* a device of >= 160 GiB (B200/B300, also MI300X/MI325X): 16384 tokens, 1024 sequences (vLLM PR #51726, Aug 2026,
  first in about 0.28; issue #53961 reports MI300X falling into it);
* >= 70 GiB and not an A100 (H100, H200, GH200, MI300X before 0.28): 8192 tokens, 1024 sequences (by memory since
  PR #17073, 0.8.5; the A100 exclusion since PR #17885, 0.9);
* anything else (A100, L40S, L4, A10G, RTX cards): 2048 tokens, 256 sequences;
* DGX Spark's GB10 (119.6 GiB of unified memory): 2048 tokens, 256 sequences in every V1 release. NVML implements no
  memory query there (NVIDIA's DGX Spark known issues: nvidia-smi "Memory-Usage: Not Supported"), so until 0.32
  `get_device_total_memory` raises and `get_batch_defaults` falls back to device_memory = 0; 0.33 reads the total from
  CUDA instead and keeps GB10 on the small tier by its compute capability (`is_gb10`);
* the V0 engine (< 0.8) without chunked prefill profiles one batch of max(max_model_len, 2048) tokens (<= 32k).

The CPU backend sets its own (cpu.py): 2048 tokens and 128 sequences here. Pure: no import of vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_vllm_mem.units import GIB
from pytest_vllm_mem.versions import release_or_latest as release

LARGE_DEVICE_BYTES = 70 * GIB
# Devices whose NVML has no memory query, by the names CUDA gives them: vLLM sizes their defaults as for no memory.
NO_NVML_MEMORY_NAMES = ("gb10",)
HUGE_DEVICE_BYTES = 160 * GIB
HUGE_TIER_SINCE = (0, 28)
A100_EXCLUDED_SINCE = (0, 9)
V1_SINCE = (0, 8)
V0_CHUNKED_PREFILL_ABOVE = 32768


@dataclass(frozen=True)
class BatchDefaults:
    max_num_batched_tokens: int
    max_num_seqs: int
    reason: str  # which branch of vLLM's rule applied, for the plan's notes


def batch_defaults(
    device_bytes: int,
    device_name: str = "",
    *,
    backend: str = "cuda",
    vllm_version: str | None = None,
    max_model_len: int = 2048,
) -> BatchDefaults:
    """vLLM's defaults for a server on a device of `device_bytes` (the card's total, not a tier's share of it)."""
    if backend == "cpu":
        return BatchDefaults(2048, 128, "CPU backend defaults")
    version = release(vllm_version)
    if version < V1_SINCE:
        tokens = max(max_model_len, 2048) if max_model_len <= V0_CHUNKED_PREFILL_ABOVE else 2048
        return BatchDefaults(tokens, 256, "V0 engine: one batch of max_model_len tokens")
    if no_nvml_memory(device_name):
        return BatchDefaults(2048, 256, "GB10: NVML has no memory total there, so vLLM takes its small-device defaults")
    if device_bytes >= HUGE_DEVICE_BYTES and version >= HUGE_TIER_SINCE:
        return BatchDefaults(16384, 1024, "device >= 160 GiB")
    is_a100 = "a100" in device_name.lower() and version >= A100_EXCLUDED_SINCE
    if device_bytes >= LARGE_DEVICE_BYTES and not is_a100:
        return BatchDefaults(8192, 1024, "device >= 70 GiB, not an A100")
    why = "A100 (excluded from the large defaults)" if is_a100 else "device < 70 GiB"
    return BatchDefaults(2048, 256, why)


def no_nvml_memory(device_name: str) -> bool:
    """A device (DGX Spark's GB10) whose NVML reports no memory total, which vLLM's batch defaults treat as none."""
    name = device_name.lower()
    return any(key in name for key in NO_NVML_MEMORY_NAMES)


__all__ = ["BatchDefaults", "batch_defaults", "no_nvml_memory", "release"]
