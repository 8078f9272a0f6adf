"""Memory of a vLLM server measured from outside: probes (NVML on NVIDIA, process-tree RSS on CPU) and a sampler thread.

The server is a process tree (API server -> EngineCore -> Worker). A `MemoryProbe` answers "how much device memory do
these pids hold now"; `MemorySampler` asks it every `period_s` in a background thread, over the tree as it is now.
`detect_device()` picks the backend at runtime and `make_probe()` builds the matching probe, so callers never branch
on the backend themselves.
"""

from __future__ import annotations

import bisect
import math
import os
import sys
import threading
import time
from array import array
from collections.abc import Collection
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, Literal, Protocol, runtime_checkable

import psutil

__all__ = [
    "DeviceInfo",
    "MemoryProbe",
    "NvmlProbe",
    "ProcessTreeProbe",
    "MemorySampler",
    "process_tree",
    "detect_device",
    "make_probe",
    "cpu_memory_node",
    "cpu_node_memory",
    "wait_for_free_memory",
]


@dataclass(frozen=True)
class DeviceInfo:
    """The device a vLLM server allocates its KV cache on."""

    backend: str  # "cuda" or "cpu"
    name: str  # NVML device name, or the CPU "model name" from /proc/cpuinfo
    total_bytes: int  # GPU: NVML total memory; CPU: the NUMA-node total vLLM's CPU worker sizes its KV cache from
    index: int | None  # NVML (physical, PCI-order) GPU index; None on CPU


