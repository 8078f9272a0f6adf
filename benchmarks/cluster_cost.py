"""What placing a server on a Ray cluster costs (issue 22): request-to-healthy local vs on a real local 2-node Ray
cluster (loopback-only network namespace, tests/ray_local.py), and TTFT with the load client next to the server (an
actor call on its node) vs on the pytest host. Here both "hosts" are one machine, so the TTFT gap is Ray's and the
loopback's, not a network's. Needs root (unshare -n), Ray (pytest-vllm-mem[ray]); about 3 minutes on 2 cores.

    python benchmarks/cluster_cost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from ray_local import RayNamespaceCluster, namespace_problem  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    problem = namespace_problem()
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cluster-cost-") as tmp:
        cluster = RayNamespaceCluster(Path(tmp), nodes=2)
        out = Path(tmp) / "events.jsonl"
        try:
            run = cluster.run(sys.executable, str(TESTS / "cluster_driver.py"), "cost", str(out))
        finally:
            left = cluster.close()
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-5000:], file=sys.stderr)
            return 1
        events = {e["event"]: e for e in map(json.loads, out.read_text().splitlines())}
    local, remote = events["local"], events["cluster"]
    figures = {
        "cluster_start_s": round(cluster.start_s, 1),
        "local_request_to_healthy_s": round(local["request_to_healthy_s"], 1),
        "cluster_request_to_healthy_s": round(remote["request_to_healthy_s"], 1),
        "local_ttft_p50_ms": round(local["ttft_p50_ms"], 1),
        "cluster_ttft_p50_ms_next_to_server": round(remote["ttft_p50_ms_near"], 1),
        "cluster_ttft_p50_ms_from_pytest_host": round(remote["ttft_p50_ms_driver"], 1),
        "ray_processes_left": len(left),
    }
    for name, value in figures.items():
        print(f"{name:40} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
