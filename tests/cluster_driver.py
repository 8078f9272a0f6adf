"""Drivers of the cluster end-to-end tests, run inside the cluster's network namespace (tests/ray_local.py):
`python cluster_driver.py SCENARIO OUT_JSON`, and `session_pids` for the suite that test_e2e_cluster.py runs through
the fixtures. Each scenario writes what it saw as JSON lines to OUT_JSON as it goes (the
test reads them, also after killing the driver) and asserts nothing itself."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.launch.ray_cluster import ClusterCapacityError, NodeLostError, RayCluster, cluster_address
from pytest_vllm_mem.launch.server import LaunchSettings
from pytest_vllm_mem.load.client import LoadSpec, run_load
from pytest_vllm_mem.load.measure import measured_load
from pytest_vllm_mem.tiny_model import build_tiny_model

CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-vllm-mem"
LOAD = LoadSpec(num_prompts=16, concurrency=4, max_tokens=16)


def emit(out: Path, **record: object) -> None:
    with open(out, "a") as file:
        file.write(json.dumps(record, default=str) + "\n")


def session_pids(pid: int) -> list[int]:
    """The server's processes: its session (vLLM's engine and workers stay in the API server's session)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == pid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


def setup(out: Path) -> tuple[RayCluster, LaunchSettings, str]:
    model = str(build_tiny_model(CACHE_DIR / "models" / "tiny"))
    settings = LaunchSettings(log_dir=out.parent / "logs", cache_root=CACHE_DIR / "vllm")
    address = cluster_address("ray")
    assert address is not None
    return RayCluster(address), settings, model


def multi_node(out: Path) -> None:
    """A config larger than the cluster is refused at once; a TP=2 server over both nodes (vLLM's multi-node
    launch) serves a load and is measured on each node; then one node is lost."""
    cluster, settings, model = setup(out)
    too_big = VLLMConfig(model, tensor_parallel_size=3, nnodes=3, max_model_len=1024)
    started = time.monotonic()
    try:
        cluster.start(too_big, too_big, settings)
        emit(out, event="capacity", refused=False)
    except ClusterCapacityError as error:
        emit(out, event="capacity", refused=True, message=str(error), seconds=time.monotonic() - started)
    config = VLLMConfig(model, tensor_parallel_size=2, nnodes=2, gpu_memory_utilization=0.1, max_model_len=1024)
    server = cluster.start(config, config, settings)
    pids = {rank: status for rank, status in enumerate(server.status())}
    emit(
        out,
        event="started",
        nodes=[node.to_dict() for node in server.nodes],
        pid=server.pid,
        startup_s=server.startup.duration_s,
        alive=[status["alive"] for status in pids.values()],
        rank_pids=[status["pid"] for status in pids.values()],
        rank_sessions=[session_pids(status["pid"]) for status in pids.values()],
    )
    result = server.call(measured_load, LOAD)
    emit(out, event="load", ok=result.ok, completed=result.completed, per_node=server.per_node_peaks())
    # Node loss: the raylet of rank 1's node dies (SIGKILL, as when a machine goes away).
    info = json.loads(Path(os.environ["RAY_CLUSTER_INFO"]).read_text())
    # Not the node whose raylet this driver is attached to: Ray ends the jobs, and kills the actors, of drivers on a
    # dead node (on one machine the driver attaches to any of the raylets that share its IP).
    driver_node = cluster.ray.get_runtime_context().get_node_id()
    lost_rank = next(rank for rank, node in enumerate(server.nodes) if node.node_id != driver_node)
    lost = next(node for node in info["nodes"] if node["node_id"] == server.nodes[lost_rank].node_id)
    os.kill(lost["raylet_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    message = None
    while time.monotonic() < deadline:
        try:
            server.status()
        except NodeLostError as error:
            message = str(error)
            break
        time.sleep(1)
    emit(out, event="node_lost", message=message, lost_node=lost["node_id"], lost_rank=lost_rank)
    server.stop(5.0)
    emit(out, event="stopped")
    cluster.close()


def cost(out: Path) -> None:
    """benchmarks/cluster_cost.py: one config started locally (server.launch in this process), then on the
    cluster; request-to-healthy for each; TTFT of one load from next to the server and one from this host."""
    from pytest_vllm_mem.launch.server import launch
    from pytest_vllm_mem.memory import detect_device, make_probe

    cluster, settings, model = setup(out)
    config = VLLMConfig(model, gpu_memory_utilization=0.1, max_model_len=1024)
    spec = LoadSpec(num_prompts=64, concurrency=4, max_tokens=32)
    started = time.monotonic()
    local = launch(config, config, settings, make_probe(detect_device()))
    healthy = time.monotonic() - started
    result = measured_load(local, spec)
    emit(out, event="local", request_to_healthy_s=healthy, ttft_p50_ms=result.ttft.p50, ok=result.ok)
    local.stop()
    started = time.monotonic()
    server = cluster.start(config, config, settings)
    healthy = time.monotonic() - started
    near = server.call(measured_load, spec)
    far = run_load(server.url, server.launched.model, spec, seed=7)
    emit(
        out,
        event="cluster",
        request_to_healthy_s=healthy,
        startup_s=server.startup.duration_s,
        ttft_p50_ms_near=near.ttft.p50,
        ttft_p50_ms_driver=far.ttft.p50,
        ok=near.ok and far.ok,
    )
    server.stop()
    cluster.close()


if __name__ == "__main__":
    scenario, target = sys.argv[1], Path(sys.argv[2])
    {"multi_node": multi_node, "cost": cost}[scenario](target)
