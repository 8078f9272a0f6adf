"""The CPU backend: the NUMA node memory vLLM's CPU worker sizes its KV cache from, and process-tree RSS.

Nothing here is used on GPUs: the CPU probe reads host memory of the server's own processes, which is what vLLM's
CPU backend allocates its KV cache in.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Collection, Sequence
from typing import Literal

import psutil

from pytest_vllm_mem.memory.device import DeviceInfo

__all__ = ["ProcessTreeProbe", "cpu_device", "cpu_memory_node", "cpu_model_name", "cpu_node_memory"]

_NODE_ROOT = "/sys/devices/system/node"


def _parse_id_list(text: str) -> list[int]:
    """'0-2,4' -> [0, 1, 2, 4] (the kernel's cpulist / Mems_allowed_list format)."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            start, end = part.split("-")
            ids.update(range(int(start), int(end) + 1))
        else:
            ids.add(int(part))
    return sorted(ids)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
        return None if not text or text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_limit_and_usage() -> tuple[int | None, int | None]:
    """Same rules as vllm.utils.cpu_resource_utils: cgroup v2 memory.max, else v1 limit below 2**62."""
    if sys.platform != "linux":
        return None, None
    v2_limit = _read_int("/sys/fs/cgroup/memory.max")
    if v2_limit is not None:
        return v2_limit, _read_int("/sys/fs/cgroup/memory.current")
    v1_limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if v1_limit is not None and v1_limit < (1 << 62):
        return v1_limit, _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    return None, None


def cpu_memory_node() -> int:
    """The NUMA node vLLM's CPU worker sizes its KV cache on: the node of the lowest CPU this process may run on.

    vLLM takes `get_allowed_cpu_list()[0]` (lscpu order, filtered by sched_getaffinity) and its `numa_node`; the
    node's cpulist in sysfs gives the same answer without running lscpu. Machines without NUMA sysfs use node 0.
    """
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return 0
    first_cpu = min(allowed)
    try:
        names = os.listdir(_NODE_ROOT)
    except OSError:
        return 0
    for name in sorted(names):
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(f"{_NODE_ROOT}/{name}/cpulist") as file:
                    if first_cpu in _parse_id_list(file.read()):
                        return int(name[4:])
            except OSError:
                continue
    return 0


def cpu_node_memory(node: int | None = None) -> tuple[int, int]:
    """(total, available) bytes of a NUMA node, computed exactly as vLLM's CPU backend does.

    Mirrors `vllm.utils.cpu_resource_utils.get_memory_node_info` (vLLM 0.32): node meminfo MemTotal; available =
    MemFree + Active(file) + Inactive(file) + SReclaimable; both clamped to the cgroup limit when it is lower;
    psutil's system-wide numbers where the node has no meminfo (non-NUMA kernels, macOS).
    The CPU worker prints the total as "(0.21/10.46) GiB" and sizes the KV cache as
    ceil(total * gpu_memory_utilization) minus its own RSS.
    """
    node = cpu_memory_node() if node is None else node
    path = f"{_NODE_ROOT}/node{node}/meminfo"
    if sys.platform == "darwin" or not os.path.exists(path):
        memory = psutil.virtual_memory()
        return int(memory.total), int(memory.available)
    meminfo: dict[str, int] = {}
    with open(path) as file:
        for line in file:  # "Node 0 MemTotal:       97421888 kB"
            parts = line.split()
            if len(parts) >= 4:
                meminfo[parts[2].rstrip(":")] = int(parts[3]) * 1024
    total = meminfo["MemTotal"]
    available = meminfo["MemFree"] + meminfo["Active(file)"] + meminfo["Inactive(file)"] + meminfo["SReclaimable"]
    limit, usage = _cgroup_limit_and_usage()
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (usage or 0)))
    return total, available


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_device() -> DeviceInfo:
    total, _available = cpu_node_memory()
    return DeviceInfo(backend="cpu", name=cpu_model_name(), total_bytes=total, index=None)


