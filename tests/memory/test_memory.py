"""Tests for pytest_vllm_mem.memory: NVML probe and device resolution on a fake NVML that behaves like pynvml
(tests/fake_nvml.py), process-tree probe and sampler on real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from fake_nvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_NOT_FOUND,
    FakeGpu,
    FakeMig,
    FakeNvml,
    NVMLError,
    gpu_uuid,
    gpus,
    mig_uuid,
)

from pytest_vllm_mem.memory import (
    DeviceError,
    DeviceInfo,
    MemoryProbe,
    MemorySampler,
    NvmlError,
    NvmlProbe,
    ProbeReadError,
    ProcessTreeProbe,
    cpu_node_memory,
    detect_device,
    detect_devices,
    device_count,
    gpus_used,
    make_probe,
    process_tree,
    server_devices,
    wait_for_free_memory,
)
from pytest_vllm_mem.memory.backend import UNLISTED_PID
from pytest_vllm_mem.units import GIB

MB = 1_000_000
H100 = "NVIDIA H100 80GB HBM3"


def one_gpu(**kwargs: Any) -> FakeNvml:
    names = kwargs.pop("names", None)
    return FakeNvml([FakeGpu(gpu_uuid(0), **kwargs)], names=names)


# ---------------------------------------------------------------------------------------------------------------------
# The fake itself: it must fail like pynvml does, or the tests below prove nothing.


def test_fake_nvml_maps_codes_to_subclasses_like_pynvml() -> None:
    import pynvml

    for code in (NVML_ERROR_NOT_FOUND, NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_GPU_IS_LOST):
        real, fake = pynvml.NVMLError(code), NVMLError(code)
        assert type(real).__name__ == type(fake).__name__ and real.value == fake.value == code
        assert str(real) == str(fake)
    assert type(pynvml.NVMLError_NotFound()).__name__ == type(FakeNvml().NVMLError_NotFound()).__name__
    nvml = FakeNvml()
    with pytest.raises(NVMLError) as uninitialized:
        nvml.nvmlDeviceGetCount()
    assert uninitialized.value.value == pynvml.NVML_ERROR_UNINITIALIZED


# ---------------------------------------------------------------------------------------------------------------------
# NvmlProbe on one GPU


def test_nvml_probe_sums_our_pids_per_process() -> None:
    # pid 100 has a compute and a graphics context: NVML lists it twice with the same memory; count it once.
    nvml = one_gpu(
        compute=[(100, 2 * GIB), (200, 3 * GIB), (999, 5 * GIB)], graphics=[(100, 2 * GIB)], graphics_supported=True
    )
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.device == DeviceInfo("cuda", H100, 80 * GIB, 0, gpu_uuid(0))
    assert isinstance(probe, MemoryProbe)
    assert probe.used_bytes({100, 200}) == 5 * GIB
    assert probe.read({100, 200}) == (5 * GIB,)
    assert probe.mode == "per_process"
    assert probe.device_used_bytes() == 1 * GIB
    assert probe.free_bytes() == (79 * GIB,)


def test_nvml_probe_falls_back_to_device_delta_when_no_pid_is_ours() -> None:
    # In a container with its own PID namespace the driver reports host pids: none of them is ours.
    nvml = one_gpu(used=10 * GIB, compute=[(4_000_001, 30 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].used = 16 * GIB
    assert probe.used_bytes({100, 101}) == 6 * GIB
    assert probe.mode == "device_delta"
    nvml.gpus[0].used = 8 * GIB  # another process freed memory since the baseline: never negative
    assert probe.used_bytes({100}) == 0


def test_nvml_probe_falls_back_when_used_memory_is_unavailable() -> None:
    nvml = one_gpu(used=2 * GIB, compute=[(100, None)])  # pynvml gives None for NVML_VALUE_NOT_AVAILABLE
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].used = 5 * GIB
    assert probe.used_bytes({100}) == 3 * GIB
    assert probe.mode == "device_delta"


def test_nvml_probe_reports_zero_after_our_processes_leave_the_gpu() -> None:
    nvml = one_gpu(compute=[(100, 4 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.used_bytes({100}) == 4 * GIB
    nvml.gpus[0].compute = []
    nvml.gpus[0].used = 20 * GIB  # someone else's memory must not be counted once we know the driver sees our pids
    assert probe.used_bytes({100}) == 0
    assert probe.mode == "per_process"


def test_a_ray_worker_in_the_servers_session_is_counted() -> None:
    # vLLM's Ray executor: the GPU worker is a child of Ray's raylet, re-parented out of the server's tree; Ray
    # changes only its process group (ray/_private/services.py: os.setpgrp), so it keeps the server's session.
    # A process that was on the GPU before the probe was created (another tenant) is never ours.
    nvml = one_gpu(compute=[(7, 3 * GIB)])
    nvml.host.server(100, 101)
    nvml.host.add(5000, session=100, parent=1, name="ray::RayWorkerWrapper")
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(7, 3 * GIB), (100, 1 * GIB), (5000, 20 * GIB)]
    assert probe.read({100, 101}) == (21 * GIB,)
    assert probe.mode == "per_process" and probe.attribution_notes == []


def test_a_new_process_of_another_job_or_worker_on_the_gpu_is_not_counted() -> None:
    # Issue 23 item 1: a 20 GiB server next to a new 110 GiB foreign process read 130 GiB. The foreign ones: another
    # CI job's server (its own session) and a sibling xdist worker's process (this pytest's session, which never
    # ties a process to a server).
    nvml = one_gpu()
    host = nvml.host
    host.server(100, 101)
    host.server(7000)
    host.add(8000, session=host.own, parent=host.own)
    probe = NvmlProbe(0, nvml=nvml, processes=host)
    nvml.gpus[0].compute = [(101, 20 * GIB), (7000, 100 * GIB), (8000, 10 * GIB)]
    assert probe.read({100, 101}) == (20 * GIB,)
    assert probe.attribution_notes == []


def test_a_child_born_since_the_tree_was_read_is_counted_through_its_parent() -> None:
    nvml = one_gpu()
    nvml.host.server(100)
    nvml.host.add(300, session=300, parent=100)  # it called setsid(), but its parent is the server
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(100, 1 * GIB), (300, 4 * GIB)]
    assert probe.read({100}) == (5 * GIB,)


def test_an_unseen_pid_is_not_counted_while_the_tree_is_listed() -> None:
    # /proc cannot see 4_000_002: another container's process (another PID namespace) next to ours.
    nvml = one_gpu()
    nvml.host.server(100)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(100, 2 * GIB), (4_000_002, 30 * GIB)]
    assert probe.read({100}) == (2 * GIB,)
    assert probe.attribution_notes == []


def test_unseen_pids_are_counted_with_a_note_when_nvml_lists_host_pids() -> None:
    # Inside a container NVML may report host pids: none of the tree's pids is listed, every new one is unseen.
    nvml = one_gpu()
    nvml.host.server(100, 101)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(4_000_001, 6 * GIB), (4_000_002, 1 * GIB)]
    assert probe.read({100, 101}) == (7 * GIB,)
    assert probe.mode == "per_process"
    assert len(probe.attribution_notes) == 1 and "another PID namespace" in probe.attribution_notes[0]


def test_a_ray_worker_of_a_cluster_the_server_did_not_start_is_left_out_with_a_note() -> None:
    nvml = one_gpu()
    nvml.host.server(100)
    nvml.host.add(6000, session=50, parent=49, name="ray::RayWorkerWrapper")  # under an external `ray start`
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(100, 1 * GIB), (6000, 9 * GIB)]
    assert probe.read({100}) == (1 * GIB,)
    assert len(probe.attribution_notes) == 1 and "Ray worker pid 6000" in probe.attribution_notes[0]


def test_a_zero_usedgpumemory_with_the_device_filling_falls_back_to_the_device_delta() -> None:
    # Issue 23 item 3: some container drivers list processes with 0 bytes (open-gpu-kernel-modules PR #614,
    # HAMi-core #112 shows `mem: 0` on 560.35.03): the sum of ours was a silent 0.
    nvml = one_gpu(used=1 * GIB)
    nvml.host.server(100)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(100, 0)]
    assert probe.read({100}) == (0,)  # listed with 0 before it allocated anything: a real 0
    nvml.gpus[0].used = 13 * GIB
    assert probe.read({100}) == (12 * GIB,)
    assert probe.mode == "device_delta" and "0 bytes" in (probe.mode_reason or "")
    assert any("0 bytes" in note for note in probe.attribution_notes)
    nvml.gpus[0].compute = []  # the driver's figures are not trusted again for this server
    assert probe.read({100}) == (12 * GIB,)


def test_mps_clients_are_listed_and_counted() -> None:
    # Under MPS the compute list shows nvidia-cuda-mps-server; the clients are in the MPS list.
    nvml = one_gpu(compute=[(40, 300 * MB)])
    nvml.host.server(100)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].mps = [(100, 7 * GIB)]
    assert probe.read({100}) == (7 * GIB,)
    assert [pid for pid, _, _ in probe.other_holders({100})] == [40]
    nvml.gpus[0].mps_supported = False  # a board or driver without MPS: an empty list, not an error
    nvml.gpus[0].compute = [(40, 300 * MB), (100, 7 * GIB)]
    assert NvmlProbe(0, nvml=nvml, processes=nvml.host).read({100}) == (7 * GIB,)


def test_nvml_v2_memory_leaves_out_the_drivers_reserved_memory() -> None:
    # An H200: NVML v1 says 143771 MiB total; CUDA (and vLLM) size from 698 MiB less (issue 23 item 7).
    reserved = 698 * 2**20
    nvml = one_gpu(name="NVIDIA H200", total=143771 * 2**20, reserved=reserved, used=0)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.device.total_bytes == 143771 * 2**20 - reserved
    assert probe.device.card_bytes == 143771 * 2**20  # the label's size: what tiers are compared with
    assert probe.memory_version == "v2"
    assert probe.free_bytes() == (143771 * 2**20 - reserved,)
    assert probe.device_used_bytes() == 0  # v1 would say 698 MiB used
    old = one_gpu(total=80 * GIB, reserved=reserved, used=0, memory_v2=False)  # a driver before 510: v1 figures
    old_probe = NvmlProbe(0, nvml=old, processes=old.host)
    assert old_probe.device.total_bytes == 80 * GIB and old_probe.memory_version == "v1"
    assert old_probe.free_bytes() == (80 * GIB - reserved,)


def test_a_unified_memory_gpu_without_a_memory_query_reads_the_hosts_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # DGX Spark's GB10: nvmlDeviceGetMemoryInfo and its v2 return NOT_SUPPORTED (nvitop#208's raw ctypes calls);
    # the probe stopped with "NVML could not read the memory of GPU 0". Its memory is the host's (psutil's MemTotal
    # and MemAvailable).
    host = {"total": 127600748 * 1024, "available": 118566368 * 1024}

    def virtual_memory() -> SimpleNamespace:
        if not host:
            raise OSError("/proc/meminfo: permission denied")
        return SimpleNamespace(**host)

    monkeypatch.setattr(psutil, "virtual_memory", virtual_memory)
    nvml = one_gpu(name="NVIDIA GB10", memory_query=False, used=0)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.memory_version == "unified"
    assert probe.device.total_bytes == 127600748 * 1024 and probe.device.reserved_bytes == 0
    assert probe.free_bytes() == (118566368 * 1024,)
    nvml.host.server(100)
    nvml.gpus[0].compute = [(100, 37 * GIB)]  # usedGpuMemory still works there
    assert probe.read({100}) == (37 * GIB,) and probe.mode == "per_process"
    fresh = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(100, None)]  # no per-process figure: the host's delta, and the note says whose it is
    host["available"] = 108566368 * 1024
    assert fresh.read({100}) == (10_000_000 * 1024,) and fresh.mode == "device_delta"
    assert "every host process counts" in fresh.attribution_notes[0]
    host.clear()  # the host's memory unreadable too: a clear error, not a 0
    with pytest.raises(NvmlError, match="could not stand in"):
        NvmlProbe(0, nvml=nvml, processes=nvml.host)


def test_a_new_process_of_another_servers_tree_is_not_counted() -> None:
    nvml = one_gpu()
    ours, theirs = NvmlProbe(0, nvml=nvml, processes=nvml.host), NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].compute = [(100, 2 * GIB), (200, 5 * GIB)]
    assert theirs.read({200}) == (5 * GIB,)  # the other server's sampler claims its tree
    assert ours.read({100}) == (2 * GIB,)
    theirs.close()
    ours.close()


def test_nvml_probe_tolerates_unsupported_graphics_query_and_closes_once() -> None:
    nvml = one_gpu(compute=[(100, 1 * GIB)], graphics_supported=False)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.used_bytes([100]) == 1 * GIB
    probe.close()
    probe.close()
    assert (nvml.inits, nvml.shutdowns, nvml.refcount) == (1, 1, 0)


def test_nvml_probe_rejects_a_missing_device_index() -> None:
    nvml = FakeNvml(gpus(2))
    with pytest.raises(DeviceError, match="GPU index 5 does not exist.*2 GPU"):
        NvmlProbe(5, nvml=nvml)
    assert nvml.refcount == 0


def test_other_holders_lists_other_processes_with_names() -> None:
    own = os.getpid()
    nvml = one_gpu(compute=[(100, 2 * GIB), (200, None), (own, 1 * GIB)], names={100: b"python3", 200: "VLLM::Worker"})
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.other_holders(exclude_pids={100}) == [
        (200, 0, "VLLM::Worker"),
        (own, 1 * GIB, psutil.Process(own).name()),  # NVML has no name for it: psutil's
    ]


# ---------------------------------------------------------------------------------------------------------------------
# NVML failures: missing samples and clear messages, never a 0 or a traceback


def test_a_process_list_that_changes_under_the_query_is_retried() -> None:
    nvml = one_gpu(compute=[(100, 4 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    gpu = nvml.gpus[0]
    gpu.fail_next = [NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_NOT_FOUND]  # two races, then a clean read
    assert probe.read({100}) == (4 * GIB,)
    assert gpu.fail_next == []


def test_a_process_list_growing_past_pynvmls_array_is_retried() -> None:
    nvml = one_gpu(compute=[(100, 4 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    gpu = nvml.gpus[0]
    grown = [(1000 + n, 1) for n in range(10)]

    def burst(target: FakeGpu) -> None:  # ten processes start between count (1) and fill (room for 7)
        target.compute = [(100, 4 * GIB), *grown]
        target.between_calls = None

    gpu.between_calls = burst
    nvml.host.server(100, *(pid for pid, _ in grown))
    assert probe.read({100}) == (4 * GIB + 10,)  # the new processes are the server's children: counted


def test_a_race_that_does_not_clear_is_a_missing_sample_not_zero() -> None:
    own = os.getpid()
    nvml = one_gpu(compute=[(own, 4 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.read({own}) == (4 * GIB,)  # seen once: an empty list would now read as 0
    nvml.gpus[0].fail_next = [NVML_ERROR_INSUFFICIENT_SIZE] * 3
    with pytest.raises(ProbeReadError, match="could not list the compute processes of GPU 0: Insufficient Size"):
        probe.read({own})
    sampler = MemorySampler(probe, os.getpid())
    nvml.gpus[0].fail_next = [NVML_ERROR_INSUFFICIENT_SIZE] * 3
    assert sampler.sample_now() is None
    assert sampler.sample_now() == 4 * GIB
    assert [value for _, value in sampler.samples] == [4 * GIB]  # the failed read left no 0 behind
    assert sampler.missed_samples == 1 and sampler.error is None
    note = sampler.missed_note()
    assert note is not None and note.startswith("1 of 2 memory samples could not be read") and "NVML error 7" in note


def test_a_lost_gpu_is_a_clear_message() -> None:
    nvml = one_gpu(compute=[(100, 4 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    nvml.gpus[0].lost = True
    with pytest.raises(ProbeReadError) as error:
        probe.read({100})
    message = str(error.value)
    assert "GPU 0" in message and "GPU is lost (NVML error 15)" in message and "nvidia-smi" in message
    with pytest.raises(NvmlError, match="could not read the memory of GPU 0: GPU is lost"):
        probe.free_bytes()
    with pytest.raises(NvmlError, match="GPU is lost"):
        detect_devices("0", nvml=nvml)
    assert nvml.refcount == 1  # only the probe's session is open
    probe.close()


def test_the_unversioned_query_falls_back_to_v2_on_an_older_driver() -> None:
    # nvidia-ml-py's unversioned getter calls _v3 and raises NVMLLibraryMismatchError (not an NVMLError) when the
    # driver lacks it.
    nvml = FakeNvml([FakeGpu(gpu_uuid(0), compute=[(100, 3 * GIB)])], has_v3=False)
    with pytest.raises(nvml.NVMLLibraryMismatchError):
        nvml.nvmlInit()
        try:
            nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            nvml.nvmlShutdown()
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert probe.read({100}) == (3 * GIB,)
    assert probe.read({100}) == (3 * GIB,)


def test_an_older_driver_and_two_races_in_one_query_still_read() -> None:
    # The switch to _v2 must not use up the retries the races get.
    nvml = FakeNvml([FakeGpu(gpu_uuid(0), compute=[(100, 3 * GIB)])], has_v3=False)
    nvml.gpus[0].fail_next = [NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_NOT_FOUND]  # after the mismatch: two races
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert nvml.gpus[0].fail_next == []
    assert probe.read({100}) == (3 * GIB,)


def test_a_query_failing_with_another_exception_is_a_clear_message() -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
            raise OSError("libnvidia-ml.so.1: undefined symbol nvmlDeviceGetComputeRunningProcesses_v2")

    probe_nvml = Broken([FakeGpu(gpu_uuid(0))], has_v3=False)
    with pytest.raises(NvmlError, match="could not list the compute processes of GPU 0: libnvidia-ml"):
        NvmlProbe(0, nvml=probe_nvml)
    assert probe_nvml.refcount == 0


# ---------------------------------------------------------------------------------------------------------------------
# Several GPUs, UUIDs and MIG slices, resolved as vLLM resolves CUDA_VISIBLE_DEVICES


def mig_host() -> FakeNvml:
    """GPU 0: a plain H100; GPU 1: an A100 80GB in MIG mode with slices in slots 0 and 2 (slot 1 empty)."""
    migs = {
        0: FakeMig(mig_uuid(10), total=40 * GIB, gpu_instance=1, compute_instance=0, compute=[(300, 6 * GIB)]),
        2: FakeMig(
            mig_uuid(12), name="NVIDIA A100-SXM4-80GB MIG 1g.10gb", total=10 * GIB, gpu_instance=9, compute_instance=0
        ),
    }
    return FakeNvml(
        [
            FakeGpu(gpu_uuid(0)),
            FakeGpu(gpu_uuid(1), name="NVIDIA A100-SXM4-80GB", mig_capable=True, mig_enabled=True, migs=migs),
        ]
    )


@pytest.mark.parametrize(
    "visible, expected",
    [
        (None, [(0, None), (1, 0), (1, 2)]),  # unset: every GPU, a MIG-mode GPU's slices in its place
        ("1,0", [(1, None), (0, None)]),  # CUDA's order is CUDA_VISIBLE_DEVICES's
        (gpu_uuid(1), [(1, None)]),
        ("GPU-00000001", [(1, None)]),  # a unique prefix, as CUDA accepts
        (f" {mig_uuid(12)} ", [(1, 2)]),
        ("MIG-0000000a", [(1, 0)]),
        (f"MIG-{gpu_uuid(1)}/9/0", [(1, 2)]),  # the pre-R470 MIG naming
        ("", []),  # no GPU: the CPU backend
    ],
)
def test_devices_are_resolved_like_cuda_visible_devices(
    visible: str | None, expected: list[tuple[int, int | None]]
) -> None:
    nvml = mig_host()
    with_cpu = detect_devices(visible, nvml=nvml)
    if not expected:
        assert [device.backend for device in with_cpu] == ["cpu"]
    else:
        assert [(device.index, device.mig_index) for device in with_cpu] == expected
    assert nvml.refcount == 0


def test_a_mig_slice_has_the_slices_memory_and_its_own_processes() -> None:
    nvml = mig_host()
    (device,) = detect_devices("MIG-0000000a", nvml=nvml)
    assert device == DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GIB, 1, mig_uuid(10), 0)
    assert device.label == "GPU 1 MIG 0"
    probe = make_probe(device, nvml=nvml)
    nvml.gpus[1].migs[0].compute.append((400, 2 * GIB))  # our server's worker, new on the slice
    nvml.gpus[0].compute.append((500, 9 * GIB))  # a process on another GPU: not on our slice
    assert probe.read({400}) == (2 * GIB,)
    assert probe.free_bytes() == (40 * GIB,)
    probe.close()


@pytest.mark.parametrize(
    "visible, message",
    [
        ("3", "names GPU 3, but NVML sees 2 GPU"),
        ("GPU-ffff", "'GPU-ffff' matches no GPU UUID"),
        ("GPU-0000000", "matches 2 GPU UUID"),  # a prefix of both GPUs' UUIDs
        ("MIG-0000000", "matches 2 MIG slice UUID"),
        ("0,0", "names '0' twice"),
        ("cuda:0", "'cuda:0', which is not a GPU"),
        (f"MIG-{gpu_uuid(1)}/5/0", "no MIG slice with GPU instance 5"),
    ],
)
def test_a_device_that_does_not_exist_is_a_usage_message(visible: str, message: str) -> None:
    nvml = mig_host()
    with pytest.raises(DeviceError, match=message.replace("(", r"\(")):
        detect_devices(visible, nvml=nvml)
    assert nvml.refcount == 0


def test_tensor_parallel_server_is_measured_on_every_gpu() -> None:
    nvml = FakeNvml(gpus(4))
    visible = detect_devices("2,3,0", nvml=nvml)
    flags = {"tensor_parallel_size": 2}
    devices = server_devices(visible, flags)
    assert [device.index for device in devices] == [2, 3]
    nvml.host.server(os.getpid(), 1001, 1002, 1003)
    probe = make_probe(devices, nvml=nvml, processes=nvml.host)
    nvml.gpus[2].compute = [(1001, 30 * GIB)]
    nvml.gpus[3].compute = [(1002, 31 * GIB)]
    nvml.gpus[0].compute = [(1003, 70 * GIB)]  # visible but not used by a TP=2 server: never measured
    sampler = MemorySampler(probe, os.getpid(), close_probe=True)
    t0 = sampler.mark("start")
    assert sampler.sample_now() == 61 * GIB
    nvml.gpus[2].compute = [(1001, 32 * GIB)]
    nvml.gpus[3].compute = [(1002, 29 * GIB)]
    assert sampler.sample_now() == 61 * GIB
    assert sampler.devices == devices
    assert sampler.device_peaks_between(t0) == (32 * GIB, 31 * GIB)  # each GPU's own peak, not the total's moment
    assert sampler.peak_between(t0) == 61 * GIB and sampler.device_peaks == (32 * GIB, 31 * GIB)
    sampler.stop()
    assert nvml.refcount == 0  # close_probe: stop() closed it


@pytest.mark.parametrize(
    "flags, count",
    [
        ({}, 1),
        ({"tensor_parallel_size": 2}, 2),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
        ({"data_parallel_size": 2}, 2),
        ({"data_parallel_size": 4, "data_parallel_size_local": 2, "tensor_parallel_size": 2}, 4),
        ({"tensor_parallel_size": "2"}, 2),
    ],
)
def test_gpus_used_follows_vllms_world_size(flags: dict[str, object], count: int) -> None:
    assert gpus_used(flags) == count


def test_server_devices_on_cpu_is_the_cpu() -> None:
    cpu = DeviceInfo("cpu", "fake cpu", 8 * GIB, None)
    assert server_devices((cpu,), {"tensor_parallel_size": 2}) == (cpu,)


# ---------------------------------------------------------------------------------------------------------------------
# detect_device / make_probe / device_count


@pytest.mark.parametrize("name", [H100, H100.encode()], ids=["str", "bytes"])  # old pynvml returns bytes
def test_detect_device_finds_a_gpu(name: str | bytes) -> None:
    nvml = FakeNvml(gpus(2, name=name, total=80 * GIB))
    device = detect_device(1, nvml=nvml)
    assert device == DeviceInfo("cuda", H100, 80 * GIB, 1, gpu_uuid(1))
    assert nvml.shutdowns == nvml.inits == 1


@pytest.mark.parametrize(
    "nvml",
    [
        FakeNvml(init_error=9),  # NVML_ERROR_DRIVER_NOT_LOADED
        FakeNvml(init_error=12),  # NVML_ERROR_LIBRARY_NOT_FOUND: how pynvml reports a missing libnvidia-ml.so.1
        FakeNvml(init_error=OSError("libnvidia-ml.so.1: cannot open shared object file")),
        FakeNvml([]),
    ],
    ids=["driver-not-loaded", "no-library", "os-error", "no-gpu"],
)
def test_detect_device_falls_back_to_cpu(nvml: FakeNvml) -> None:
    for device in (detect_device(nvml=nvml), *detect_devices(None, nvml=nvml)):
        assert device.backend == "cpu"
        assert device.index is None
        assert device.name
        assert device.total_bytes == cpu_node_memory()[0]
    assert device_count(nvml) == 0


def test_detect_device_rejects_a_missing_gpu_index() -> None:
    with pytest.raises(DeviceError, match="GPU index 3 does not exist"):
        detect_device(3, nvml=FakeNvml(gpus(1)))


def test_device_count_counts_gpus_and_shuts_down() -> None:
    nvml = FakeNvml(gpus(3))
    assert device_count(nvml) == 3
    assert nvml.refcount == 0


def test_make_probe_picks_the_backend() -> None:
    nvml = one_gpu()
    gpu = make_probe(DeviceInfo("cuda", "fake", 80 * GIB, 0), nvml=nvml)
    assert isinstance(gpu, NvmlProbe)
    scoped = gpu.scoped(gpu.devices)
    assert isinstance(scoped, NvmlProbe) and scoped is not gpu and scoped.devices == gpu.devices
    scoped.close()
    gpu.close()
    cpu_device = DeviceInfo("cpu", "fake cpu", 8 * GIB, None)
    cpu = make_probe(cpu_device)
    assert isinstance(cpu, ProcessTreeProbe) and cpu.device is cpu_device and cpu.devices == (cpu_device,)
    assert cpu.other_holders(exclude_pids=()) == []
    assert 0 < cpu.device_used_bytes() <= cpu_node_memory()[0]
    assert 0 < cpu.free_bytes()[0] <= cpu_node_memory()[0]
    assert isinstance(cpu.scoped([cpu_device]), ProcessTreeProbe) and cpu.scoped([cpu_device]) is not cpu
    with pytest.raises(ValueError, match="backend.*'rocm'.*no memory probe"):
        make_probe(DeviceInfo("rocm", "fake", 1, 0))


# ---------------------------------------------------------------------------------------------------------------------
# wait_for_free_memory


def test_wait_for_free_memory_waits_until_holders_leave() -> None:
    nvml = one_gpu(used=70 * GIB, compute=[(4242, 69 * GIB)])
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    polls = [3]

    def drain(gpu: FakeGpu) -> None:  # an earlier server still exiting leaves after three queries
        polls[0] -= 1
        if polls[0] < 0:
            gpu.compute = []

    nvml.gpus[0].between_calls = drain
    started = time.monotonic()
    assert wait_for_free_memory(probe, exclude_pids=(), timeout_s=5, poll_s=0.01) == []
    assert time.monotonic() - started < 2


def test_wait_for_free_memory_returns_remaining_holders_at_timeout() -> None:
    probe = NvmlProbe(0, nvml=one_gpu(used=70 * GIB, compute=[(4242, 69 * GIB)], names={4242: "python"}))
    assert wait_for_free_memory(probe, (), needed_fraction=0.9, timeout_s=0.05, poll_s=0.01) == [
        (4242, 69 * GIB, "python")
    ]


def test_wait_for_free_memory_is_clear_when_enough_is_free() -> None:
    probe = NvmlProbe(0, nvml=one_gpu(total=80 * GIB, used=5 * GIB, compute=[(4242, 4 * GIB)]))
    assert wait_for_free_memory(probe, (), needed_fraction=0.9, timeout_s=5) == []
    assert wait_for_free_memory(probe, (), needed_bytes=70 * GIB, timeout_s=5) == []


def test_wait_for_free_memory_waits_for_every_gpu_of_the_server() -> None:
    # GPU 0 is free; on GPU 1 an earlier server still holds 60 GiB: a TP=2 server must wait for both.
    nvml = FakeNvml(
        [FakeGpu(gpu_uuid(0), used=1 * GIB), FakeGpu(gpu_uuid(1), used=61 * GIB, compute=[(4242, 60 * GIB)])],
        names={4242: "VLLM"},
    )
    probe = make_probe(detect_devices("0,1", nvml=nvml), nvml=nvml)
    assert wait_for_free_memory(probe, (), needed_fraction=0.9, timeout_s=0.05, poll_s=0.01) == [
        (4242, 60 * GIB, "VLLM")
    ]
    first_only = make_probe(detect_devices("0", nvml=nvml), nvml=nvml)
    assert wait_for_free_memory(first_only, (), needed_fraction=0.9, timeout_s=0.05, poll_s=0.01) == []


def test_wait_for_free_memory_does_not_return_at_once_with_far_too_little_free_and_no_holder() -> None:
    # Issue 23 item 5, reproduced on main: 10 GiB free, 128 GiB needed, NVML lists nobody (another container's
    # processes, a MIG sibling): it returned [] at once and the server was started into a full card.
    nvml = one_gpu(name="NVIDIA H200", total=140 * GIB, used=130 * GIB)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    started = time.monotonic()
    held = wait_for_free_memory(probe, (), needed_bytes=128 * GIB, timeout_s=0.3, poll_s=0.05)
    assert time.monotonic() - started >= 0.3
    assert held == [(UNLISTED_PID, 130 * GIB, held[0][2])] and "no process NVML lists" in held[0][2]


def test_wait_for_free_memory_judges_free_memory_as_cuda_counts_it() -> None:
    # v2 memory: free is total - reserved - used; the need is a fraction of CUDA's total (total - reserved).
    reserved = 698 * 2**20
    nvml = one_gpu(total=80 * GIB, reserved=reserved, used=0)
    probe = NvmlProbe(0, nvml=nvml, processes=nvml.host)
    assert wait_for_free_memory(probe, (), needed_fraction=1.0, timeout_s=5) == []
    nvml.gpus[0].used = 1  # one byte short of CUDA's total
    assert wait_for_free_memory(probe, (), needed_fraction=1.0, timeout_s=0.05, poll_s=0.01)[0][0] == UNLISTED_PID


def test_wait_for_free_memory_on_cpu_returns_at_once_and_checks_input() -> None:
    probe = ProcessTreeProbe(DeviceInfo("cpu", "fake cpu", 8 * GIB, None))
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
        with process:  # closes its pipes and waits: an open pipe left to the GC is a ResourceWarning
            pass


def taken(sampler: MemorySampler) -> int:
    """A sample that must have been read (the CPU probe never misses one)."""
    value = sampler.sample_now()
    assert value is not None, sampler.missed_reason
    return value


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
        baseline = taken(sampler)
        t_go = sampler.mark("spike")
        send(child, "go")
        expect_line(child, "done")
        sampler.sample_now()  # may still hold the spike, if no sample was taken since it was freed
        after = taken(sampler)
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
        baseline = taken(sampler)
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
        before = taken(sampler)
        send(child, "go")
        expect_line(child, "done")  # allocated, held 20 ms and freed, with no sample in between
        spike = taken(sampler)
        after = taken(sampler)
    assert spike - before >= 250 * MB, f"{spike / MB:.0f} MB vs {before / MB:.0f} MB before"
    assert after < spike - 250 * MB  # the next sample starts from the RSS of now


def test_without_a_writable_clear_refs_the_probe_reads_the_current_rss(
    spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    # By construction, not by the machine's speed: the thread ran, and a sample costs less CPU than its period (or the
    # sampler could not keep it). The measured cost is benchmarks/sampler_cost.py's.
    assert len(sampler.samples) >= 2
    assert sampler.cpu_time_s / len(sampler.samples) < 0.05


# ---------------------------------------------------------------------------------------------------------------------
# Sampler bookkeeping with a scripted probe


class ScriptedProbe:
    """Returns the next value of `values` (the last one forever); raises once when told to."""

    device = DeviceInfo("cpu", "scripted", 1 * GIB, None)
    devices = (device,)
    default_period_s = 0.05
    attribution_notes: tuple[str, ...] = ()

    def __init__(self, values: list[int], fail_at: int | None = None) -> None:
        self.values, self.calls, self.fail_at = values, 0, fail_at

    def read(self, pids: Collection[int]) -> tuple[int, ...]:
        return (self.used_bytes(pids),)

    def used_bytes(self, pids: Collection[int]) -> int:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("a bug in the probe")
        return self.values[min(self.calls - 1, len(self.values) - 1)]

    def other_holders(self, exclude_pids: Collection[int]) -> list[tuple[int, int, str]]:
        return []

    def device_used_bytes(self) -> int:
        return 0

    def free_bytes(self) -> tuple[int, ...]:
        return (1 * GIB,)

    def scoped(self, devices: Sequence[DeviceInfo]) -> ScriptedProbe:
        return self

    def close(self) -> None:
        pass


def test_peak_between_uses_only_samples_in_the_window() -> None:
    sampler = MemorySampler(ScriptedProbe([10, 50, 20, 40]), os.getpid())
    assert isinstance(ScriptedProbe([0]), MemoryProbe)
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
    assert isinstance(sampler.error, RuntimeError) and sampler.missed_samples == 0  # a bug is not a missed sample
    with pytest.raises(RuntimeError, match="runs once"):
        sampler.start()


def test_sampler_rejects_a_non_positive_period() -> None:
    with pytest.raises(ValueError, match="period_s 0"):
        MemorySampler(ScriptedProbe([0]), os.getpid(), period_s=0)


def test_process_tree_probe_rejects_an_unknown_metric() -> None:
    with pytest.raises(ValueError, match="metric 'vms'"):
        ProcessTreeProbe(DeviceInfo("cpu", "x", 1, None), metric="vms")  # type: ignore[arg-type]


def test_the_startup_breakdown_counts_graph_memory_once_since_vllm_0_21() -> None:
    # Issue 23 item 7. vLLM 0.32 gpu_worker.py: peak_activation_memory = transient_peak_headroom +
    # cudagraph_memory_estimate_applied, and the summary prints it beside the captured graphs; non-KV memory is
    # consumed + transient + graphs. Lines in vLLM's own format (gpu_worker.py / gpu_model_runner.py).
    from pytest_vllm_mem.diagnosis.diagnose import parse_startup_memory

    log = "\n".join(
        [
            "(Worker pid=1) INFO [gpu_model_runner.py:6143] Estimated CUDA graph memory: 0.50 GiB total",
            "(Worker pid=1) INFO [gpu_worker.py:475] CUDA graph memory profiling is enabled (default since v0.21.0)."
            " The current --gpu-memory-utilization=0.9200 is equivalent to --gpu-memory-utilization=0.9129 without"
            " CUDA graph memory profiling. To maintain the same effective KV cache size as before, increase"
            " --gpu-memory-utilization to 0.9271. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.",
            "(Worker pid=1) INFO [gpu_worker.py:1066] Free memory on device (23.13/23.55 GiB) on startup. Desired GPU"
            " memory utilization is (0.92, 21.67 GiB). Actual usage is 14.49 GiB for consumed memory (weights +"
            " non-torch), 1.84 GiB for peak activation, and 0.53 GiB for CUDAGraph memory.",
        ]
    )
    memory = parse_startup_memory(log)
    assert memory.non_kv_gib == round(14.49 + (1.84 - 0.50) + 0.53, 2)  # 16.36, not 16.86
    without = parse_startup_memory(log.splitlines()[2])  # no profiling line (before 0.21, or disabled): as printed
    assert without.non_kv_gib == round(14.49 + 1.84 + 0.53, 2)
