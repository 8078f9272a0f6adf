"""A stand-in for the `pynvml` module (nvidia-ml-py 13.x) that behaves like the real one where the plugin cares.

Modelled on pynvml.py itself, not on what the plugin happens to call:
- errors are integer NVML return codes; `NVMLError(code)` returns an instance of the code's subclass
  (`NVMLError_NotFound`, `NVMLError_GpuIsLost`, ...) through `NVMLError.__new__`, keeps the code in `.value`, and
  subclasses are generated from the `NVML_ERROR_*` constants as `_extractNVMLErrorsAsClasses` does;
- calls before nvmlInit() (or after the last nvmlShutdown(); init is reference counted) raise UNINITIALIZED;
- several GPUs, each with a UUID, optionally in MIG mode with slices in slots (empty slots raise NOT_FOUND), each
  slice with its own UUID, memory, GPU/compute instance ids and processes; a parent in MIG mode lists the
  processes of all its slices;
- the process lists are two calls in the real module (count, then fill an array of 2*count+5): a process list that
  grows past that between the calls raises INSUFFICIENT_SIZE; tests can also script the codes the next queries
  raise (a driver's NOT_FOUND race), and a GPU that is lost raises GPU_IS_LOST everywhere;
- the unversioned process getters call `_v3` and raise `NVMLLibraryMismatchError` (not an NVMLError) when the
  driver lacks it, as pynvml's `throwOnVersionMismatch` does;
- names and UUIDs come back as str (nvidia-ml-py >= 12) unless a test gives bytes, as older versions returned;
- memory as c_nvmlMemory_t (v1: `used` and `total` include the driver's reserved memory) or, with
  `version=nvmlMemory_v2`, as c_nvmlMemory_v2_t (`total`, `reserved`, `free`, `used` without the reserved part; CUDA's
  total is total - reserved); a driver without nvmlDeviceGetMemoryInfo_v2 raises FUNCTION_NOT_FOUND for it;
- `usedGpuMemory` None where the driver says NVML_VALUE_NOT_AVAILABLE (pynvml converts it), or 0 where a container
  driver reports 0 for a process that holds memory (`used` of the GPU still rises);
- MPS clients in their own list (nvmlDeviceGetMPSComputeRunningProcesses, `_v2`, `_v3`);
- the host's processes as /proc shows them (`FakeHost`): session, parent and name per pid; a pid it does not list
  is in another PID namespace (NVML may list host pids that /proc cannot see).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_VALUE_NOT_AVAILABLE_ULONGLONG = 2**64 - 1  # pynvml: NVML_VALUE_NOT_AVAILABLE_ulonglong = c_ulonglong(-1)
nvmlMemory_v2 = 0x02000028  # pynvml: nvmlStructVersion(c_nvmlMemory_v2_t, 2)


class NVMLLibraryMismatchError(Exception):
    pass


class NVMLError(Exception):
    _valClassMapping: dict[int, type[NVMLError]] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self) -> str:
        return NVMLError._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _error_classes() -> dict[str, type[NVMLError]]:
    classes = {}
    for name, value in sorted(globals().items()):
        if not name.startswith("NVML_ERROR_"):
            continue
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls: type[NVMLError], *args: Any, _value: int = value) -> NVMLError:
            return NVMLError.__new__(cls, _value)

        subclass = type(class_name, (NVMLError,), {"__new__": new})
        NVMLError._valClassMapping[value] = subclass
        classes[class_name] = subclass
    return classes


globals().update(_error_classes())
ERROR_CLASSES = dict(NVMLError._valClassMapping)


@dataclass
class Proc:
    """One entry of a process list, like pynvml's nvmlFriendlyObject of c_nvmlProcessInfo_v3_t."""

    pid: int
    usedGpuMemory: int | None  # None: NVML_VALUE_NOT_AVAILABLE (WDDM, some vGPU/MIG setups)
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class Memory:
    """c_nvmlMemory_t."""

    total: int
    free: int
    used: int


@dataclass
class MemoryV2:
    """c_nvmlMemory_v2_t: the fields in pynvml's order."""

    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass
class FakeProcess:
    session: int
    parent: int = 1
    name: str = "python3"


