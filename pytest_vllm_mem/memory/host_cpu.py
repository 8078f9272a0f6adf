"""How busy the rest of the host was while a load ran: the CPU time of every other process, as a share of the host.

A shared CI runner's neighbours take cores from a CPU-backend server (and from the load client) in bursts: on this
project's 2-core runner, sessions run beside other test runs read 20-45% lower throughput and 40-50% more server CPU
per token than quiet ones minutes later (benchmarks/data/gate_noise_ci_2026-12-02_long.json; the vLLM CPU worker's
threads keep spinning while descheduled). The host's busy time (psutil.cpu_times: user, nice, system, irq, softirq
and steal, which a hypervisor's other guests take) minus the server's tree and this process says how much of the
machine others took. It counts every CPU the host shows: in a container without its own /proc/stat that is the
host's, so a neighbour on other cores counts too (the figure is then an upper bound).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from pytest_vllm_mem.memory.process_tree import cpu_seconds_between, tree_cpu_times

__all__ = ["HostCpuReading", "others_share", "read_host_cpu"]


@dataclass(frozen=True)
class HostCpuReading:
    """One reading: the host's busy CPU seconds since boot, this process's, the server tree's (by pid), and when."""

    host_busy_s: float
    own_s: float
    server: dict[int, float]
    at: float


def _host_busy_seconds() -> float:
    times = psutil.cpu_times()
    # guest time is already inside user (Linux), iowait and idle are not busy; steal is a neighbour VM's work.
    busy = ("user", "nice", "system", "irq", "softirq", "steal")
    return sum(float(getattr(times, name, 0.0)) for name in busy)


def read_host_cpu(server_pid: int | None) -> HostCpuReading:
    own = os.times()
    return HostCpuReading(
        _host_busy_seconds(),
        own.user + own.system,
        tree_cpu_times(server_pid) if server_pid is not None else {},
        time.monotonic(),
    )


def others_share(before: HostCpuReading, after: HostCpuReading, cpus: int | None = None) -> float | None:
    """The share of the host's CPU capacity (0-1) that processes other than the server's tree and this one used
    between two readings; None when the interval is too short to say or the server's tree lost a process."""
    wall = after.at - before.at
    count = cpus or psutil.cpu_count() or 1
    server = cpu_seconds_between(before.server, after.server) if before.server else 0.0
    if wall < 0.5 or server is None:
        return None
    others = (after.host_busy_s - before.host_busy_s) - (after.own_s - before.own_s) - server
    return min(1.0, max(0.0, others / (wall * count)))
