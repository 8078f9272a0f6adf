"""The GPU backend: memory of a server's processes on each of its NVIDIA GPUs (or MIG slices), through NVML."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any, Literal

from pytest_vllm_mem.memory.device import DeviceError, DeviceInfo, ProbeReadError
from pytest_vllm_mem.memory.nvml import Nvml, NvmlError, ResolvedDevice
from pytest_vllm_mem.memory.process_tree import ProcessTable, ProcFs, process_name
from pytest_vllm_mem.units import format_bytes

__all__ = ["NvmlProbe"]

# Tree pids each live probe read last: a process new on a shared GPU that belongs to another server's tree is that
# server's, not ours, even when it shares our session. Only matters when servers share GPUs in one pytest.
_CLAIMS: dict[int, frozenset[int]] = {}
_CLAIMS_LOCK = threading.Lock()


# A driver that lists the server's processes with 0 bytes (open-gpu-kernel-modules PR #614, HAMi-core #112: containers)
# is caught once the device's used memory has risen by more than a CUDA context could explain away as noise.
ZERO_REPORT_RISE_BYTES = 256 * 2**20
_ANCESTOR_STEPS = 32


class NvmlProbe:
    """Memory of a server's processes on each of its GPUs, through NVML (`pynvml` from the nvidia-ml-py package).

    `devices`: an NVML index, or DeviceInfo records from `detect_devices()` (GPUs or MIG slices, in vLLM's order).
    A server's processes are its process tree plus the processes new on its GPUs that something ties to it
    (`processes`, a ProcessTable: /proc by default):
    - its session: servers start in a session of their own, and what they start keeps it when re-parented (Ray's
      raylet and workers of a cluster the server started change only their process group);
    - an ancestor in the tree, or in the server's session (a child born since the sampler last read the tree).
    A process new on the GPU that /proc can see and nothing ties to the server (another xdist worker's server,
    a parallel CI job, this pytest's own session) is never counted. One that /proc cannot see is in another PID
    namespace: counted only when none of the tree's pids is listed (NVML then reports host pids inside a
    container, and the server's processes are among the unseen ones), with a note that attribution is uncertain.
    Processes on the GPUs before the probe was created are never counted.

    Two modes, in `self.mode` (`self.mode_reason` says why the last reading fell back):
    - "per_process": per GPU, the sum of `usedGpuMemory` the driver reports for our processes (compute, graphics
      and MPS client contexts). Exact, and blind to other processes on the card.
    - "device_delta": per GPU, used memory now minus used memory when this probe was created. Used when the driver
      cannot attribute memory (pynvml gives None for `usedGpuMemory` on WDDM, some vGPU and MIG setups), lists no
      process of ours, or lists ours with 0 bytes while the device's used memory rose. It counts any other
      process's change as ours, so create the probe right before the server starts, under the device lock.
    Once one of our processes has been seen in the driver's lists, "none of ours listed" means they released the
    GPUs: 0. A failed read (driver error, a process list that keeps changing under the query) raises
    ProbeReadError: the sample is missing, never 0. `attribution_notes` says, once each, when a reading counted
    memory it could not tie to the server for sure, or left out a Ray worker it could not tie.
    """

    # NVML reports memory as it is when asked: a 100 ms peak needs samples closer than 100 ms.
    default_period_s = 0.05
    tracks_peaks = False

    def __init__(
        self,
        devices: int | DeviceInfo | Sequence[DeviceInfo] = 0,
        nvml: Any | None = None,
        processes: ProcessTable | None = None,
    ) -> None:
        self._module = nvml
        self._host: ProcessTable = processes if processes is not None else ProcFs()
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
        self._own_session = self._host.own_session()
        self._seen_own_pid = False
        self._zero_reports = False  # the driver listed ours with 0 bytes while the device filled: delta from then on
        self._sessions: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())  # (tree, its sessions)
        self._ties: dict[int, str] = {}  # pid -> "tied", "untied" or "unseen" (another PID namespace)
        self._noted: set[int] = set()
        self.mode: Literal["per_process", "device_delta"] = "per_process"
        self.mode_reason: str | None = None
        self.attribution_notes: list[str] = []

    @property
    def memory_version(self) -> str:
        """NVML's memory figures in use: "v2" (CUDA's totals, reserved memory apart), "v1", or "unified" (a device
        with no memory query, GB10: its totals and used memory are the host's /proc/meminfo)."""
        return self._nvml.memory_version

    # -- NVML reads --

    def _running(self) -> list[dict[int, int | None]]:
        return [self._nvml.processes(handle, info.label) for handle, info in zip(self._handles, self.devices)]

    def _used_now(self) -> tuple[int, ...]:
        return tuple(self._nvml.memory(handle, info.label)[1] for handle, info in zip(self._handles, self.devices))

    # -- attribution --

    def _tree_sessions(self, tree: frozenset[int]) -> frozenset[int]:
        if self._sessions[0] != tree:
            sessions = {self._host.session_of(pid) for pid in tree}
            self._sessions = (tree, frozenset(sid for sid in sessions if sid is not None and sid != self._own_session))
        return self._sessions[1]

    def _tie(self, pid: int, tree: frozenset[int], sessions: frozenset[int]) -> str:
        known = self._ties.get(pid)
        if known is not None:
            return known
        session = self._host.session_of(pid)
        if session is None:
            tie = "unseen"
        elif session in sessions:
            tie = "tied"
        else:
            tie = "untied"
            ancestor: int | None = pid
            for _ in range(_ANCESTOR_STEPS):
                ancestor = self._host.parent_of(ancestor) if ancestor is not None else None
                if ancestor is None or ancestor <= 1:
                    break
                if ancestor in tree or self._host.session_of(ancestor) in sessions:
                    tie = "tied"
                    break
        if tie != "untied" or tree:  # an untied verdict against an empty tree may change once the tree is read
            self._ties[pid] = tie
        return tie

    def _note(self, text: str) -> None:
        if text not in self.attribution_notes:
            self.attribution_notes.append(text)

    def _name(self, pid: int) -> str:
        return self._nvml.process_name(pid) or self._host.name_of(pid)

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
        sessions = self._tree_sessions(tree)
        ours: list[list[int | None]] = []
        unseen: list[list[tuple[int, int | None]]] = []
        tree_listed = False
        for device, processes in zip(self.devices, running):
            mine: list[int | None] = []
            hidden: list[tuple[int, int | None]] = []
            for pid, used in processes.items():
                if pid in tree:
                    tree_listed = True
                    mine.append(used)
                    continue
                if pid in self._foreign or pid in others:
                    continue
                tie = self._tie(pid, tree, sessions)
                if tie == "tied":
                    mine.append(used)
                elif tie == "unseen":
                    hidden.append((pid, used))
                elif pid not in self._noted and self._name(pid).startswith("ray::"):
                    self._noted.add(pid)
                    self._note(
                        f"Ray worker pid {pid} ({self._name(pid)}) appeared on {device.label} outside the server's "
                        f"session and was not counted (holding {format_bytes(used or 0)} when first seen): the workers "
                        "of a Ray cluster the server did not start cannot be tied to it"
                    )
            ours.append(mine)
            unseen.append(hidden)
        if not tree_listed and any(unseen):
            # NVML reports host pids inside this container: the server's own processes are among the unseen ones.
            for mine, hidden in zip(ours, unseen):
                mine.extend(used for _, used in hidden)
            if any(used for hidden in unseen for _, used in hidden):
                self._note(
                    "NVML lists processes that /proc cannot see (another PID namespace: NVML gives host pids in "
                    "this container); none of the server's pids is listed, so every new one was counted as the "
                    "server's: attribution uncertain"
                )
        listed = [used for device in ours for used in device]
        if listed and all(used is not None for used in listed) and not self._zero_reports:
            per_device = tuple(sum(used for used in device if used is not None) for device in ours)
            if sum(per_device) > 0 or not self._device_rose():
                self._seen_own_pid = True
                self.mode, self.mode_reason = "per_process", None
                return per_device
            self._zero_reports = True
        if not listed and self._seen_own_pid and not self._zero_reports:
            self.mode, self.mode_reason = "per_process", None
            return tuple(0 for _ in self.devices)
        if self._zero_reports:
            reason = (
                "the driver lists the server's processes with 0 bytes (usedGpuMemory) while the device's used "
                "memory rose (a container driver's known defect)"
            )
        elif listed:
            reason = "the driver gives no per-process figure (usedGpuMemory not available: WDDM, vGPU, some MIG setups)"
        else:
            reason = "the driver lists none of the server's processes"
        self.mode, self.mode_reason = "device_delta", reason
        return self._device_delta(reason)

    def _device_delta(self, reason: str) -> tuple[int, ...]:
        try:
            used_now = self._used_now()
        except NvmlError as error:
            raise ProbeReadError(str(error)) from None
        delta = tuple(max(0, now - before) for now, before in zip(used_now, self._baseline))
        if any(delta):
            unified = self.memory_version == "unified"
            self._note(
                f"measured as the device's used memory minus its value before the server started, because {reason}: "
                "any other process's change on the device is counted too"
                + (" (this unified-memory device's memory is the host's: every host process counts)" if unified else "")
            )
        return delta

    def _device_rose(self) -> bool:
        try:
            used_now = self._used_now()
        except NvmlError as error:
            raise ProbeReadError(str(error)) from None
        return any(now - before > ZERO_REPORT_RISE_BYTES for now, before in zip(used_now, self._baseline))

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
        return NvmlProbe(devices, nvml=self._module, processes=self._host)

    def close(self) -> None:
        with _CLAIMS_LOCK:
            _CLAIMS.pop(id(self), None)
        self._nvml.close()