@runtime_checkable
class MemoryProbe(Protocol):
    device: DeviceInfo

    def used_bytes(self, pids: Collection[int]) -> int:
        """Memory held by these processes now."""
        ...

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        """(pid, bytes, process name) of other processes holding device memory (GPU only; CPU returns [])."""
        ...

    def device_used_bytes(self) -> int:
        """Used memory of the whole device."""
        ...

    @property
    def default_period_s(self) -> float:
        """Sampling period that suits this probe (MemorySampler's default)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------------------------------
# Process trees


def process_tree(root_pid: int) -> set[int]:
    """`root_pid` and all its descendants alive now; empty if the root is gone.

    Finding children means reading every process's parent pid, so the cost grows with the number of processes on
    the machine, not with the tree: MemorySampler caches the result. On Linux the parents come straight from
    /proc/PID/stat (about 4x cheaper than psutil's children(), which builds Process objects); elsewhere psutil.
    """
    parents = _parent_pids() if sys.platform.startswith("linux") else None
    if parents is None:
        try:
            children = psutil.Process(root_pid).children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return set()
        return {root_pid, *(child.pid for child in children)}
    if root_pid not in parents:
        return set()
    children_of: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children_of.setdefault(parent, []).append(pid)
    tree, pending = {root_pid}, [root_pid]
    while pending:
        for child in children_of.get(pending.pop(), ()):
            if child not in tree:
                tree.add(child)
                pending.append(child)
    return tree


def _parent_pids() -> dict[int, int] | None:
    """pid -> parent pid of every process, from /proc/PID/stat; None if /proc cannot be listed."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    parents = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 1024)
            finally:
                os.close(fd)
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
            parents[int(name)] = int(stat[stat.rindex(b")") + 2 :].split(b" ", 2)[1])
        except (OSError, ValueError, IndexError):
            continue  # exited between listdir and open
    return parents


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


# ---------------------------------------------------------------------------------------------------------------------
# GPU: NVML


def _import_nvml(nvml: Any | None) -> Any:
    if nvml is not None:
        return nvml
    import pynvml  # package nvidia-ml-py

    return pynvml


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py versions return bytes from the name getters, newer ones str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlProbe:
    """Memory of processes on one NVIDIA GPU, through NVML (`pynvml` from the nvidia-ml-py package).

    Two modes, in `self.mode`:
    - "per_process": the sum of `usedGpuMemory` the driver reports for our pids (compute + graphics contexts). Exact,
      and blind to other processes on the card.
    - "device_delta": device used memory now minus device used memory when this probe was created. Used when the
      driver cannot attribute memory to our pids: inside a container with its own PID namespace NVML reports host
      pids, which match none of ours, and some drivers (WDDM, some vGPU/MIG setups) report `usedGpuMemory` as
      unavailable (pynvml gives None). It counts any other process's change in memory as ours, so the baseline is
      taken before the server starts; `wait_for_free_memory` helps make that baseline quiet.
    Until one of our pids has been seen in the driver's list, "none of our pids reported" means "fall back"; once
    seen, it means our processes have released the GPU, and the probe reports 0 in per-process mode.
    """

    # NVML reports memory as it is when asked: a 100 ms peak needs samples closer than 100 ms.
    default_period_s = 0.05
    tracks_peaks = False

    def __init__(self, device_index: int = 0, nvml: ModuleType | Any | None = None) -> None:
        self._nvml = _import_nvml(nvml)
        self._nvml.nvmlInit()
        self._closed = False
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
            if not 0 <= device_index < count:
                raise ValueError(
                    f"NvmlProbe device_index {device_index} does not exist: NVML sees {count} GPU(s), numbered "
                    f"0 to {count - 1} in PCI bus order (CUDA_VISIBLE_DEVICES does not renumber them). Pass one of "
                    "those indexes."
                )
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device_index)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            self.device = DeviceInfo(
                backend="cuda",
                name=_text(self._nvml.nvmlDeviceGetName(self._handle)),
                total_bytes=int(memory.total),
                index=device_index,
            )
        except BaseException:
            self.close()
            raise
        self._baseline_used = int(memory.used)
        self._seen_own_pid = False
        self.mode: Literal["per_process", "device_delta"] = "per_process"

    def _running_processes(self) -> dict[int, int | None]:
        """pid -> usedGpuMemory (None = not available) of every process with a context on the device."""
        found: dict[int, int | None] = {}
        getters = (self._nvml.nvmlDeviceGetComputeRunningProcesses, self._nvml.nvmlDeviceGetGraphicsRunningProcesses)
        for getter in getters:
            try:
                processes = getter(self._handle)
            except self._nvml.NVMLError:
                continue  # e.g. graphics list not supported on compute-only boards
            for process in processes:
                used = process.usedGpuMemory
                previous = found.get(process.pid)
                # A process with both a compute and a graphics context is listed twice with the same memory.
                if process.pid not in found or (used is not None and (previous is None or used > previous)):
                    found[process.pid] = None if used is None else int(used)
        return found

    def used_bytes(self, pids: Collection[int]) -> int:
        running = self._running_processes()
        ours = [running[pid] for pid in pids if pid in running]
        if ours and all(used is not None for used in ours):
            self._seen_own_pid = True
            self.mode = "per_process"
            return sum(used for used in ours if used is not None)
        if not ours and self._seen_own_pid:
            self.mode = "per_process"
            return 0
        self.mode = "device_delta"
        return max(0, self.device_used_bytes() - self._baseline_used)

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        excluded = set(exclude_pids)
        holders = []
        for pid, used in sorted(self._running_processes().items()):
            if pid not in excluded:
                holders.append((pid, used or 0, self._name_of(pid)))
        return holders

    def _name_of(self, pid: int) -> str:
        # The driver's name is right even when the pid belongs to another PID namespace; psutil's is a fallback.
        try:
            return _text(self._nvml.nvmlSystemGetProcessName(pid))
        except Exception:
            return _process_name(pid)

    def device_used_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass  # shutting down a half-initialized NVML must not hide the original error


# ---------------------------------------------------------------------------------------------------------------------
# CPU: process-tree RSS, and the node memory vLLM's CPU worker sees

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


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _cpu_device() -> DeviceInfo:
    total, _available = cpu_node_memory()
    return DeviceInfo(backend="cpu", name=_cpu_model_name(), total_bytes=total, index=None)


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
        self.device = device if device is not None else _cpu_device()
        self.metric = metric
        self.tracks_peaks = metric == "rss" and sys.platform.startswith("linux")
        self._peaks: dict[int, _PeakRss] = {}
        self._processes: dict[int, psutil.Process] = {}  # cached: psutil.Process() costs a /proc read to create

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
            return process.memory_info().rss
        return getattr(process.memory_full_info(), self.metric)

    def used_bytes(self, pids: Collection[int]) -> int:
        total = 0
        for pid in pids:
            try:
                total += self._read(pid)
            except (OSError, ValueError, psutil.Error):  # exited: ESRCH, ENOENT, NoSuchProcess
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

    def close(self) -> None:
        for pid in list(self._peaks):
            self._forget(pid)
        self._processes.clear()


