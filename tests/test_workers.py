"""xdist workers get disjoint GPUs (fake NVML); CPU hosts and user-set CUDA_VISIBLE_DEVICES are left alone."""

from __future__ import annotations

import pytest

from pytest_vllm_mem.workers import WorkerDeviceError, assign_worker_gpus, worker_devices


class FakeNvml:
    def __init__(self, count: int, fail: bool = False) -> None:
        self.count, self.fail = count, fail

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlShutdown(self) -> None:
        pass


def test_one_gpu_per_worker_on_an_8_gpu_node() -> None:
    assigned = {}
    for index in range(8):
        env: dict[str, str] = {}
        assign_worker_gpus(f"gw{index}", 1, env, FakeNvml(8))
        assigned[index] = env["CUDA_VISIBLE_DEVICES"]
    assert assigned == {i: str(i) for i in range(8)}


def test_two_gpus_per_worker_for_tensor_parallel() -> None:
    assert worker_devices("gw0", 8, 2) == [0, 1]
    assert worker_devices("gw3", 8, 2) == [6, 7]
    env: dict[str, str] = {}
    assign_worker_gpus("gw1", 2, env, FakeNvml(8))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_more_workers_than_gpus_is_a_clear_error() -> None:
    with pytest.raises(WorkerDeviceError, match=r"gw4 needs GPUs 8\.\.9, but this host has 8: use at most -n 4"):
        worker_devices("gw4", 8, 2)


def test_user_choice_and_cpu_hosts_are_left_alone() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    assert assign_worker_gpus("gw0", 1, env, FakeNvml(8)) is None and env["CUDA_VISIBLE_DEVICES"] == "5"
    env = {}
    assert assign_worker_gpus("gw0", 1, env, FakeNvml(0, fail=True)) is None and env == {}
