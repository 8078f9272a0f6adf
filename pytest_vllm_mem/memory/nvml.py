"""NVML in one place: loading and init/shutdown, errors as clear messages, process lists, and GPUs named as vLLM does.

Every NVML call of the package goes through `Nvml`, so an NVML failure reads the same everywhere: `NvmlUnavailable`
when NVML cannot be loaded or initialized (no library, no driver: a CPU host), `NvmlError` with the call, the device
and a next step when a call fails after that. Error codes are NVML's (pynvml maps each to an NVMLError subclass and
keeps the code in `.value`); they are compared by code so that any nvidia-ml-py version, and the tests' fake, match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

from pytest_vllm_mem.memory.device import DeviceError, DeviceInfo

__all__ = ["Nvml", "NvmlError", "NvmlUnavailable", "ResolvedDevice", "device_count", "host_memory", "nvml_session"]

# NVML's return codes (nvml.h); stable across driver versions.
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
# A process list changes between NVML's count call and its fill call (a process started or exited): pynvml raises
# INSUFFICIENT_SIZE, some drivers NOT_FOUND. Asking again is right; giving up after a few tries is a missing sample.
_RACE_CODES = (INSUFFICIENT_SIZE, NOT_FOUND)
_RACE_TRIES = 3
_HINTS = {
    GPU_IS_LOST: "the GPU fell off the bus or needs a reset: check `nvidia-smi` and the kernel log (Xid errors)",
    NO_PERMISSION: "this user may not query the GPU: in a container, check that the GPU's device files are mounted",
    LIB_RM_VERSION_MISMATCH: "the NVIDIA driver was updated without a reboot: reboot, or reload the nvidia module",
}
_DEFAULT_HINT = "check the GPU with `nvidia-smi`"


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of the host, psutil's MemTotal and MemAvailable on Linux: a unified-memory GPU's
    memory."""
    memory = psutil.virtual_memory()
    return int(memory.total), int(memory.available)


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialized: no nvidia-ml-py, no driver, no GPU (the CPU backend's case)."""


class NvmlError(RuntimeError):
    """An NVML call failed after NVML initialized. The message names the call, the device and what to check."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def _code(error: BaseException) -> int | None:
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def describe(error: BaseException) -> str:
    """`GPU is lost (NVML error 15)`; never raises (str() of an unknown NVML code asks the library again)."""
    try:
        text = str(error) or type(error).__name__
    except Exception:
        text = type(error).__name__
    code = _code(error)
    return f"{text} (NVML error {code})" if code is not None else text


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py versions return bytes from the name getters, newer ones str.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True)
class ResolvedDevice:
    info: DeviceInfo
    handle: Any


class Nvml:
    """One initialized NVML session over the `pynvml` module (or a stand-in with its interface). close() once."""

    def __init__(self, module: Any | None = None) -> None:
        try:
            if module is None:
                import pynvml  # package nvidia-ml-py

                module = pynvml
            module.nvmlInit()
        except Exception as error:  # ImportError, NVMLError (driver not loaded, library not found), OSError
            raise NvmlUnavailable(f"NVML is not available: {describe(error)}") from error
        self.module = module
        self._error_type: type[BaseException] = getattr(module, "NVMLError", Exception)
        self._closed = False
        self._versioned: dict[str, str] = {}  # unversioned getter -> the _v2 one, once the driver refused it
        self._memory_v2: bool | None = None  # None: not tried yet
        self._unified = False  # the device has no NVML memory query: its figures are the host's (GB10)
        self._unsupported: set[str] = set()  # process lists this driver cannot give (MPS on old drivers)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.module.nvmlShutdown()
            except Exception:
                pass  # shutting down must not hide the error that led here

    # -- calls --

    def call(self, what: str, label: str, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)`, an NVML error turned into NvmlError("NVML could not <what> of <label>: ...")."""
        try:
            return function(*args)
        except self._error_type as error:
            raise self._error(what, label, error) from None

    def _error(self, what: str, label: str, error: BaseException) -> NvmlError:
        code = _code(error)
        hint = _HINTS.get(code, _DEFAULT_HINT) if code is not None else _DEFAULT_HINT
        return NvmlError(f"NVML could not {what} of {label}: {describe(error)}; {hint}.", code)

    def is_error(self, error: BaseException, *codes: int) -> bool:
        return isinstance(error, self._error_type) and _code(error) in codes

    def count(self) -> int:
        return int(self.call("count the GPUs", "this host", self.module.nvmlDeviceGetCount))

    def handle_by_index(self, index: int) -> Any:
        return self.call("open a handle", f"GPU {index}", self.module.nvmlDeviceGetHandleByIndex, index)

    def memory(self, handle: Any, label: str) -> tuple[int, int, int]:
        """(total, used, free) bytes of a GPU or a MIG slice, as CUDA counts them (see memory_with_reserved)."""
        total, used, free, _reserved = self.memory_with_reserved(handle, label)
        return total, used, free

    def memory_with_reserved(self, handle: Any, label: str) -> tuple[int, int, int, int]:
        """(total, used, free, reserved) bytes of a GPU or a MIG slice, the first three as CUDA counts them.

        NVML's v1 figures count the memory the driver reserves for itself as used and in the total (about 698 MiB
        on an H200); CUDA's cuMemGetInfo, from which vLLM sizes everything, leaves it out. The v2 call
        (nvmlDeviceGetMemoryInfo_v2, drivers >= 510) reports it apart as `reserved`: total - reserved is CUDA's
        total, and its `used` excludes it. Drivers or boards without v2 give the v1 figures.
        """
        if self._memory_v2 is not False:
            version = getattr(self.module, "nvmlMemory_v2", None)
            try:
                if version is None:
                    raise TypeError("nvidia-ml-py has no nvmlMemory_v2")
                info = self.module.nvmlDeviceGetMemoryInfo(handle, version=version)
                reserved = int(info.reserved)
                self._memory_v2 = True
                return int(info.total) - reserved, int(info.used), int(info.free), reserved
            except self._error_type as error:
                if _code(error) not in (NOT_SUPPORTED, FUNCTION_NOT_FOUND, INVALID_ARGUMENT):
                    raise self._error("read the memory", label, error) from None
                self._memory_v2 = False
            except (TypeError, AttributeError):
                self._memory_v2 = False  # an nvidia-ml-py older than the version argument
        try:
            info = self.module.nvmlDeviceGetMemoryInfo(handle)
        except self._error_type as error:
            if _code(error) != NOT_SUPPORTED:
                raise self._error("read the memory", label, error) from None
            return self._unified_memory(label, error)
        return int(info.total), int(info.used), int(info.free), 0

    def _unified_memory(self, label: str, error: BaseException) -> tuple[int, int, int, int]:
        """A device with no NVML memory query: DGX Spark's GB10, whose GPU shares the host's memory (NVIDIA's DGX Spark
        known issues: nvidia-smi shows "Memory-Usage: Not Supported"; both memory calls return NOT_SUPPORTED). Its
        memory is the host's, as /proc/meminfo counts it (read through psutil; what gpud and nvtop fall back to there);
        per-process figures (usedGpuMemory) still work."""
        try:
            total, available = host_memory()
        except OSError as failure:
            raise NvmlError(
                f"NVML could not read the memory of {label}: {describe(error)}, and the host's memory could not stand "
                f"in for it (a unified-memory device shares the host's memory): {failure}.",
                NOT_SUPPORTED,
            ) from None
        self._unified = True
        return total, total - available, available, 0

    @property
    def memory_version(self) -> str:
        """ "v2" when the driver reports reserved memory apart (the totals are CUDA's), "v1" otherwise, "unified"
        when the device has no memory query and its figures are the host's (_unified_memory)."""
        return "unified" if self._unified else "v2" if self._memory_v2 else "v1"

    def name(self, handle: Any, label: str) -> str:
        return _text(self.call("read the name", label, self.module.nvmlDeviceGetName, handle))

    def uuid(self, handle: Any) -> str | None:
        try:
            return _text(self.module.nvmlDeviceGetUUID(handle))
        except self._error_type:
            return None  # an old board without UUID support can still be used by index

    def process_name(self, pid: int) -> str | None:
        # The driver's name is right even when the pid belongs to another PID namespace.
        try:
            return _text(self.module.nvmlSystemGetProcessName(pid))
        except Exception:  # gone since the list was read, or not ours to see: the caller asks psutil
            return None

    def processes(self, handle: Any, label: str) -> dict[int, int | None]:
        """pid -> usedGpuMemory (None = the driver cannot tell) of every process with a context on the device.

        Compute and graphics contexts both hold memory; a process with both is listed twice with the same memory.
        Clients of an MPS server are in a third list (nvmlDeviceGetMPSComputeRunningProcesses): the compute list
        then shows the MPS server itself. A graphics or MPS list the board, driver or nvidia-ml-py does not have is
        empty; any other failure raises NvmlError: the caller must not read "no process" into it (that was a false
        0 sample).
        """
        found: dict[int, int | None] = {}
        for kind in ("Compute", "Graphics", "MPSCompute"):
            if kind == "MPSCompute" and kind in self._unsupported:
                continue
            try:
                processes = self._process_list(f"nvmlDeviceGet{kind}RunningProcesses", handle, label)
            except NvmlError as error:
                if kind == "Graphics" and error.code == NOT_SUPPORTED:
                    continue  # compute-only boards (most data-center GPUs)
                if kind == "MPSCompute" and error.code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND, None):
                    self._unsupported.add(kind)  # no MPS on this driver or nvidia-ml-py: asked once
                    continue
                raise
            for process in processes:
                pid, used = int(process.pid), process.usedGpuMemory
                previous = found.get(pid)
                if pid not in found or (used is not None and (previous is None or used > previous)):
                    found[pid] = None if used is None else int(used)
        return found

    def _process_list(self, getter: str, handle: Any, label: str) -> list[Any]:
        kind = "MPS client" if "MPS" in getter else "compute" if "Compute" in getter else "graphics"
        what = f"list the {kind} processes"
        name = self._versioned.get(getter, getter)
        races = 0
        while True:
            function = getattr(self.module, name, None)
            if function is None:
                raise NvmlError(
                    f"NVML could not {what} of {label}: nvidia-ml-py has no {name}; install a current "
                    "nvidia-ml-py (pip install -U nvidia-ml-py)."
                )
            try:
                return list(function(handle))
            except self._error_type as error:
                if _code(error) in _RACE_CODES and races < _RACE_TRIES - 1:
                    races += 1
                    continue
                if _code(error) == FUNCTION_NOT_FOUND and name == getter:
                    name = self._versioned[getter] = f"{getter}_v2"
                    continue
                raise self._error(what, label, error) from None
            except Exception as error:
                # nvidia-ml-py's unversioned getters call the newest struct version (_v3) and raise
                # NVMLLibraryMismatchError, not an NVMLError, on drivers that lack it: the _v2 call works there.
                if name != getter:
                    raise NvmlError(f"NVML could not {what} of {label}: {describe(error)}; {_DEFAULT_HINT}.") from None
                name = self._versioned[getter] = f"{getter}_v2"

    # -- devices --

    def mig_slices(self, parent: Any, label: str) -> list[tuple[int, Any]]:
        """(slot, handle) of the MIG slices of a GPU in MIG mode; [] when MIG is off or not supported."""
        module = self.module
        try:
            current, _pending = module.nvmlDeviceGetMigMode(parent)
        except self._error_type as error:
            if _code(error) in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                return []
            raise self._error("read the MIG mode", label, error) from None
        except AttributeError:
            return []  # nvidia-ml-py older than MIG
        if int(current) != int(getattr(module, "NVML_DEVICE_MIG_ENABLE", 1)):
            return []
        slots = int(self.call("count the MIG slices", label, module.nvmlDeviceGetMaxMigDeviceCount, parent))
        slices = []
        for slot in range(slots):
            try:
                slices.append((slot, module.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)))
            except self._error_type as error:
                if _code(error) != NOT_FOUND:  # NOT_FOUND: no slice was created in this slot
                    raise self._error(f"open MIG slot {slot}", label, error) from None
        return slices

    def describe_device(self, handle: Any, index: int, mig_index: int | None = None) -> DeviceInfo:
        label = f"GPU {index}" + (f" MIG {mig_index}" if mig_index is not None else "")
        total, _used, _free, reserved = self.memory_with_reserved(handle, label)
        return DeviceInfo("cuda", self.name(handle, label), total, index, self.uuid(handle), mig_index, reserved)

    def device_by_index(self, index: int) -> ResolvedDevice:
        count = self.count()
        if not 0 <= index < count:
            raise DeviceError(
                f"GPU index {index} does not exist: NVML sees {count} GPU(s), numbered 0 to {count - 1} in PCI bus "
                "order (CUDA_VISIBLE_DEVICES does not renumber them). Pass one of those indexes."
            )
        handle = self.handle_by_index(index)
        return ResolvedDevice(self.describe_device(handle, index), handle)

    def handle_for(self, info: DeviceInfo) -> Any:
        """Open `info` again (in another probe): by index, and a MIG slice by its slot on the parent."""
        if info.index is None:
            raise DeviceError(f"device {info.name!r} is not an NVIDIA GPU (backend {info.backend!r}): it has no index.")
        parent = self.handle_by_index(info.index)
        if info.mig_index is None:
            return parent
        return self.call(
            f"open MIG slot {info.mig_index}",
            f"GPU {info.index}",
            self.module.nvmlDeviceGetMigDeviceHandleByIndex,
            parent,
            info.mig_index,
        )

    def resolve(self, visible: str | None) -> list[ResolvedDevice]:
        """The devices CUDA gives a process whose CUDA_VISIBLE_DEVICES is `visible` (None = unset), in its order.

        Entries are NVML indexes, `GPU-<uuid>` or `MIG-<uuid>` (a unique prefix is enough, as CUDA allows), or the
        older `MIG-GPU-<uuid>/<gpu instance>/<compute instance>`. A MIG slice is looked up through NVML, so its
        memory is the slice's, not the card's. Unset: every GPU, the slices of a GPU in MIG mode in its place.
        """
        if visible is not None and not visible.strip():
            return []  # CUDA_VISIBLE_DEVICES="" hides every GPU
        catalogue = _Catalogue(self)
        if visible is None:
            return [device for gpu in catalogue.gpus() for device in (catalogue.slices(gpu) or [gpu])]
        resolved: list[ResolvedDevice] = []
        for entry in (part.strip() for part in visible.split(",")):
            device = catalogue.find(entry, visible)
            if any(device.info == seen.info for seen in resolved):
                raise DeviceError(
                    f"CUDA_VISIBLE_DEVICES={visible!r} names {entry!r} twice; CUDA then shows no GPU "
                    "at all. Name each GPU once."
                )
            resolved.append(device)
        return resolved


