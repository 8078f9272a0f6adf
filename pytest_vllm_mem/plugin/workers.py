"""pytest-xdist on a multi-GPU host: each worker gets its own GPUs, so servers never share a device.

Worker gwI takes GPUs [I*K, I*K+K) where K is --vllm-gpus-per-worker (the tensor-parallel size the suite needs).
An 8-GPU node runs a suite 8 wide with `-n 8`, or 4 wide with `-n 4 --vllm-gpus-per-worker 2` for TP=2 configs.

The GPUs are those CUDA gives a process with CUDA_VISIBLE_DEVICES unset, as the memory package resolves them: a GPU
in MIG mode counts as its MIG slices. They are handed out by UUID (GPU-... or MIG-...): an NVML index names a
whole card, and on a MIG host CUDA_VISIBLE_DEVICES=0 gives a worker no slice of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from typing import Any

from pytest_vllm_mem.memory import DeviceInfo, NvmlError, detect_devices
from pytest_vllm_mem.memory.nvml import device_count


class WorkerDeviceError(ValueError):
    """More xdist workers than GPUs to give them."""


def nvml_device_count(nvml: Any | None = None) -> int:
    """GPUs NVML sees (0 without a driver, i.e. on the CPU backend)."""
    return device_count(nvml)


def visible_gpus(nvml: Any | None = None) -> list[DeviceInfo]:
    """The GPUs and MIG slices to share out, in CUDA's order; [] on the CPU backend or when NVML cannot read them
    (the session's own probe then says why)."""
    try:
        # Handed out by UUID, which means one GPU in either CUDA order; servers run with PCI_BUS_ID anyway.
        return [device for device in detect_devices(None, nvml, "PCI_BUS_ID") if device.backend == "cuda"]
    except NvmlError:
        return []


def worker_devices(worker_id: str, gpu_count: int, per_worker: int) -> list[int]:
    match = re.fullmatch(r"gw(\d+)", worker_id)
    if not match:
        raise WorkerDeviceError(f"xdist worker id {worker_id!r} is not of the form gwN")
    first = int(match.group(1)) * per_worker
    if first + per_worker > gpu_count:
        raise WorkerDeviceError(
            f"pytest-xdist worker {worker_id} needs GPUs {first}..{first + per_worker - 1}, but this host has "
            f"{gpu_count}: use at most -n {gpu_count // per_worker} with --vllm-gpus-per-worker={per_worker}, "
            "or set CUDA_VISIBLE_DEVICES yourself for each worker."
        )
    return list(range(first, first + per_worker))


def assign_worker_gpus(
    worker_id: str, per_worker: int, environ: MutableMapping[str, str] = os.environ, nvml: Any | None = None
) -> str | None:
    """Set CUDA_VISIBLE_DEVICES for this worker (inherited by its servers); None when there is nothing to assign
    (the user set it already, to GPUs or to "" for none, or no GPU: CPU servers share the host and pick their own
    ports)."""
    if "CUDA_VISIBLE_DEVICES" in environ:  # "" hides every GPU: the user's choice, not an unset variable
        return None
    devices = visible_gpus(nvml)
    if not devices:
        return None
    chosen = (devices[position] for position in worker_devices(worker_id, len(devices), per_worker))
    # A UUID where NVML reports one (every GPU and MIG slice on current drivers), else the card's index.
    visible = ",".join(device.uuid or str(device.index) for device in chosen)
    environ["CUDA_VISIBLE_DEVICES"] = visible
    return visible
