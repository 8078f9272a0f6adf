"""Memory of a vLLM server measured from outside: which devices it uses, a probe per backend, and a sampler thread.

The server is a process tree (API server -> EngineCore -> Workers) on one or more devices. A `MemoryProbe` answers
"how much memory do these processes hold on each device now"; `MemorySampler` asks it every `period_s` in a
background thread. `detect_devices()` resolves CUDA_VISIBLE_DEVICES as vLLM does (or gives the CPU) and
`make_probe()` builds the matching probe, so callers never branch on the backend themselves.

Modules, one concern each: `device` (records, the probe protocol, errors), `process_tree`, `nvml` (every NVML call),
`gpu` (NvmlProbe), `cpu` (NUMA node memory, ProcessTreeProbe), `host_cpu` (how busy the rest of the host was),
`backend` (choice, devices per server, waiting), `sampler`.
"""

from __future__ import annotations

from pytest_vllm_mem.memory.backend import (
    detect_device,
    detect_devices,
    gpus_used,
    make_probe,
    server_devices,
    wait_for_free_memory,
)
from pytest_vllm_mem.memory.cpu import ProcessTreeProbe, cpu_device, cpu_memory_node, cpu_model_name, cpu_node_memory
from pytest_vllm_mem.memory.device import DeviceError, DeviceInfo, MemoryProbe, ProbeReadError
from pytest_vllm_mem.memory.gpu import NvmlProbe
from pytest_vllm_mem.memory.host_cpu import HostCpuReading, others_share, read_host_cpu
from pytest_vllm_mem.memory.nvml import NvmlError, NvmlUnavailable, device_count
from pytest_vllm_mem.memory.process_tree import cpu_seconds_between, process_tree, tree_cpu_times
from pytest_vllm_mem.memory.sampler import MemorySampler

__all__ = [
    "DeviceError",
    "DeviceInfo",
    "HostCpuReading",
    "MemoryProbe",
    "MemorySampler",
    "NvmlError",
    "NvmlProbe",
    "NvmlUnavailable",
    "ProbeReadError",
    "ProcessTreeProbe",
    "cpu_device",
    "cpu_memory_node",
    "cpu_model_name",
    "cpu_node_memory",
    "cpu_seconds_between",
    "detect_device",
    "detect_devices",
    "device_count",
    "gpus_used",
    "make_probe",
    "others_share",
    "process_tree",
    "read_host_cpu",
    "server_devices",
    "tree_cpu_times",
    "wait_for_free_memory",
]