@dataclass
class FakeHost:
    """The processes /proc shows, for NvmlProbe's `processes=`: pid -> session, parent, name. A pid not listed is in
    another PID namespace (or gone): session_of and parent_of give None, as memory.process_tree.ProcessTable does."""

    processes: dict[int, FakeProcess] = field(default_factory=dict)
    own: int = 1  # the session of "this pytest" (and of its xdist workers)

    def add(self, pid: int, session: int, parent: int = 1, name: str = "python3") -> None:
        self.processes[pid] = FakeProcess(session, parent, name)

    def server(self, root: int, *children: int) -> None:
        """A server started in a session of its own (launch/server.py: start_new_session), children under it."""
        self.add(root, root, parent=self.own)
        for child in children:
            self.add(child, root, parent=root)

    def session_of(self, pid: int) -> int | None:
        process = self.processes.get(pid)
        return process.session if process else None

    def parent_of(self, pid: int) -> int | None:
        process = self.processes.get(pid)
        return process.parent if process else None

    def name_of(self, pid: int) -> str:
        process = self.processes.get(pid)
        return process.name if process else "?"

    def own_session(self) -> int | None:
        return self.own


@dataclass
class FakeMig:
    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    total: int = 40 * GiB
    used: int = 0
    gpu_instance: int = 1
    compute_instance: int = 0
    compute: list[tuple[int, int | None]] = field(default_factory=list)


@dataclass
class FakeGpu:
    uuid: str
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GiB
    used: int = 1 * GiB  # allocated memory, the driver's reserved memory not included
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] = field(default_factory=list)
    graphics_supported: bool = False  # data-center boards: the graphics list is NOT_SUPPORTED
    reserved: int = 0  # the driver's own memory: in v1's used and total, apart in v2 (an H200: about 698 MiB)
    memory_v2: bool = True  # False: a driver older than nvmlDeviceGetMemoryInfo_v2 (before 510)
    # False: a unified-memory part (DGX Spark's GB10): both memory calls return NOT_SUPPORTED, as the driver does there
    # (580.142 and 580.173.02, raw ctypes calls quoted in XuehaiPan/nvitop#208); process lists still give usedGpuMemory.
    memory_query: bool = True
    mps: list[tuple[int, int | None]] = field(default_factory=list)  # MPS client processes
    mps_supported: bool = True
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_slots: int = 7
    migs: dict[int, FakeMig] = field(default_factory=dict)  # slot -> slice
    lost: bool = False
    fail_next: list[int] = field(default_factory=list)  # NVML codes the next process queries raise, in order
    # Called between the count and the fill call of a process query (a process starting or exiting in between).
    between_calls: Callable[[FakeGpu], None] | None = None


class _Handle:
    """Opaque like pynvml's c_nvmlDevice_t; the tests never look inside."""

    def __init__(self, gpu: FakeGpu, mig: FakeMig | None = None) -> None:
        self.gpu, self.mig = gpu, mig