# ---------------------------------------------------------------------------------------------------------------------
# Backend choice


def detect_device(device_index: int = 0, nvml: ModuleType | Any | None = None) -> DeviceInfo:
    """The device at `device_index` if NVML initializes and sees at least one GPU, else the CPU.

    Any failure to load or initialize NVML (no pynvml, no driver, no device) means "no NVIDIA GPU here". An index
    beyond the GPUs NVML sees is a mistake in the caller's input and raises ValueError.
    """
    try:
        library = _import_nvml(nvml)
        library.nvmlInit()
    except Exception:
        return _cpu_device()
    try:
        count = int(library.nvmlDeviceGetCount())
        if count < 1:
            return _cpu_device()
        if not 0 <= device_index < count:
            raise ValueError(
                f"GPU device_index {device_index} does not exist: NVML sees {count} GPU(s), numbered 0 to "
                f"{count - 1} in PCI bus order (CUDA_VISIBLE_DEVICES does not renumber them). Pass one of those."
            )
        handle = library.nvmlDeviceGetHandleByIndex(device_index)
        return DeviceInfo(
            backend="cuda",
            name=_text(library.nvmlDeviceGetName(handle)),
            total_bytes=int(library.nvmlDeviceGetMemoryInfo(handle).total),
            index=device_index,
        )
    finally:
        try:
            library.nvmlShutdown()
        except Exception:
            pass


def make_probe(device: DeviceInfo, nvml: ModuleType | Any | None = None) -> MemoryProbe:
    """The probe for `device`: NvmlProbe for "cuda", ProcessTreeProbe for "cpu"."""
    if device.backend == "cuda":
        return NvmlProbe(device.index if device.index is not None else 0, nvml=nvml)
    if device.backend == "cpu":
        return ProcessTreeProbe(device)
    raise ValueError(
        f"DeviceInfo backend {device.backend!r} has no memory probe: accepted backends are 'cuda' (NVML) and 'cpu' "
        "(process-tree RSS). Build the DeviceInfo with detect_device()."
    )


