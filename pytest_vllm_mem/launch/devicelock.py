"""One server startup at a time per device, across processes: xdist workers and parallel CI jobs on one card.

vLLM sizes its KV cache from the free memory it sees while profiling; two servers profiling on one GPU at the same
time mis-size each other's cache or fail (vLLM issues #10643, #55827). A lock file per physical device, in a
machine-wide folder, is held from the launch until the server is healthy or its failed start has been stopped.
filelock's lock (flock on POSIX) is released by the kernel when its holder dies, so a killed pytest never leaves
the device locked. The holder writes who it is next to the lock, for the note of whoever waits.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import filelock

from pytest_vllm_mem.memory import DeviceInfo

LOCK_DIR_VAR = "PYTEST_VLLM_MEM_LOCK_DIR"  # where the lock files live; default: <tmp>/pytest-vllm-mem-locks
# auto (default): GPUs only. A CPU server checks its KV cache against the node's available memory but sizes it from
# the total, so concurrent CPU startups do not mis-size each other; serializing them would make every session on a
# shared host (stub servers included) wait for whichever vLLM is starting. on: CPUs too. off: nothing is serialized.
SWITCH_VAR = "PYTEST_VLLM_MEM_DEVICE_LOCK"
_SWITCH = {
    "auto": "auto",
    "on": "on",
    "1": "on",
    "true": "on",
    "yes": "on",
    "off": "off",
    "0": "off",
    "false": "off",
    "no": "off",
}


def locked_devices(devices: Sequence[DeviceInfo]) -> list[DeviceInfo]:
    """The devices whose startups the switch serializes."""
    value = os.environ.get(SWITCH_VAR, "auto").strip().lower()
    if value not in _SWITCH:
        raise DeviceLockError(
            f"{SWITCH_VAR}={os.environ[SWITCH_VAR]!r} is not understood: it says whose server "
            "startups take turns per device; use auto (the default: GPUs), on (GPUs and the CPU "
            "host) or off."
        )
    mode = _SWITCH[value]
    return [device for device in devices if mode == "on" or (mode == "auto" and device.backend == "cuda")]


def lock_dir() -> Path:
    # Machine-wide: every user's and every job's pytest must find the same file for one device.
    return Path(os.environ.get(LOCK_DIR_VAR) or Path(tempfile.gettempdir()) / "pytest-vllm-mem-locks")


def device_key(device: DeviceInfo) -> str:
    """The physical device: a GPU's (or MIG slice's) UUID, stable whatever CUDA_VISIBLE_DEVICES says, else its
    NVML index; on CPU the host, whose memory every CPU server on it sizes its KV cache from."""
    if device.backend == "cuda":
        if device.uuid:
            return _safe(device.uuid)
        return f"gpu-index-{device.index}" + (f"-mig-{device.mig_index}" if device.mig_index is not None else "")
    return f"cpu-{_safe(socket.gethostname())}"


def _safe(text: str) -> str:
    return "".join(char if char.isalnum() or char in "-_." else "_" for char in text)


@dataclass
class Wait:
    """What acquiring the lock took: seconds waited and who held it (their note), for the server's notes."""

    key: str
    path: Path
    waited_s: float = 0.0
    holder: str = ""
    locked: bool = False  # False when the lock folder is unusable: the startup ran unserialized
    problem: str = ""

    def note(self) -> str | None:
        if self.problem:
            return f"device startup lock not used ({self.problem}): startups on {self.key} are not serialized"
        if self.waited_s >= 1.0:
            return (
                f"waited {self.waited_s:.1f} s for another server's startup on this device "
                f"({self.holder or 'holder unknown'}; lock {self.path})"
            )
        return None


class DeviceLockError(RuntimeError):
    """The startup lock cannot be had: a bad setting, or another startup held the device too long."""


class DeviceBusyError(DeviceLockError):
    """Another startup held the device longer than a startup may take."""


@contextmanager
def startup_lock(devices: Sequence[DeviceInfo], timeout_s: float) -> Iterator[list[Wait]]:
    """Hold the startup locks of every device of a server for the body, taken in one order (no deadlock between
    two tensor-parallel servers); waits at most `timeout_s` for each (DeviceBusyError after)."""
    keys = sorted({device_key(device) for device in locked_devices(devices)})
    with ExitStack() as stack:
        yield [stack.enter_context(_lock_one(key, timeout_s)) for key in keys]


def notes(waits: Sequence[Wait]) -> list[str]:
    return [note for wait in waits if (note := wait.note()) is not None]


@contextmanager
def _lock_one(key: str, timeout_s: float) -> Iterator[Wait]:
    folder = lock_dir()
    path = folder / f"{key}.lock"
    wait = Wait(key, path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            folder.chmod(0o1777)  # shared by all users, like /tmp; fails harmlessly when another user made it
        except OSError:
            pass
        lock = filelock.FileLock(str(path), mode=0o666)
    except OSError as error:
        wait.problem = f"{folder}: {error.strerror or error}"
        yield wait
        return
    started = time.monotonic()
    try:
        lock.acquire(timeout=timeout_s, poll_interval=0.2)
    except filelock.Timeout:
        raise DeviceBusyError(
            f"Waited {timeout_s:.0f} s for the startup lock of device {key} ({path}), held by "
            f"{_holder(path) or 'an unknown process'}: a server startup there takes longer than a startup may "
            "take. Check for a stuck pytest on this machine, or raise --vllm-startup-timeout."
        ) from None
    except OSError as error:
        wait.problem = f"{path}: {error.strerror or error}"
        yield wait
        return
    try:
        wait.waited_s = time.monotonic() - started
        wait.holder = _holder(path) if wait.waited_s >= 1.0 else ""
        wait.locked = True
        _write_holder(path)
        yield wait
    finally:
        lock.release()


def _holder_path(path: Path) -> Path:
    return path.with_suffix(".holder")


def _holder(path: Path) -> str:
    try:
        return _holder_path(path).read_text().strip()
    except OSError:
        return ""


def _write_holder(path: Path) -> None:
    """Atomically, so that a waiter never reads half a line."""
    target = _holder_path(path)
    temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n")
        os.chmod(temporary, 0o666)
        os.replace(temporary, target)
    except OSError:
        try:
            temporary.unlink()
        except OSError:
            pass
