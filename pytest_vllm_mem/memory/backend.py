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
from pytest_vllm_mem.memory.process_tree import ProcessTable

__all__ = [
    "UNLISTED_PID",
    "detect_device",
    "detect_devices",
    "gpus_used",
    "make_probe",
    "server_devices",
    "wait_for_free_memory",
]

_UNSET = object()
# wait_for_free_memory's holder entry for memory no process NVML lists accounts for.
UNLISTED_PID = 0
UNLISTED_NAME = "no process NVML lists: another container, a MIG sibling or the driver"


def detect_devices(
    visible: str | object | None = _UNSET, nvml: Any | None = None, order: str | object | None = _UNSET
) -> tuple[DeviceInfo, ...]:
    """The GPUs a process with CUDA_VISIBLE_DEVICES=`visible` gets (default: this process's), in CUDA's order.

    Resolved as vLLM resolves them (indexes, GPU-/MIG- UUIDs and unique prefixes; see Nvml.resolve), indexes in
    NVML's PCI bus order: the plugin launches servers with CUDA_DEVICE_ORDER=PCI_BUS_ID (launch.server.server_env)
    so that CUDA numbers them alike. `order` (default: this process's CUDA_DEVICE_ORDER) set to FASTEST_FIRST on
    a host with GPUs of more than one model, with indexes or nothing in `visible`, is refused (DeviceError): CUDA's
    speed ranking is not NVML's, and the plugin would measure other GPUs than the server uses. No NVML (no
    nvidia-ml-py, no driver) or no GPU visible means the CPU backend: one CPU device. Raises DeviceError for an
    entry that names no GPU, NvmlError when NVML initialized but a query failed.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is _UNSET else visible
    assert env is None or isinstance(env, str)
    device_order = os.environ.get("CUDA_DEVICE_ORDER") if order is _UNSET else order
    assert device_order is None or isinstance(device_order, str)
    try:
        with nvml_session(nvml) as session:
            if session.count() < 1:
                return (cpu_device(),)
            if (device_order or "").strip().upper() == "FASTEST_FIRST" and _by_index(env):
                _refuse_fastest_first(session, env)
            devices = tuple(device.info for device in session.resolve(env))
    except NvmlUnavailable:
        return (cpu_device(),)
    return devices or (cpu_device(),)


def _by_index(visible: str | None) -> bool:
    """CUDA's numbering decides which GPUs `visible` means: it is unset or has a numeric entry."""
    return visible is None or any(part.strip().isdigit() for part in visible.split(","))


def _refuse_fastest_first(session: Any, visible: str | None) -> None:
    names = {session.name(session.handle_by_index(index), f"GPU {index}") for index in range(session.count())}
    if len(names) > 1:
        raise DeviceError(
            f"CUDA_DEVICE_ORDER=FASTEST_FIRST with CUDA_VISIBLE_DEVICES={visible!r} on a host with GPUs of "
            f"{len(names)} models ({', '.join(sorted(names))}): CUDA then numbers the GPUs by its own speed ranking, "
            "which NVML does not report, so the plugin cannot know which GPUs a server uses. Unset "
            "CUDA_DEVICE_ORDER (the plugin starts servers with PCI_BUS_ID, the order `nvidia-smi` shows), set it "
            "to PCI_BUS_ID, or name the GPUs by UUID (`nvidia-smi -L`)."
        )


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


def make_probe(
    device: DeviceInfo | Sequence[DeviceInfo], nvml: Any | None = None, processes: ProcessTable | None = None
) -> MemoryProbe:
    """The probe for `device` (or several): NvmlProbe for "cuda", ProcessTreeProbe for "cpu". `processes`: what
    ties a GPU process to a server (ProcessTable over /proc by default; tests pass a fake host)."""
    devices = [device] if isinstance(device, DeviceInfo) else list(device)
    backends = {each.backend for each in devices}
    if backends == {"cuda"}:
        return NvmlProbe(devices, nvml=nvml, processes=processes)
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
    return tuple(probe.free_bytes())


def wait_for_free_memory(
    probe: MemoryProbe,
    exclude_pids: Collection[int] = (),
    *,
    needed_bytes: int | None = None,
    needed_fraction: float | None = None,
    timeout_s: float,
    poll_s: float = 0.5,
) -> list[tuple[int, int, str]]:
    """Before starting a server, wait until its devices have the free memory vLLM will demand; return who holds them.

    With a need (`needed_bytes`, or `ceil(total * needed_fraction)` of each device: pass the server's
    gpu_memory_utilization, vLLM demands that much free memory on every GPU at startup), the devices are clear
    (returns []) once every one has that much free, as NVML counts it (v2: the driver's reserved memory apart, so
    total and free are the figures CUDA gives vLLM). Without one, once no other process holds memory on them.
    Otherwise polls every `poll_s` until `timeout_s` and returns the remaining (pid, bytes, name) holders; when too
    little is free and NVML lists nobody (another container's processes, a MIG sibling, a driver leak), one entry
    with pid UNLISTED_PID and the memory no listed process accounts for. Run it under the device's startup lock,
    right before the launch: another startup can take the memory in between otherwise. An earlier server still
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
    devices = probe.devices
    if needed_fraction is not None:
        needed: list[int] | None = [math.ceil(device.total_bytes * needed_fraction) for device in devices]
    else:
        needed = None if needed_bytes is None else [needed_bytes] * len(devices)
    deadline = time.monotonic() + timeout_s
    while True:
        holders = probe.other_holders(exclude_pids)
        if needed is None:
            if not holders:
                return []
        else:
            free = _free_per_device(probe)
            if all(have >= need for have, need in zip(free, needed)):
                return []
        if time.monotonic() >= deadline:
            if holders or needed is None:
                return holders
            unlisted = max(device.total_bytes - have for device, have in zip(devices, free))
            return [(UNLISTED_PID, unlisted, UNLISTED_NAME)]
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