class _Catalogue:
    """The host's GPUs and MIG slices, read once per resolution."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._gpus: list[ResolvedDevice] | None = None
        self._slices: dict[int, list[ResolvedDevice]] = {}

    def gpus(self) -> list[ResolvedDevice]:
        if self._gpus is None:
            self._gpus = [self._nvml.device_by_index(index) for index in range(self._nvml.count())]
        return self._gpus

    def slices(self, gpu: ResolvedDevice) -> list[ResolvedDevice]:
        index = gpu.info.index
        assert index is not None
        if index not in self._slices:
            self._slices[index] = [
                ResolvedDevice(self._nvml.describe_device(handle, index, slot), handle)
                for slot, handle in self._nvml.mig_slices(gpu.handle, gpu.info.label)
            ]
        return self._slices[index]

    def find(self, entry: str, visible: str) -> ResolvedDevice:
        gpus = self.gpus()
        if entry.isdigit():
            if int(entry) >= len(gpus):
                raise DeviceError(
                    f"CUDA_VISIBLE_DEVICES={visible!r} names GPU {entry}, but NVML sees {len(gpus)} "
                    f"GPU(s), numbered 0 to {len(gpus) - 1}. Use indexes, GPU-<uuid> or MIG-<uuid> "
                    "of GPUs that exist (`nvidia-smi -L` lists them)."
                )
            return gpus[int(entry)]
        if entry.startswith("MIG-GPU-") and entry.count("/") == 2:
            return self._legacy_mig(entry, visible)
        if entry.startswith("MIG-"):
            return self._unique(entry, [s for gpu in gpus for s in self.slices(gpu)], visible, "MIG slice")
        if entry.startswith("GPU-"):
            return self._unique(entry, gpus, visible, "GPU")
        raise DeviceError(
            f"CUDA_VISIBLE_DEVICES={visible!r} has the entry {entry!r}, which is not a GPU: accepted "
            "are NVML indexes (0,1), GPU-<uuid> and MIG-<uuid> or unique prefixes of them (`nvidia-smi "
            "-L` lists them), separated by commas."
        )

    @staticmethod
    def _unique(entry: str, candidates: list[ResolvedDevice], visible: str, kind: str) -> ResolvedDevice:
        matches = [device for device in candidates if device.info.uuid and device.info.uuid.startswith(entry)]
        if len(matches) == 1:
            return matches[0]
        which = "no" if not matches else f"{len(matches)}"
        raise DeviceError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: {entry!r} matches {which} {kind} UUID(s) on this host; "
            "name a UUID (or a prefix of exactly one) that `nvidia-smi -L` lists."
        )

    def _legacy_mig(self, entry: str, visible: str) -> ResolvedDevice:
        gpu_uuid, gpu_instance, compute_instance = entry[len("MIG-") :].split("/")
        parent = self._unique(gpu_uuid, self.gpus(), visible, "GPU")
        module = self._nvml.module
        for device in self.slices(parent):
            ids = (
                self._nvml.call(
                    "read the GPU instance", device.info.label, module.nvmlDeviceGetGpuInstanceId, device.handle
                ),
                self._nvml.call(
                    "read the compute instance", device.info.label, module.nvmlDeviceGetComputeInstanceId, device.handle
                ),
            )
            if (str(ids[0]), str(ids[1])) == (gpu_instance, compute_instance):
                return device
        raise DeviceError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: {parent.info.label} has no MIG slice with GPU instance "
            f"{gpu_instance} and compute instance {compute_instance}; `nvidia-smi -L` lists the slices."
        )


@contextmanager
def nvml_session(module: Any | None = None) -> Iterator[Nvml]:
    """`with nvml_session() as nvml:` NVML initialized for the block, shut down after. NvmlUnavailable if it cannot."""
    nvml = Nvml(module)
    try:
        yield nvml
    finally:
        nvml.close()


def device_count(module: Any | None = None) -> int:
    """GPUs NVML sees (0 without NVML or a driver, i.e. on the CPU backend)."""
    try:
        with nvml_session(module) as nvml:
            return nvml.count()
    except (NvmlUnavailable, NvmlError):
        return 0
