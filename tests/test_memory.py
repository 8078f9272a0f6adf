"""Tests for pytest_vllm_mem.memory: NVML probe on a fake NVML, process-tree probe and sampler on real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from pytest_vllm_mem.memory import (
    DeviceInfo,
    MemoryProbe,
    MemorySampler,
    NvmlProbe,
    ProcessTreeProbe,
    cpu_node_memory,
    detect_device,
    make_probe,
    process_tree,
    wait_for_free_memory,
)

GiB = 1 << 30
MB = 1_000_000


# ---------------------------------------------------------------------------------------------------------------------
# A fake NVML module: just the calls memory.py makes, with state the tests change between calls.


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(
        self,
        *,
        count: int = 1,
        name: str | bytes = "NVIDIA H100 80GB HBM3",
        total: int = 80 * GiB,
        used: int = 1 * GiB,
        compute: list[tuple[int, int | None]] | None = None,
        graphics: list[tuple[int, int | None]] | None = None,
        names: dict[int, str | bytes] | None = None,
        init_error: BaseException | None = None,
        graphics_error: bool = False,
    ) -> None:
        self.count, self.name, self.total, self.used = count, name, total, used
        self.compute = compute or []
        self.graphics = graphics or []
        self.names = names or {}
        self.init_error = init_error
        self.graphics_error = graphics_error
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:
        return ("handle", index)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self.name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(total=self.total, used=self.used, free=self.total - self.used)

    @staticmethod
    def _processes(entries: list[tuple[int, int | None]]) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entries]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        return self._processes(self.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        if self.graphics_error:
            raise self.NVMLError("Not Supported")
        return self._processes(self.graphics)

    def nvmlSystemGetProcessName(self, pid: int) -> str | bytes:
        if pid not in self.names:
            raise self.NVMLError("Not Found")
        return self.names[pid]


# ---------------------------------------------------------------------------------------------------------------------
# NvmlProbe


def test_nvml_probe_sums_our_pids_per_process() -> None:
    # pid 100 has a compute and a graphics context: NVML lists it twice with the same memory; count it once.
    nvml = FakeNvml(compute=[(100, 2 * GiB), (200, 3 * GiB), (999, 5 * GiB)], graphics=[(100, 2 * GiB)])
    probe = NvmlProbe(0, nvml=nvml)
    assert probe.device == DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 0)
    assert isinstance(probe, MemoryProbe)
    assert probe.used_bytes({100, 200}) == 5 * GiB
    assert probe.mode == "per_process"
    assert probe.device_used_bytes() == 1 * GiB


def test_nvml_probe_falls_back_to_device_delta_when_no_pid_is_ours() -> None:
    # In a container with its own PID namespace the driver reports host pids: none of them is ours.
    nvml = FakeNvml(used=10 * GiB, compute=[(4_000_001, 30 * GiB)])
    probe = NvmlProbe(0, nvml=nvml)
    nvml.used = 16 * GiB
    assert probe.used_bytes({100, 101}) == 6 * GiB
    assert probe.mode == "device_delta"
    nvml.used = 8 * GiB  # another process freed memory since the baseline: never negative
    assert probe.used_bytes({100}) == 0


def test_nvml_probe_falls_back_when_used_memory_is_unavailable() -> None:
    nvml = FakeNvml(used=2 * GiB, compute=[(100, None)])  # pynvml gives None for NVML_VALUE_NOT_AVAILABLE
    probe = NvmlProbe(0, nvml=nvml)
    nvml.used = 5 * GiB
    assert probe.used_bytes({100}) == 3 * GiB
    assert probe.mode == "device_delta"


def test_nvml_probe_reports_zero_after_our_processes_leave_the_gpu() -> None:
    nvml = FakeNvml(compute=[(100, 4 * GiB)])
    probe = NvmlProbe(0, nvml=nvml)
    assert probe.used_bytes({100}) == 4 * GiB
    nvml.compute = []
    nvml.used = 20 * GiB  # someone else's memory must not be counted once we know the driver sees our pids
    assert probe.used_bytes({100}) == 0
    assert probe.mode == "per_process"


def test_nvml_probe_tolerates_unsupported_graphics_query_and_closes_once() -> None:
    nvml = FakeNvml(compute=[(100, 1 * GiB)], graphics_error=True)
    probe = NvmlProbe(0, nvml=nvml)
    assert probe.used_bytes([100]) == 1 * GiB
    probe.close()
    probe.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_nvml_probe_rejects_a_missing_device_index() -> None:
    nvml = FakeNvml(count=2)
    with pytest.raises(ValueError, match="device_index 5 does not exist.*2 GPU"):
        NvmlProbe(5, nvml=nvml)
    assert nvml.shutdowns == 1


def test_other_holders_lists_other_processes_with_names() -> None:
    own = os.getpid()
    nvml = FakeNvml(
        compute=[(100, 2 * GiB), (200, None), (own, 1 * GiB)],
        names={100: b"python3", 200: "VLLM::Worker"},
    )
    probe = NvmlProbe(0, nvml=nvml)
    assert probe.other_holders(exclude_pids={100}) == [
        (200, 0, "VLLM::Worker"),
        (own, 1 * GiB, psutil.Process(own).name()),  # NVML has no name for it: psutil's
    ]


# ---------------------------------------------------------------------------------------------------------------------
# detect_device / make_probe


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", b"NVIDIA H100 80GB HBM3"])
def test_detect_device_finds_a_gpu(name: str | bytes) -> None:
    nvml = FakeNvml(count=2, name=name, total=80 * GiB)
    device = detect_device(1, nvml=nvml)
    assert device == DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 80 * GiB, 1)
    assert nvml.shutdowns == nvml.inits == 1


@pytest.mark.parametrize(
    "nvml",
    [
        FakeNvml(init_error=FakeNvml.NVMLError("Driver Not Loaded")),
        FakeNvml(init_error=OSError("libnvidia-ml.so.1: cannot open shared object file")),
        FakeNvml(count=0),
    ],
    ids=["driver-not-loaded", "no-library", "no-gpu"],
)
def test_detect_device_falls_back_to_cpu(nvml: FakeNvml) -> None:
    device = detect_device(nvml=nvml)
    assert device.backend == "cpu"
    assert device.index is None
    assert device.name
    assert device.total_bytes == cpu_node_memory()[0]


def test_detect_device_rejects_a_missing_gpu_index() -> None:
    with pytest.raises(ValueError, match="device_index 3 does not exist"):
        detect_device(3, nvml=FakeNvml(count=1))


def test_make_probe_picks_the_backend() -> None:
    gpu = make_probe(DeviceInfo("cuda", "fake", 80 * GiB, 0), nvml=FakeNvml())
    assert isinstance(gpu, NvmlProbe)
    cpu_device = DeviceInfo("cpu", "fake cpu", 8 * GiB, None)
    cpu = make_probe(cpu_device)
    assert isinstance(cpu, ProcessTreeProbe) and cpu.device is cpu_device
    assert cpu.other_holders(exclude_pids=()) == []
    assert 0 < cpu.device_used_bytes() <= cpu_node_memory()[0]
    with pytest.raises(ValueError, match="backend 'rocm' has no memory probe"):
        make_probe(DeviceInfo("rocm", "fake", 1, 0))


# ---------------------------------------------------------------------------------------------------------------------
# wait_for_free_memory


class DrainingNvml(FakeNvml):
    """An earlier server still exiting: its process leaves the GPU after `polls` process-list queries."""

    def __init__(self, polls: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.polls = polls

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        self.polls -= 1
        if self.polls < 0:
            self.compute = []
        return super().nvmlDeviceGetComputeRunningProcesses(handle)


def test_wait_for_free_memory_waits_until_holders_leave() -> None:
    probe = NvmlProbe(0, nvml=DrainingNvml(polls=3, used=70 * GiB, compute=[(4242, 69 * GiB)]))
    started = time.monotonic()
    assert wait_for_free_memory(probe, exclude_pids=(), timeout_s=5, poll_s=0.01) == []
    assert time.monotonic() - started < 2


def test_wait_for_free_memory_returns_remaining_holders_at_timeout() -> None:
    probe = NvmlProbe(0, nvml=FakeNvml(used=70 * GiB, compute=[(4242, 69 * GiB)], names={4242: "python"}))
    assert wait_for_free_memory(probe, (), needed_fraction=0.9, timeout_s=0.05, poll_s=0.01) == [
        (4242, 69 * GiB, "python")
    ]


def test_wait_for_free_memory_is_clear_when_enough_is_free() -> None:
    probe = NvmlProbe(0, nvml=FakeNvml(total=80 * GiB, used=5 * GiB, compute=[(4242, 4 * GiB)]))
    assert wait_for_free_memory(probe, (), needed_fraction=0.9, timeout_s=5) == []
    assert wait_for_free_memory(probe, (), needed_bytes=70 * GiB, timeout_s=5) == []


def test_wait_for_free_memory_on_cpu_returns_at_once_and_checks_input() -> None:
    probe = ProcessTreeProbe(DeviceInfo("cpu", "fake cpu", 8 * GiB, None))
    assert wait_for_free_memory(probe, (), needed_fraction=0.9, timeout_s=100) == []
    with pytest.raises(ValueError, match="not both"):
        wait_for_free_memory(probe, (), needed_bytes=1, needed_fraction=0.5, timeout_s=1)
    with pytest.raises(ValueError, match="needed_fraction 1.5"):
        wait_for_free_memory(probe, (), needed_fraction=1.5, timeout_s=1)


# ---------------------------------------------------------------------------------------------------------------------
# Real process trees (CPU backend)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    """Start `python script` in its own session; every group started is killed at teardown."""
    started: list[subprocess.Popen[str]] = []

    def start(name: str, code: str) -> subprocess.Popen[str]:
        script = tmp_path / name
        script.write_text(textwrap.dedent(code))
        process = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


def expect_line(process: subprocess.Popen[str], expected: str) -> None:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line == expected, f"child said {line!r}, expected {expected!r}"


def send(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()


# A child that starts a grandchild (sharing its stdin/stdout) and waits for it. The grandchild allocates on "alloc".
PARENT = """
    import subprocess, sys
    subprocess.run([sys.executable, sys.argv[1] + "/grandchild.py"])
