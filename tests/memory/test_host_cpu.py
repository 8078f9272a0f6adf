"""How busy the rest of the host was during a load (memory/host_cpu.py): the arithmetic on readings, and a real
CPU burner beside this process seen as another process's share."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from pytest_vllm_mem.memory.host_cpu import HostCpuReading, others_share, read_host_cpu


def test_others_are_the_host_busy_time_less_this_process_and_the_server_tree() -> None:
    before = HostCpuReading(host_busy_s=100.0, own_s=10.0, server={7: 50.0}, at=0.0)
    # 10 s on 2 CPUs = 20 CPU seconds: the host was busy 14 of them, 3 ours, 8 the server's: 3 others, 15%.
    after = HostCpuReading(host_busy_s=114.0, own_s=13.0, server={7: 58.0}, at=10.0)
    assert others_share(before, after, cpus=2) == pytest.approx(0.15)
    # Never below 0 (rounding between the readings) nor above the whole host.
    assert others_share(before, HostCpuReading(110.0, 13.0, {7: 58.0}, 10.0), cpus=2) == 0.0
    assert others_share(before, HostCpuReading(200.0, 10.0, {7: 50.0}, 10.0), cpus=2) == 1.0


def test_no_share_over_a_moment_or_when_the_server_lost_a_process() -> None:
    before = HostCpuReading(100.0, 10.0, {7: 50.0, 8: 1.0}, 0.0)
    assert others_share(before, HostCpuReading(101.0, 10.0, {7: 50.0, 8: 1.0}, 0.2), cpus=2) is None
    assert others_share(before, HostCpuReading(120.0, 10.0, {7: 55.0}, 10.0), cpus=2) is None  # pid 8 exited


def test_a_real_cpu_burner_beside_this_process_is_another_processes_share() -> None:
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        before = read_host_cpu(None)
        time.sleep(1.5)
        share = others_share(before, read_host_cpu(None))
    finally:
        burner.kill()
        burner.wait()
    cpus = psutil.cpu_count() or 1
    # The burner keeps one CPU busy: at least most of 1/cpus of the host, whatever else runs beside it.
    assert share is not None and share >= 0.7 / cpus
