"""The backend chosen at runtime: which devices a server uses, the probe that measures them, and waiting for them.

Callers never branch on the backend: `detect_devices()` gives the GPUs CUDA_VISIBLE_DEVICES names (or the CPU),
`make_probe()` the matching probe, `wait_for_free_memory()` works on both (and returns at once on the CPU).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pytest_vllm_mem.memory.cpu import ProcessTreeProbe, cpu_device
from pytest_vllm_mem.memory.device import DeviceError, DeviceInfo, MemoryProbe
from pytest_vllm_mem.memory.gpu import NvmlProbe
from pytest_vllm_mem.memory.nvml import NvmlUnavailable, nvml_session

__all__ = ["detect_device", "detect_devices", "gpus_used", "make_probe", "server_devices", "wait_for_free_memory"]

_UNSET = object()


def detect_devices(visible: str | object | None = _UNSET, nvml: Any | None = None) -> tuple[DeviceInfo, ...]:
    """The GPUs a process with CUDA_VISIBLE_DEVICES=`visible` gets (default: this process's), in CUDA's order.

    Resolved as vLLM resolves them (indexes, GPU-/MIG- UUIDs and unique prefixes; see Nvml.resolve). No NVML (no
    nvidia-ml-py, no driver) or no GPU visible means the CPU backend: one CPU device. Raises DeviceError for an
    entry that names no GPU, NvmlError when NVML initialized but a query failed.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is _UNSET else visible
    assert env is None or isinstance(env, str)
    try:
        with nvml_session(nvml) as session:
            if session.count() < 1:
                return (cpu_device(),)
            devices = tuple(device.info for device in session.resolve(env))
    except NvmlUnavailable:
        return (cpu_device(),)
    return devices or (cpu_device(),)


def detect_device(device_index: int = 0, nvml: Any | None = None) -> DeviceInfo:
    """The GPU at NVML index `device_index` if NVML sees at least one GPU, else the CPU.

    An index beyond the GPUs NVML sees is a mistake in the caller's input: DeviceError (a ValueError).
    """
    try:
        with nvml_session(nvml) as session:
            if session.count() < 1:
                return cpu_device()
            return session.device_by_index(device_index).info
    except NvmlUnavailable:
        return cpu_device()


def make_probe(device: DeviceInfo | Sequence[DeviceInfo], nvml: Any | None = None) -> MemoryProbe:
    """The probe for `device` (or several): NvmlProbe for "cuda", ProcessTreeProbe for "cpu"."""
    devices = [device] if isinstance(device, DeviceInfo) else list(device)
    backends = {each.backend for each in devices}
    if backends == {"cuda"}:
        return NvmlProbe(devices, nvml=nvml)
    if backends == {"cpu"} and len(devices) == 1:
        return ProcessTreeProbe(devices[0])
    raise ValueError(
        f"DeviceInfo backend(s) {', '.join(sorted(map(repr, backends))) or 'none'} have no memory probe: accepted "
        "are one 'cpu' device (process-tree RSS) or 'cuda' devices (NVML). Build them with detect_devices()."
    )


def gpus_used(flags: Mapping[str, object]) -> int:
    """How many of its visible GPUs a vLLM server takes: tensor x pipeline (x prefill-context) parallel size, times
    the data-parallel ranks on this node. vLLM's workers take the first ones, in CUDA_VISIBLE_DEVICES order."""

    def size(*names: str) -> int:
        for name in names:
            value = flags.get(name)
            if value is not None and not isinstance(value, bool):
                try:
                    return max(1, int(str(value)))
                except ValueError:
                    return 1  # vLLM refuses the flag itself; the probe need not guess
        return 1

    return (
        size("tensor_parallel_size")
        * size("pipeline_parallel_size")
        * size("prefill_context_parallel_size")
        * size("data_parallel_size_local", "data_parallel_size")
    )


def server_devices(visible: Sequence[DeviceInfo], flags: Mapping[str, object]) -> tuple[DeviceInfo, ...]:
    """The devices a server with these flags uses out of `visible`: the first gpus_used(flags) GPUs. A server that
    asks for more GPUs than are visible is measured on the visible ones; vLLM itself refuses to start it."""
    if not visible:
        raise DeviceError("no device is visible to the server: CUDA_VISIBLE_DEVICES names none.")
    if visible[0].backend != "cuda":
        return (visible[0],)
    return tuple(visible[: gpus_used(flags)])


def _free_per_device(probe: MemoryProbe) -> tuple[int, ...]:
    free = getattr(probe, "free_bytes", None)
    if free is not None:
        return tuple(free())
    return (probe.device.total_bytes - probe.device_used_bytes(),)  # a probe of one device without free_bytes()


def wait_for_free_memory(
    probe: MemoryProbe,
    exclude_pids: Collection[int] = (),
    *,
    needed_bytes: int | None = None,
    needed_fraction: float | None = None,
    timeout_s: float,
    poll_s: float = 0.5,
) -> list[tuple[int, int, str]]:
    """Before starting a server, wait until other processes stop holding its devices; return who still holds them.

    Clear (returns []) once no other process holds memory on any of the probe's devices, or once every device has
    at least the needed free memory: `needed_bytes`, or `ceil(total * needed_fraction)` of each device (pass the
    server's gpu_memory_utilization: vLLM demands that much free memory on every GPU at startup). Otherwise polls
    every `poll_s` until `timeout_s` and returns the remaining (pid, bytes, name) holders. An earlier server still
    exiting is the usual holder ("pseudo OOM"). On CPU it returns [] at once: vLLM checks host memory itself and
    nothing holds it exclusively.
    """
    if needed_bytes is not None and needed_fraction is not None:
        raise ValueError(
            "wait_for_free_memory takes needed_bytes or needed_fraction, not both: pass bytes for an absolute amount "
            "or a fraction of total device memory in (0, 1]."
        )
    if needed_fraction is not None and not 0 < needed_fraction <= 1:
        raise ValueError(
            f"wait_for_free_memory needed_fraction {needed_fraction!r} is out of range: pass a fraction of total "
            "device memory in (0, 1], e.g. the server's gpu_memory_utilization."
        )
    if probe.device.backend == "cpu":
        return []
    devices = getattr(probe, "devices", (probe.device,))
    if needed_fraction is not None:
        needed: list[int] | None = [math.ceil(device.total_bytes * needed_fraction) for device in devices]
    else:
        needed = None if needed_bytes is None else [needed_bytes] * len(devices)
    deadline = time.monotonic() + timeout_s
    while True:
        holders = probe.other_holders(exclude_pids)
        if not holders:
            return []
        if needed is not None and all(free >= need for free, need in zip(_free_per_device(probe), needed)):
            return []
        if time.monotonic() >= deadline:
            return holders
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
