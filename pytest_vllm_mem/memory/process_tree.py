"""A server's process tree (API server -> EngineCore -> Workers), found from outside and cheaply."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Protocol

import psutil

__all__ = ["ProcFs", "ProcessTable", "cpu_seconds_between", "process_name", "process_tree", "tree_cpu_times"]


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


def process_name(pid: int) -> str:
    """psutil's name of `pid`, or "?" when it is gone or not ours to read."""
    try:
        return str(psutil.Process(pid).name())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def tree_cpu_times(root_pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each live process of `root_pid`'s tree has used so far, by pid; empty if the
    root is gone. Two readings around a load give the CPU time the server spent on it (`cpu_seconds_between`): on a
    shared machine a busy neighbour stretches the load's wall clock, not the work the server does per token."""
    times: dict[int, float] = {}
    for pid in process_tree(root_pid):
        try:
            cpu = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        times[pid] = cpu.user + cpu.system
    return times


def cpu_seconds_between(before: Mapping[int, float], after: Mapping[int, float]) -> float | None:
    """The CPU time the tree used between two readings: what each process used since the first (all of it for one
    started since). None when a reading is empty (the server is gone) or a process of the first reading has exited
    (its time is lost with it, so the sum would come out short)."""
    if not before or not after or not before.keys() <= after.keys():
        return None
    return sum(after[pid] - before.get(pid, 0.0) for pid in after)


class ProcessTable(Protocol):
    """What the host says about processes that are not in a server's tree: their session and parent.

    A process a server started keeps the server's session id even when it is re-parented (vLLM servers start in
    their own session; Ray's raylet and workers only change their process group). None means the pid cannot be
    seen: it lives in another PID namespace (NVML may report host pids inside a container), or it has exited.
    ProcFs reads /proc; tests pass a table of their own (tests/fake_nvml.FakeHost).
    """

    def session_of(self, pid: int) -> int | None: ...
    def parent_of(self, pid: int) -> int | None: ...
    def name_of(self, pid: int) -> str: ...
    def own_session(self) -> int | None: ...


class ProcFs:
    """ProcessTable over this host's /proc (and os.getsid)."""

    def session_of(self, pid: int) -> int | None:
        try:
            return os.getsid(pid)
        except (ProcessLookupError, PermissionError, OSError):
            return None

    def parent_of(self, pid: int) -> int | None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                text = stat.read(1024)
            return int(text[text.rindex(b")") + 2 :].split(b" ", 2)[1])
        except (OSError, ValueError, IndexError):
            try:
                return int(psutil.Process(pid).ppid())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                return None

    def name_of(self, pid: int) -> str:
        return process_name(pid)

    def own_session(self) -> int | None:
        """The session of this process (pytest and its xdist workers): never a tie to a server."""
        return self.session_of(os.getpid())