"""
GRANDCHILD = """
    import sys
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "alloc"
    held = b"\\x01" * 200_000_000  # filled, so the pages are resident
    print("allocated", flush=True)
    sys.stdin.readline()  # hold until the test closes stdin
"""


def test_process_tree_probe_sees_a_grandchild_allocate(spawn: Any, tmp_path: Path) -> None:
    (tmp_path / "grandchild.py").write_text(textwrap.dedent(GRANDCHILD))
    parent = spawn("parent.py", PARENT)
    expect_line(parent, "ready")
    tree = process_tree(parent.pid)
    assert len(tree) == 2 and parent.pid in tree
    assert tree == {parent.pid, *(child.pid for child in psutil.Process(parent.pid).children(recursive=True))}
    probe = ProcessTreeProbe()
    before = probe.used_bytes(tree)
    send(parent, "alloc")
    expect_line(parent, "allocated")
    after = probe.used_bytes(process_tree(parent.pid))
    assert after - before >= 150 * MB, f"tree RSS rose by {(after - before) / MB:.0f} MB only"
    assert process_tree(2**22 + 12345) == set()  # beyond pid_max: no such process


SPIKE = """
    import sys, time
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    spike = b"\\x01" * 300_000_000
    time.sleep(0.1)
    del spike  # a large block is unmapped at once: RSS drops immediately
    time.sleep(0.3)
    print("done", flush=True)
    sys.stdin.readline()
