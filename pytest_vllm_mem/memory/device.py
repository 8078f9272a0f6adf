"""What a probe measures and what it promises: the device record, the probe protocol, and the errors of reading."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["DeviceError", "DeviceInfo", "MemoryProbe", "ProbeReadError"]


@dataclass(frozen=True)
class DeviceInfo:
    """One device a vLLM server allocates memory on: a GPU, a MIG slice of one, or the CPU's NUMA node."""

    backend: str  # "cuda" or "cpu"
    name: str  # NVML device name (a MIG slice's includes its profile, e.g. "... MIG 1g.10gb"), or the CPU model
    total_bytes: int  # GPU: CUDA's total (NVML v2 total - reserved; a MIG slice: the slice's); CPU: the NUMA node total
    index: int | None  # NVML (physical, PCI-order) GPU index; for a MIG slice its parent's; None on CPU
    uuid: str | None = None  # "GPU-..." or "MIG-...", as CUDA_VISIBLE_DEVICES may name it; None on CPU
    mig_index: int | None = None  # a MIG slice's position on its parent (nvmlDeviceGetMigDeviceHandleByIndex)
    # Memory the driver keeps for itself, outside total_bytes (NVML v2 `reserved`; 0 where only v1 is known).
    reserved_bytes: int = 0

    @property
    def card_bytes(self) -> int:
        """The card's memory as NVML's v1 total and its label count it (reserved memory included): what a tier such
        as 24gb is compared with. total_bytes, what CUDA and vLLM size from, is this less the reserved memory."""
        return self.total_bytes + self.reserved_bytes

    @property
    def label(self) -> str:
        """`GPU 0`, `GPU 1 MIG 2`, `cpu`: short enough for a report column."""
        if self.backend != "cuda":
            return self.backend
        return f"GPU {self.index}" + (f" MIG {self.mig_index}" if self.mig_index is not None else "")


class DeviceError(ValueError):
    """A device named by CUDA_VISIBLE_DEVICES or an index does not exist, or the name is ambiguous."""


class ProbeReadError(RuntimeError):
    """One reading of memory failed (a driver error, a race with processes exiting): a missing sample, never a 0."""


@runtime_checkable
class MemoryProbe(Protocol):
    """Memory held by a server's processes on each of its devices, read on demand."""

    @property
    def device(self) -> DeviceInfo:
        """The first device: tier auto, emulation and reports name it."""
        ...

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """Every device the probe reads, in the order vLLM numbers them."""
        ...

    def read(self, pids: Collection[int]) -> tuple[int, ...]:
        """Bytes held by these processes (and, on GPUs, by processes new on the devices) per device now.

        Raises ProbeReadError when the reading failed: the sample is missing, not 0."""
        ...

    def used_bytes(self, pids: Collection[int]) -> int:
        """The sum of read(pids) over the devices."""
        ...

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        """(pid, bytes, process name) of other processes holding memory on the devices (GPU only; CPU returns [])."""
        ...

    def device_used_bytes(self) -> int:
        """Used memory of the devices, summed."""
        ...

    def free_bytes(self) -> tuple[int, ...]:
        """Free memory of each device now."""
        ...

    def scoped(self, devices: Sequence[DeviceInfo]) -> MemoryProbe:
        """A new probe of the same kind over `devices` (one server's), with its own baseline; the caller closes it."""
        ...

    @property
    def default_period_s(self) -> float:
        """Sampling period that suits this probe (MemorySampler's default)."""
        ...

    @property
    def attribution_notes(self) -> Sequence[str]:
        """Once each, why some readings may count memory that is not the server's (a device delta, processes /proc
        cannot see) or leave some out; empty when every byte was tied to the server's processes."""
        ...

    def close(self) -> None: ...
