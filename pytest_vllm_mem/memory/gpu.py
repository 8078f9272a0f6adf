"""The GPU backend: memory of a server's processes on each of its NVIDIA GPUs (or MIG slices), through NVML."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any, Literal

from pytest_vllm_mem.memory.device import DeviceError, DeviceInfo, ProbeReadError
from pytest_vllm_mem.memory.nvml import Nvml, NvmlError, ResolvedDevice
from pytest_vllm_mem.memory.process_tree import process_name

__all__ = ["NvmlProbe"]

# Tree pids each live probe read last: a process new on a shared GPU that belongs to another server's tree is that
# server's, not ours. Only matters when servers share GPUs (--vllm-max-servers above 1 on one device).
_CLAIMS: dict[int, frozenset[int]] = {}
_CLAIMS_LOCK = threading.Lock()


class NvmlProbe:
    """Memory of a server's processes on each of its GPUs, through NVML (`pynvml` from the nvidia-ml-py package).

    `devices`: an NVML index, or DeviceInfo records from `detect_devices()` (GPUs or MIG slices, in vLLM's order).
    A server's processes are its process tree plus every process that appeared on its GPUs after this probe was
    created: vLLM's Ray executor runs its GPU workers under Ray's raylet, outside the server's tree. Processes on
    the GPUs before that (another tenant, an earlier server still exiting) are never counted.

    Two modes, in `self.mode`:
    - "per_process": per GPU, the sum of `usedGpuMemory` the driver reports for our processes (compute + graphics
      contexts). Exact, and blind to other processes on the card.
    - "device_delta": per GPU, used memory now minus used memory when this probe was created. Used when the driver
      cannot attribute memory (pynvml gives None for `usedGpuMemory` on WDDM, some vGPU and MIG setups) or lists no
      process of ours. It counts any other process's change as ours, so create the probe right before the server
      starts, after `wait_for_free_memory`.
    Once one of our processes has been seen in the driver's lists, "none of ours listed" means they released the
    GPUs: 0. A failed read (driver error, a process list that keeps changing under the query) raises
    ProbeReadError: the sample is missing, never 0.
    """

    # NVML reports memory as it is when asked: a 100 ms peak needs samples closer than 100 ms.
    default_period_s = 0.05
    tracks_peaks = False

    def __init__(self, devices: int | DeviceInfo | Sequence[DeviceInfo] = 0, nvml: Any | None = None) -> None:
        self._module = nvml
        self._nvml = Nvml(nvml)
        try:
            if isinstance(devices, int):
                resolved = [self._nvml.device_by_index(devices)]
            else:
                infos = [devices] if isinstance(devices, DeviceInfo) else list(devices)
                resolved = [ResolvedDevice(info, self._nvml.handle_for(info)) for info in infos]
            if not resolved:
                raise DeviceError(
                    "NvmlProbe needs at least one GPU: pass an NVML index or devices from detect_devices()."
                )
            self.devices = tuple(device.info for device in resolved)
            self.device = self.devices[0]
            self._handles = tuple(device.handle for device in resolved)
            self._baseline = self._used_now()
            self._foreign = {pid for processes in self._running() for pid in processes}
        except BaseException:
            self._nvml.close()
            raise
        self._seen_own_pid = False
        self.mode: Literal["per_process", "device_delta"] = "per_process"

    # -- NVML reads --

    def _running(self) -> list[dict[int, int | None]]:
        return [self._nvml.processes(handle, info.label) for handle, info in zip(self._handles, self.devices)]

    def _used_now(self) -> tuple[int, ...]:
        return tuple(self._nvml.memory(handle, info.label)[1] for handle, info in zip(self._handles, self.devices))

    # -- MemoryProbe --

    def read(self, pids: Collection[int]) -> tuple[int, ...]:
        try:
            running = self._running()
        except NvmlError as error:
            raise ProbeReadError(str(error)) from None
        tree = frozenset(pids)
        with _CLAIMS_LOCK:
            _CLAIMS[id(self)] = tree
            others = frozenset().union(*(claim for key, claim in _CLAIMS.items() if key != id(self)))
        ours = [
            [used for pid, used in processes.items() if pid in tree or (pid not in self._foreign and pid not in others)]
            for processes in running
        ]
        listed = [used for device in ours for used in device]
        if listed and all(used is not None for used in listed):
            self._seen_own_pid = True
            self.mode = "per_process"
            return tuple(sum(used for used in device if used is not None) for device in ours)
        if not listed and self._seen_own_pid:
            self.mode = "per_process"
            return tuple(0 for _ in self.devices)
        self.mode = "device_delta"
        try:
            used_now = self._used_now()
        except NvmlError as error:
            raise ProbeReadError(str(error)) from None
        return tuple(max(0, now - before) for now, before in zip(used_now, self._baseline))

    def used_bytes(self, pids: Collection[int]) -> int:
        return sum(self.read(pids))

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        excluded = set(exclude_pids)
        held: dict[int, int] = {}
        for processes in self._running():
            for pid, used in processes.items():
                if pid not in excluded:
                    held[pid] = held.get(pid, 0) + (used or 0)
        return [(pid, used, self._nvml.process_name(pid) or process_name(pid)) for pid, used in sorted(held.items())]

    def device_used_bytes(self) -> int:
        return sum(self._used_now())

    def free_bytes(self) -> tuple[int, ...]:
        return tuple(self._nvml.memory(handle, info.label)[2] for handle, info in zip(self._handles, self.devices))

    def scoped(self, devices: Sequence[DeviceInfo]) -> NvmlProbe:
        return NvmlProbe(devices, nvml=self._module)

    def close(self) -> None:
        with _CLAIMS_LOCK:
            _CLAIMS.pop(id(self), None)
        self._nvml.close()