class _PeakRss:
    """One Linux process's resident set through /proc, files kept open (re-read in place: one pread each).

    read() returns the largest RSS the process reached since the previous read(): the kernel keeps that high-water
    mark (VmHWM in /proc/PID/status, including memory already freed again) and writing "5" to /proc/PID/clear_refs
    restarts it from the current RSS. Where clear_refs cannot be written (another user's process, a read-only /proc)
    it returns the current RSS (VmRSS) instead, and a peak between two reads can be missed. The descriptors belong
    to this process, not to its pid number: once it is reaped, reads fail with ProcessLookupError, never reading a
    reused pid.
    """

    def __init__(self, pid: int) -> None:
        self._status = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._clear: int | None = os.open(f"/proc/{pid}/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            self._clear = None

    def read(self) -> int:
        status = os.pread(self._status, 4096, 0)
        field = b"VmHWM:" if self._clear is not None else b"VmRSS:"
        start = status.find(field)
        if start < 0:  # kernel threads and zombies have no memory lines
            return 0
        kib = int(status[start + len(field) : status.index(b"kB", start)])
        if self._clear is not None:
            os.write(self._clear, b"5")  # the next read starts from the RSS of now
        return kib * 1024

    def close(self) -> None:
        for fd in (self._status, self._clear):
            if fd is not None:
                os.close(fd)


class ProcessTreeProbe:
    """Host memory held by a process tree, for vLLM's CPU backend.

    `metric="rss"` (default) sums resident set sizes. On Linux each call reports, per process, the largest RSS it
    reached since the previous call (the kernel's high-water mark, see _PeakRss), so a sampler catches a peak
    however short it is and however long its period; `tracks_peaks` says so. That costs about 4 us per process
    (files kept open). The sum of per-process peaks can exceed the tree's peak when two processes peak at different
    moments of one period; in vLLM the KV cache and activations live in the worker, so one process dominates.
    Elsewhere (macOS) it is the current RSS, through psutil. RSS counts pages shared between the tree's processes
    (torch's libraries, mapped in all three vLLM processes) once per process, so it overstates the tree by a roughly
    constant amount; peaks and deltas are what it is for. `metric="pss"` / `"uss"` divide shared pages fairly /
    count only private pages, reading /proc/PID/smaps_rollup: measured on a real vLLM CPU server tree, one PSS read
    took 93 ms, RSS 1.72 GiB vs PSS 1.34 GiB. Use them for one-off readings, or sample every second or more.
    """

    def __init__(self, device: DeviceInfo | None = None, metric: Literal["rss", "pss", "uss"] = "rss") -> None:
        if metric not in ("rss", "pss", "uss"):
            raise ValueError(
                f"ProcessTreeProbe metric {metric!r} is not known: use 'rss' (resident set, cheap), 'pss' "
                "(proportional set, shared pages divided) or 'uss' (private pages only)."
            )
        self.device = device if device is not None else cpu_device()
        self.devices = (self.device,)
        self.metric = metric
        self.tracks_peaks = metric == "rss" and sys.platform.startswith("linux")
        self._peaks: dict[int, _PeakRss] = {}
        self._processes: dict[int, psutil.Process] = {}  # cached: psutil.Process() costs a /proc read to create
        self.attribution_notes: tuple[str, ...] = ()  # the tree's own pages only: nothing is attributed by guess

    @property
    def default_period_s(self) -> float:
        # Peaks are caught between samples, so samples only set the timeline's resolution: 4 a second are enough,
        # and each wake-up of the sampler thread costs 0.1-0.5 ms of CPU on a small VM.
        return 0.25 if self.tracks_peaks else 0.05

    def _read(self, pid: int) -> int:
        if self.tracks_peaks:
            files = self._peaks.get(pid)
            if files is None:
                files = self._peaks[pid] = _PeakRss(pid)
            return files.read()
        process = self._processes.get(pid)
        if process is None:
            process = self._processes[pid] = psutil.Process(pid)
        if self.metric == "rss":
            return int(process.memory_info().rss)
        return int(getattr(process.memory_full_info(), self.metric))

    def read(self, pids: Collection[int]) -> tuple[int, ...]:
        return (self.used_bytes(pids),)

    def used_bytes(self, pids: Collection[int]) -> int:
        total = 0
        for pid in pids:
            try:
                total += self._read(pid)
            except (OSError, ValueError, psutil.Error):  # exited: ESRCH, ENOENT, NoSuchProcess: holds nothing
                self._forget(pid)
        for gone in (set(self._peaks) | set(self._processes)) - set(pids):
            self._forget(gone)
        return total

    def _forget(self, pid: int) -> None:
        self._processes.pop(pid, None)
        files = self._peaks.pop(pid, None)
        if files is not None:
            files.close()

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        return []  # host memory has no exclusive owner to wait for; vLLM checks the node's available memory itself

    def device_used_bytes(self) -> int:
        total, available = cpu_node_memory()
        return total - available

    def free_bytes(self) -> tuple[int, ...]:
        return (cpu_node_memory()[1],)

    def scoped(self, devices: Sequence[DeviceInfo]) -> ProcessTreeProbe:
        # One probe per server: its per-pid files and peaks are read by that server's sampler thread only.
        return ProcessTreeProbe(devices[0] if devices else self.device, self.metric)

    def close(self) -> None:
        for pid in list(self._peaks):
            self._forget(pid)
        self._processes.clear()
