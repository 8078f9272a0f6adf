"""xdist workers get disjoint GPUs by UUID, MIG slices on a MIG host (tests/fake_nvml.py); CPU hosts and user-set
CUDA_VISIBLE_DEVICES are left alone."""

from __future__ import annotations

import pytest
from fake_nvml import FakeGpu, FakeMig, FakeNvml, gpu_uuid, gpus, mig_uuid

from pytest_vllm_mem.memory import detect_devices
from pytest_vllm_mem.plugin.workers import WorkerDeviceError, assign_worker_gpus, worker_devices


def test_one_gpu_per_worker_on_an_8_gpu_node() -> None:
    assigned = {}
    for index in range(8):
        env: dict[str, str] = {}
        assign_worker_gpus(f"gw{index}", 1, env, FakeNvml(gpus(8)))
        assigned[index] = env["CUDA_VISIBLE_DEVICES"]
    assert assigned == {i: gpu_uuid(i) for i in range(8)}


def test_two_gpus_per_worker_for_tensor_parallel() -> None:
    assert worker_devices("gw0", 8, 2) == [0, 1]
    assert worker_devices("gw3", 8, 2) == [6, 7]
    env: dict[str, str] = {}
    assign_worker_gpus("gw1", 2, env, FakeNvml(gpus(8)))
    assert env["CUDA_VISIBLE_DEVICES"] == f"{gpu_uuid(2)},{gpu_uuid(3)}"


def test_more_workers_than_gpus_is_a_clear_error() -> None:
    with pytest.raises(WorkerDeviceError, match=r"gw4 needs GPUs 8\.\.9, but this host has 8: use at most -n 4"):
        worker_devices("gw4", 8, 2)


def test_user_choice_and_cpu_hosts_are_left_alone() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    assert assign_worker_gpus("gw0", 1, env, FakeNvml(gpus(8))) is None and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {}
    assert assign_worker_gpus("gw0", 1, env, FakeNvml([])) is None and env == {}  # a driver, no GPU


# --- UUIDs, MIG slices (tests/fake_nvml.py) ----------------------------------------------------------------------


def test_workers_get_gpus_by_uuid() -> None:
    host = FakeNvml(gpus(4))
    env: dict[str, str] = {}
    assert assign_worker_gpus("gw1", 2, env, host) == f"{gpu_uuid(2)},{gpu_uuid(3)}"
    assert env["CUDA_VISIBLE_DEVICES"] == f"{gpu_uuid(2)},{gpu_uuid(3)}"
    # What the worker's servers then see, resolved the way the session resolves it: the two cards it was given.
    assert [d.index for d in detect_devices(env["CUDA_VISIBLE_DEVICES"], nvml=host)] == [2, 3]


def test_a_mig_host_hands_out_slices_not_cards() -> None:
    # GPU 0 whole; GPU 1 in MIG mode with two slices: three devices, the slices named by their MIG UUIDs.
    host = FakeNvml(
        [
            FakeGpu(gpu_uuid(0)),
            FakeGpu(
                gpu_uuid(1),
                name="NVIDIA A100-SXM4-80GB",
                mig_capable=True,
                mig_enabled=True,
                migs={0: FakeMig(mig_uuid(10)), 1: FakeMig(mig_uuid(11), gpu_instance=2)},
            ),
        ]
    )
    given = {}
    for index in range(3):
        env: dict[str, str] = {}
        given[index] = assign_worker_gpus(f"gw{index}", 1, env, host)
    assert given == {0: gpu_uuid(0), 1: mig_uuid(10), 2: mig_uuid(11)}
    slice_seen = detect_devices(given[2], nvml=host)
    assert [(d.index, d.mig_index, d.total_bytes) for d in slice_seen] == [(1, 1, 40 * 2**30)]
    with pytest.raises(WorkerDeviceError, match=r"gw3 needs GPUs 3\.\.3, but this host has 3"):
        assign_worker_gpus("gw3", 1, {}, host)


def test_no_nvml_leaves_the_environment_alone() -> None:
    from fake_nvml import NVML_ERROR_LIBRARY_NOT_FOUND

    env: dict[str, str] = {}
    assert assign_worker_gpus("gw0", 1, env, FakeNvml(init_error=NVML_ERROR_LIBRARY_NOT_FOUND)) is None and env == {}


def test_an_empty_cuda_visible_devices_means_no_gpu_not_unset() -> None:
    # Issue 23 item 7: CUDA_VISIBLE_DEVICES="" hides every GPU (a CPU-only job on a GPU host); it was read as
    # unset and the worker was given GPUs.
    env = {"CUDA_VISIBLE_DEVICES": ""}
    assert assign_worker_gpus("gw0", 1, env, FakeNvml(gpus(8))) is None
    assert env == {"CUDA_VISIBLE_DEVICES": ""}


def test_workers_are_assigned_by_uuid_on_a_mixed_host_whatever_the_cuda_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    host = FakeNvml([FakeGpu(gpu_uuid(0), name="NVIDIA L4"), FakeGpu(gpu_uuid(1))])
    env: dict[str, str] = {}
    assert assign_worker_gpus("gw1", 1, env, host) == gpu_uuid(1)
