"""A real local Ray cluster for the cluster tests: several raylets on this machine, each with its own resources,
inside a private network namespace that has only loopback (so every address Ray picks is 127.0.0.1).

Run as a script inside the namespace (`RayNamespaceCluster` does that): `python ray_local.py INFO_JSON NODES`
starts NODES nodes of 1 CPU each (custom resources node_0, node_1, ...), writes the address and each node's raylet pid
to INFO_JSON, and shuts the cluster down at end of file on stdin. Drivers run in the same namespace through nsenter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

PYTHON = sys.executable
HERE = Path(__file__).resolve().parent
# Ray's warning when it probes 8.8.8.8 to find its address (a connect() that fails at once: no route here).
NOISE = "Failed to determine local IP"


def namespace_problem() -> str | None:
    """Why a loopback-only network namespace cannot be made here, or None."""
    if not shutil.which("unshare") or not shutil.which("nsenter") or not shutil.which("ip"):
        return "unshare, nsenter and ip (util-linux, iproute2) are needed for a loopback-only network namespace"
    if os.geteuid() != 0:
        return "a network namespace for the Ray cluster needs root here (unshare -n)"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -n failed: {probe.stderr.strip()}"
    return None


class RayNamespaceCluster:
    """The cluster host process in its own network namespace; `run()` runs a command in that namespace."""

    def __init__(self, tmp: Path, nodes: int = 2) -> None:
        self.info_path = tmp / "ray-cluster.json"
        self.log_path = tmp / "ray-cluster.log"
        started = time.monotonic()
        script = f"ip link set lo up && exec {PYTHON} {HERE / 'ray_local.py'} {self.info_path} {nodes}"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["unshare", "-n", "sh", "-c", script], stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
            )
        while not self.info_path.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"the Ray cluster did not start: {self.log_path.read_text()[-3000:]}")
            if time.monotonic() - started > 300:
                self.close()
                raise RuntimeError("the Ray cluster did not start in 300 s")
            time.sleep(0.2)
        self.info = json.loads(self.info_path.read_text())
        self.start_s = time.monotonic() - started
        self.address: str = self.info["address"]

    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_ADDRESS": self.address, "RAY_CLUSTER_INFO": str(self.info_path)}

    def command(self, *argv: str) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.process.pid}/ns/net", *argv]

    def run(self, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(*argv), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def close(self) -> list[psutil.Process]:
        """Shut the cluster down; returns its processes still alive 30 s later (a leak), after killing them."""
        tree = self.processes()
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(proc) for proc in tree):
            time.sleep(0.2)
        left = [proc for proc in tree if _alive(proc)]
        for proc in left:
            proc.kill()
        return left


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def serve(info_path: Path, nodes: int) -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"node_0": 1}, "include_dashboard": False},
    )
    for index in range(1, nodes):
        cluster.add_node(num_cpus=1, resources={f"node_{index}": 1})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    ids = {node["NodeID"]: node for node in ray.nodes()}
    ray.shutdown()
    all_nodes = [cluster.head_node, *cluster.worker_nodes]
    info = {
        "address": cluster.address,
        "nodes": [
            {
                "node_id": node.node_id,
                "raylet_pid": node.all_processes["raylet"][0].process.pid,
                "resources": ids.get(node.node_id, {}).get("Resources", {}),
            }
            for node in all_nodes
        ],
    }
    partial = info_path.with_suffix(".partial")
    partial.write_text(json.dumps(info))
    os.replace(partial, info_path)
    sys.stdin.read()  # until the test closes the pipe (or dies)
    cluster.shutdown()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
