"""The cluster launcher's settings, sizing and errors, without a cluster (tests/test_e2e_cluster.py has one)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
from stubs.helpers import reap

from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.launch import ray_cluster
from pytest_vllm_mem.launch.ray_cluster import (
    ClusterError,
    bundles_for,
    capacity_problem,
    check_reachable,
    cluster_address,
    import_ray,
    ranks_per_node,
)


@pytest.mark.parametrize("setting", [None, "", "local", "  local "])
def test_local_is_the_default(setting: str | None) -> None:
    assert cluster_address(setting, {"RAY_ADDRESS": "10.0.0.1:6379"}) is None


def test_ray_takes_the_address_from_the_environment() -> None:
    assert cluster_address("ray", {"RAY_ADDRESS": "127.0.0.1:6379"}) == "127.0.0.1:6379"
    assert cluster_address("ray", {}) == "auto"  # the cluster `ray start` left on this machine
    assert cluster_address("ray://127.0.0.1:10001", {}) == "ray://127.0.0.1:10001"


@pytest.mark.parametrize("setting", ["slurm", "ray:", "ray://", "ray://host", "ray://host:0", "ray://host:x"])
def test_bad_settings_name_the_input_and_what_is_accepted(setting: str) -> None:
    with pytest.raises(ClusterError) as error:
        cluster_address(setting, {})
    message = str(error.value)
    assert repr(setting) in message
    assert "ray://HOST:PORT" in message
    assert "\n" not in message


def test_unreachable_address_is_a_clear_error_not_a_hang() -> None:
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ClusterError) as error:
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    assert f"127.0.0.1:{port}" in str(error.value) and "ray start --head" in str(error.value)


def test_ray_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ClusterError) as error:
        import_ray()
    assert "pytest-vllm-mem[ray]" in str(error.value) and "--vllm-cluster=local" in str(error.value)


def test_bundles_one_per_node() -> None:
    single = VLLMConfig("m", tensor_parallel_size=2)
    assert bundles_for(single, "GPU") == ([{"GPU": 2.0}], "PACK")
    spread = VLLMConfig("m", tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2)
    assert bundles_for(spread, "GPU") == ([{"GPU": 4.0}, {"GPU": 4.0}], "STRICT_SPREAD")
    assert ranks_per_node(VLLMConfig("m")) == (1, 1)


def test_bad_node_counts_are_refused() -> None:
    with pytest.raises(ClusterError, match="--nnodes 3 does not divide the 4 devices"):
        ranks_per_node(VLLMConfig("m", tensor_parallel_size=4, nnodes=3))
    with pytest.raises(ClusterError, match="not a positive integer"):
        ranks_per_node(VLLMConfig("m", nnodes="two"))
    with pytest.raises(ClusterError, match="--master-addr is set by the cluster launcher"):
        bundles_for(VLLMConfig("m", master_addr="10.0.0.1"), "CPU")


def test_capacity_names_both_figures() -> None:
    nodes = [{"GPU": 8.0, "CPU": 64.0}, {"GPU": 4.0, "CPU": 32.0}, {"CPU": 16.0}]
    assert capacity_problem([{"GPU": 4.0}, {"GPU": 4.0}], nodes) is None
    problem = capacity_problem([{"GPU": 8.0}, {"GPU": 8.0}], nodes)
    assert problem == "needs 2 node(s) with 8 GPU each; the cluster has 1 such node(s) (GPU per alive node: 8, 4, 0)"
    assert "no alive node" in (capacity_problem([{"CPU": 1.0}], []) or "")


def test_node_info_round_trips_to_the_results() -> None:
    node = ray_cluster.NodeInfo("abc", "10.0.0.2", "gpu-7")
    assert node.to_dict() == {"node_id": "abc", "address": "10.0.0.2", "hostname": "gpu-7"}


WORKER = """
import subprocess, sys, time
from pytest_vllm_mem.launch.ray_guard import install
server = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600; wait"], start_new_session=True)
install().watch(server.pid)
time.sleep(0.5)
print(server.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_detached_watchdog_outlives_what_ray_kills() -> None:
    """What Ray does to a dead worker (SIGKILL to it and to its direct children) leaves the detached watchdog,
    which then stops the whole session of the server the worker started (a grandchild included)."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        server_pid = int(worker.stdout.readline())
        session = [p.pid for p in psutil.process_iter() if _sid(p.pid) == server_pid]
        assert len(session) >= 3  # sh and its two sleeps
        children = psutil.Process(worker.pid).children()
        assert any(child.pid == server_pid for child in children)
        for proc in [psutil.Process(worker.pid), *children]:  # Ray's clean-up: the worker, then its direct children
            proc.kill()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in session) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in session if _alive(pid)]
        for pid in left:
            psutil.Process(pid).kill()
        assert not left, f"the server's session outlived its worker: {left}"
    finally:
        reap(worker)


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