"""


def test_sampler_catches_a_100ms_spike_at_the_default_period(spawn: Any) -> None:
    child = spawn("spike.py", SPIKE)
    expect_line(child, "ready")
    with MemorySampler(ProcessTreeProbe(), child.pid) as sampler:
        baseline = sampler.sample_now()
        t_go = sampler.mark("spike")
        send(child, "go")
        expect_line(child, "done")
        sampler.sample_now()  # may still hold the spike, if no sample was taken since it was freed
        after = sampler.sample_now()
    assert sampler.error is None
    assert sampler.markers == [("spike", t_go)]
    peak = sampler.peak_between(t_go)
    assert peak - baseline >= 250 * MB, f"peak {peak / MB:.0f} MB over baseline {baseline / MB:.0f} MB"
    assert peak == sampler.peak_bytes
    assert after < peak - 250 * MB  # the spike was freed, and the sampler saw that too


GROWER = """
    import subprocess, sys
    print("ready", flush=True)
    assert sys.stdin.readline().strip() == "go"
    code = "import sys; held = b'\\\\x01' * 200_000_000; print('grown', flush=True); sys.stdin.readline()"
    subprocess.run([sys.executable, "-c", code])
"""


def test_sampler_picks_up_processes_started_after_it(spawn: Any) -> None:
    child = spawn("grower.py", GROWER)
    expect_line(child, "ready")
    with MemorySampler(ProcessTreeProbe(), child.pid, period_s=0.02) as sampler:
        baseline = sampler.sample_now()
        send(child, "go")
        expect_line(child, "grown")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sampler.samples[-1][1] - baseline < 150 * MB:
            time.sleep(0.05)
    assert sampler.samples[-1][1] - baseline >= 150 * MB


SHORT_SPIKE = """
    import sys, time
    print("ready", flush=True)
    for line in sys.stdin:
        spike = b"\\x01" * 300_000_000
        time.sleep(0.02)
        del spike
        print("done", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's RSS high-water mark is Linux's")
def test_a_20ms_spike_between_samples_one_second_apart_is_caught(spawn: Any) -> None:
    child = spawn("short_spike.py", SHORT_SPIKE)
    expect_line(child, "ready")
    probe = ProcessTreeProbe()
    assert probe.tracks_peaks and probe.default_period_s == 0.25
    with MemorySampler(probe, child.pid, period_s=1.0) as sampler:
        before = sampler.sample_now()
        send(child, "go")
        expect_line(child, "done")  # allocated, held 20 ms and freed, with no sample in between
        spike = sampler.sample_now()
        after = sampler.sample_now()
    assert spike - before >= 250 * MB, f"{spike / MB:.0f} MB vs {before / MB:.0f} MB before"
    assert after < spike - 250 * MB  # the next sample starts from the RSS of now


def test_without_a_writable_clear_refs_the_probe_reads_the_current_rss(spawn: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    child = spawn("short_spike.py", SHORT_SPIKE)
    expect_line(child, "ready")
    real_open = os.open

    def no_clear_refs(path: str, *args: Any) -> int:
        if str(path).endswith("clear_refs"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", no_clear_refs)
    probe = ProcessTreeProbe()
    before = probe.used_bytes([child.pid])
    send(child, "go")
    expect_line(child, "done")
    assert probe.used_bytes([child.pid]) < before + 100 * MB  # the freed spike is not seen: current RSS only
    assert before > 0
    probe.close()


def test_nvml_probe_samples_often_by_default() -> None:
    assert NvmlProbe.default_period_s == 0.05 and NvmlProbe.tracks_peaks is False


def test_sampler_cost_is_small(spawn: Any) -> None:
    # Loose sanity bound only; the measured figure is benchmarks/sampler_cost.py's, not asserted here.
    with MemorySampler(ProcessTreeProbe(), os.getpid(), period_s=0.05) as sampler:
        time.sleep(1.0)
    assert len(sampler.samples) >= 5
    assert sampler.cpu_time_s < 0.5


# ---------------------------------------------------------------------------------------------------------------------
# Sampler bookkeeping with a scripted probe


class ScriptedProbe:
    """Returns the next value of `values` (the last one forever); raises once when told to."""

    device = DeviceInfo("cpu", "scripted", 1 * GiB, None)

    def __init__(self, values: list[int], fail_at: int | None = None) -> None:
        self.values, self.calls, self.fail_at = values, 0, fail_at

    def used_bytes(self, pids: Any) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("transient read failure")
        return self.values[min(self.calls - 1, len(self.values) - 1)]

    def other_holders(self, exclude_pids: Any) -> list[tuple[int, int, str]]:
        return []

    def device_used_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_peak_between_uses_only_samples_in_the_window() -> None:
    sampler = MemorySampler(ScriptedProbe([10, 50, 20, 40]), os.getpid())
    assert sampler.peak_bytes == 0 and sampler.peak_between(0.0) == 0
    sampler.sample_now()
    t1 = sampler.mark("a")
    sampler.sample_now()
    sampler.sample_now()
    t2 = sampler.mark("b")
    sampler.sample_now()
    assert [value for _, value in sampler.samples] == [10, 50, 20, 40]
    assert sampler.peak_between(t1, t2) == 50
    assert sampler.peak_between(t2) == 40
    assert sampler.peak_between(t2 + 3600) == 0
    assert sampler.peak_bytes == 50
    assert [label for label, _ in sampler.markers] == ["a", "b"]


def test_sampler_survives_a_probe_error_and_stops_idempotently() -> None:
    probe = ScriptedProbe([7], fail_at=2)
    sampler = MemorySampler(probe, os.getpid(), period_s=0.005).start()
    assert sampler.start() is sampler  # already running: no second thread
    deadline = time.monotonic() + 5
    while len(sampler.samples) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    sampler.stop()
    count = len(sampler.samples)
    time.sleep(0.05)
    assert len(sampler.samples) == count >= 5
    assert isinstance(sampler.error, RuntimeError)
    with pytest.raises(RuntimeError, match="runs once"):
        sampler.start()


def test_sampler_rejects_a_non_positive_period() -> None:
    with pytest.raises(ValueError, match="period_s 0"):
        MemorySampler(ScriptedProbe([0]), os.getpid(), period_s=0)


def test_process_tree_probe_rejects_an_unknown_metric() -> None:
    with pytest.raises(ValueError, match="metric 'vms'"):
        ProcessTreeProbe(DeviceInfo("cpu", "x", 1, None), metric="vms")  # type: ignore[arg-type]