def wait_for_free_memory(
    probe: MemoryProbe,
    exclude_pids: Collection[int] = (),
    *,
    needed_bytes: int | None = None,
    needed_fraction: float | None = None,
    timeout_s: float,
    poll_s: float = 0.5,
) -> list[tuple[int, int, str]]:
    """Before starting a server, wait until other processes stop holding the device; return who still holds it.

    Clear (returns []) once no other process holds device memory, or once the device has at least the needed free
    memory: `needed_bytes`, or `ceil(total * needed_fraction)` (pass the server's gpu_memory_utilization: it is the
    free memory vLLM demands at startup). Otherwise polls every `poll_s` until `timeout_s` and returns the remaining
    (pid, bytes, name) holders. An earlier server still exiting is the usual holder ("pseudo OOM").
    On CPU it returns [] at once: vLLM checks host memory itself and nothing holds it exclusively.
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
    total = probe.device.total_bytes
    needed = needed_bytes if needed_fraction is None else math.ceil(total * needed_fraction)
    deadline = time.monotonic() + timeout_s
    while True:
        holders = probe.other_holders(exclude_pids)
        if not holders:
            return []
        if needed is not None and total - probe.device_used_bytes() >= needed:
            return []
        if time.monotonic() >= deadline:
            return holders
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))


# ---------------------------------------------------------------------------------------------------------------------
# Sampler


class MemorySampler:
    """Background thread: every `period_s`, `probe.used_bytes(process_tree(root_pid))`; keeps (t_monotonic, bytes).

    `period_s` None takes the probe's `default_period_s`: 0.05 s for NVML, which sees only the moment it is asked;
    0.25 s for a probe that `tracks_peaks` (each sample is then the peak since the previous one, so a 100 ms peak is
    caught whatever the period, and placed in time to within one period). All samples are kept, in two flat arrays
    (16 bytes a sample: a 1-hour run at 50 ms is 72k samples, ~1.2 MB), so peaks between any two markers stay exact.
    The pid set is cached: finding a tree's processes means reading every process's parent on the machine (5 ms
    right after a wake-up on a 2-core VM), while vLLM's tree only changes during startup. It is refreshed after
    `tree_refresh_s`, then at doubling intervals up to `max_tree_refresh_s` while it stays the same, and again
    after `tree_refresh_s` once it changed. A process that exits reads as 0 from then on. `cpu_time_s` is the CPU
    time the sampler thread has used so far. The probe belongs to the caller: stop() does not close it.
    """

    def __init__(self, probe: MemoryProbe, root_pid: int, period_s: float | None = None, tree_refresh_s: float = 1.0,
                 max_tree_refresh_s: float = 4.0) -> None:
        if period_s is None:
            period_s = getattr(probe, "default_period_s", 0.05)
        if not period_s > 0:
            raise ValueError(f"MemorySampler period_s {period_s!r} must be a positive number of seconds, e.g. 0.05.")
        self.probe = probe
        self.root_pid = root_pid
        self.period_s = period_s
        self.tree_refresh_s = tree_refresh_s
        self.max_tree_refresh_s = max(tree_refresh_s, max_tree_refresh_s)
        self._refresh_after = tree_refresh_s
        self._times = array("d")
        self._bytes = array("q")
        self._markers: list[tuple[str, float]] = []
        self._lock = threading.Lock()  # one sample at a time: the thread and sample_now() share the pid cache
        self._pids: set[int] = set()
        self._pids_at = -math.inf
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cpu_time_s = 0.0
        self.error: BaseException | None = None  # first exception the probe raised in the thread, if any

    # -- lifecycle --

    def start(self) -> MemorySampler:
        if self._thread is not None:
            if self._stop.is_set():
                raise RuntimeError("MemorySampler was stopped; it runs once: create a new MemorySampler.")
            return self
        self._thread = threading.Thread(target=self._run, name=f"vllm-mem-sampler-{self.root_pid}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        cpu_start = time.thread_time()
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_now()
            except Exception as error:  # keep sampling: one failed read must not end the measurement
                if self.error is None:
                    self.error = error
            self.cpu_time_s = time.thread_time() - cpu_start
            next_at += self.period_s
            now = time.monotonic()
            if next_at < now:  # fell behind (suspended, slow probe): skip missed ticks instead of bursting
                next_at = now
            self._stop.wait(next_at - now)
        self.cpu_time_s = time.thread_time() - cpu_start

    # -- sampling --

    def _current_pids(self, now: float) -> set[int]:
        if now - self._pids_at >= self._refresh_after or not self._pids:
            pids = process_tree(self.root_pid)
            same = pids == self._pids
            self._refresh_after = min(2 * self._refresh_after, self.max_tree_refresh_s) if same else self.tree_refresh_s
            self._pids, self._pids_at = pids, now
        return self._pids

    def sample_now(self) -> int:
        """Take one sample synchronously (also recorded): call it right before and after a short phase."""
        with self._lock:
            used = self.probe.used_bytes(self._current_pids(time.monotonic()))
            self._times.append(time.monotonic())
            self._bytes.append(used)
        return used

    def mark(self, label: str) -> float:
        """Record a phase marker, e.g. "startup", "healthy", "load:1"; returns its monotonic time."""
        t = time.monotonic()
        with self._lock:
            self._markers.append((label, t))
        return t

    # -- results --

    def peak_between(self, t0: float, t1: float | None = None) -> int:
        """Largest sample taken in [t0, t1] (t1 None = now); 0 if there is none."""
        with self._lock:
            start = bisect.bisect_left(self._times, t0)
            end = len(self._times) if t1 is None else bisect.bisect_right(self._times, t1)
            return max(self._bytes[start:end], default=0)

    @property
    def samples(self) -> list[tuple[float, int]]:
        with self._lock:
            return list(zip(self._times, self._bytes))

    @property
    def markers(self) -> list[tuple[str, float]]:
        with self._lock:
            return list(self._markers)

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            return max(self._bytes, default=0)