class FakeNvml:
    """Use an instance where the plugin accepts an `nvml` module."""

    NVMLError = NVMLError
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: int | BaseException | None = None,
        names: dict[int, str | bytes] | None = None,
        has_v3: bool = True,
        host: FakeHost | None = None,
        versions: tuple[str, str, int] = ("560.35.03", "12.560.35.03", 12060),
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu("GPU-00000000-0000-0000-0000-000000000000")]
        self.init_error = init_error
        self.names = names or {}
        self.has_v3 = has_v3  # False: a driver older than nvidia-ml-py's newest process struct
        self.refcount = 0
        self.inits = self.shutdowns = 0
        self.process_queries = 0
        self.host = host if host is not None else FakeHost()
        self.versions = versions  # driver, NVML, CUDA driver version (12060 = 12.6)
        self.memory_queries = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("NVMLError_") and name in globals():
            return globals()[name]
        if name.startswith("NVML_ERROR_") and name in globals():
            return globals()[name]
        raise AttributeError(name)

    # -- init --

    def _check(self) -> None:
        if self.refcount == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        if isinstance(self.init_error, int):
            raise NVMLError(self.init_error)
        if self.init_error is not None:
            raise self.init_error
        self.refcount += 1
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.refcount -= 1
        self.shutdowns += 1

    # -- devices --

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._alive(_Handle(self.gpus[index]))

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        self._check()
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == text:
                return self._alive(_Handle(gpu))
            for mig in gpu.migs.values():
                if mig.uuid == text:
                    return self._alive(_Handle(gpu, mig))
        raise NVMLError(NVML_ERROR_NOT_FOUND)  # full UUIDs only: prefixes are CUDA's, not NVML's

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._alive(handle)
        return self.gpus.index(handle.gpu)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._alive(handle)
        return handle.mig.uuid if handle.mig else handle.gpu.uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str | bytes:
        self._alive(handle)
        return handle.mig.name if handle.mig else handle.gpu.name

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Memory | MemoryV2:
        self._alive(handle)
        self.memory_queries += 1
        gpu = handle.gpu
        if not gpu.memory_query:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if handle.mig:
            total, used, reserved = handle.mig.total, handle.mig.used, 0
        else:
            total, reserved = gpu.total, gpu.reserved
            used = gpu.used + sum(mig.used for mig in gpu.migs.values()) if gpu.mig_enabled else gpu.used
        free = total - reserved - used
        if not version:
            return Memory(total, free, used + reserved)
        if not gpu.memory_v2:  # pynvml's _nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if version != nvmlMemory_v2:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return MemoryV2(version, total, reserved, free, used)

    nvmlMemory_v2 = nvmlMemory_v2
    NVML_VALUE_NOT_AVAILABLE_ulonglong = NVML_VALUE_NOT_AVAILABLE_ULONGLONG

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.versions[0]

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._check()
        return self.versions[1]

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check()
        return self.versions[2]

    # -- MIG --

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._alive(handle)
        if not handle.gpu.mig_capable or handle.mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if handle.gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._alive(handle)
        if not handle.gpu.mig_capable:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return handle.gpu.mig_slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._alive(handle)
        gpu = handle.gpu
        if not gpu.mig_enabled or handle.mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= index < gpu.mig_slots:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if index not in gpu.migs:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _Handle(gpu, gpu.migs[index])

    def nvmlDeviceIsMigDeviceHandle(self, handle: _Handle) -> int:
        self._alive(handle)
        return int(handle.mig is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: _Handle) -> _Handle:
        if handle.mig is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._alive(_Handle(handle.gpu))

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        if handle.mig is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        if handle.mig is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.compute_instance

    # -- processes --

    def _entries(self, handle: _Handle, kind: str) -> list[Proc]:
        gpu = handle.gpu
        if kind == "graphics":
            return [Proc(pid, used) for pid, used in gpu.graphics]
        if kind == "mps":
            return [Proc(pid, used) for pid, used in gpu.mps]
        if handle.mig:
            mig = handle.mig
            return [Proc(pid, used, mig.gpu_instance, mig.compute_instance) for pid, used in mig.compute]
        listed = [Proc(pid, used) for pid, used in gpu.compute]
        if gpu.mig_enabled:
            listed += [
                Proc(pid, used, mig.gpu_instance, mig.compute_instance)
                for mig in gpu.migs.values()
                for pid, used in mig.compute
            ]
        return listed

    def _query(self, handle: _Handle, kind: str) -> list[Proc]:
        """pynvml's two-call protocol: count, then fill an array of 2*count+5 entries."""
        self._alive(handle)
        self.process_queries += 1
        gpu = handle.gpu
        if kind == "graphics" and not gpu.graphics_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if kind == "mps" and not gpu.mps_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if gpu.fail_next:
            raise NVMLError(gpu.fail_next.pop(0))
        count = len(self._entries(handle, kind))
        if count == 0:
            return []  # the count call succeeded: no process
        if gpu.between_calls is not None:
            gpu.between_calls(gpu)
        entries = self._entries(handle, kind)
        if len(entries) > 2 * count + 5:
            raise NVMLError(NVML_ERROR_INSUFFICIENT_SIZE)
        return entries

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Proc]:
        return self._query(handle, "compute")

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Proc]:
        if not self.has_v3:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._query(handle, "compute")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Proc]:
        return self._unversioned(self.nvmlDeviceGetComputeRunningProcesses_v3, handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: _Handle) -> list[Proc]:
        return self._query(handle, "graphics")

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: _Handle) -> list[Proc]:
        if not self.has_v3:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._query(handle, "graphics")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[Proc]:
        return self._unversioned(self.nvmlDeviceGetGraphicsRunningProcesses_v3, handle)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: _Handle) -> list[Proc]:
        return self._query(handle, "mps")

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: _Handle) -> list[Proc]:
        if not self.has_v3:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._query(handle, "mps")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: _Handle) -> list[Proc]:
        return self._unversioned(self.nvmlDeviceGetMPSComputeRunningProcesses_v3, handle)

    @staticmethod
    def _unversioned(function: Callable[[_Handle], list[Proc]], handle: _Handle) -> list[Proc]:
        try:
            return function(handle)
        except NVMLError as error:
            if error.value != NVML_ERROR_FUNCTION_NOT_FOUND:
                raise
            raise NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML lib version."
            ) from None

    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes:
        self._check()
        if pid not in self.names:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return self.names[pid]

    # -- helpers --

    def _alive(self, handle: _Handle) -> _Handle:
        self._check()
        if handle.gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return handle


def gpu_uuid(n: int) -> str:
    return f"GPU-{n:08x}-1111-2222-3333-444455556666"


def mig_uuid(n: int) -> str:
    return f"MIG-{n:08x}-aaaa-bbbb-cccc-ddddeeeeffff"


def gpus(count: int, **kwargs: Any) -> list[FakeGpu]:
    """`count` identical GPUs with distinct UUIDs."""
    return [FakeGpu(gpu_uuid(n), **kwargs) for n in range(count)]
