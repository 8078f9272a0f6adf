"""What a slow session of a vLLM CPU server spends its CPU on: per-thread CPU time of the server's processes over one
load, on several fresh servers (issue 25: whole sessions of the 2-core runner ran 36-60% slower than others).

Each session starts `vllm serve` on the tiny model (the plugin's launcher argv, own process group), sends a warm-up
load, then 64 prompts of 64 tokens at concurrency 8 (the gate benchmarks' shape), and reads every server thread's
CPU time (/proc/PID/task/TID) before and after. Then the same server runs the load six more times, to show whether
its speed is fixed at its start: two with the hypervisor's steal share of the machine's CPU time over each
(/proc/stat), four between two probes of the machine's plain CPU speed. The server is stopped by its process group.

    flock /tmp/vllm-e2e.lock python benchmarks/session_threads.py [--sessions 5] [--eager] [--no-aslr] [--json OUT]

About two minutes a session on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_vllm_mem.tiny_model import build_tiny_model  # noqa: E402
from pytest_vllm_mem.versions import launch_argv  # noqa: E402

PORT = 8765


def thread_cpu(processes: list[psutil.Process]) -> dict[tuple[int, int], tuple[str, float, int]]:
    """(pid, tid) -> (process name, CPU seconds, the core it last ran on)."""
    out = {}
    for process in processes:
        try:
            for thread in process.threads():
                stat = Path(f"/proc/{process.pid}/task/{thread.id}/stat").read_text().rsplit(")", 1)[1].split()
                out[(process.pid, thread.id)] = (process.name(), thread.user_time + thread.system_time, int(stat[36]))
        except (psutil.Error, OSError):
            continue
    return out


def cpu_ticks() -> tuple[int, int]:
    """(steal ticks, all ticks) of the machine so far (/proc/stat): steal is time the hypervisor ran someone else on
    our virtual CPUs while they had work."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU time stolen between two cpu_ticks() readings."""
    return round((after[0] - before[0]) / max(after[1] - before[1], 1), 3)


def probe_ms() -> float:
    """Wall milliseconds of a fixed piece of CPU work on one thread in this process (512 x 512 float32 matrix
    products), taken while the server is idle: the machine's own speed at that moment, whatever vLLM does."""
    import torch

    torch.set_num_threads(1)
    a = torch.rand(512, 512)
    start = time.perf_counter()
    for _ in range(40):
        a = torch.mm(a, a).clamp_(0, 1)
    return round((time.perf_counter() - start) * 1000, 1)


def timed_load(model: Path) -> tuple[int, float, float]:
    """Throughput of one 64 x 64-token load at concurrency 8, the share of the machine's CPU time stolen by the
    hypervisor meanwhile, and its wall seconds."""
    before = cpu_ticks()
    wall, chunks = load(model, 64, 8)
    return round(chunks / wall), steal_share(before, cpu_ticks()), wall


def probed_loads(model: Path, count: int) -> list[dict[str, float]]:
    """`count` loads, each between two probes of the machine's speed."""
    out = []
    for _ in range(count):
        before = probe_ms()
        tok_s, steal, _ = timed_load(model)
        out.append({"tok_s": tok_s, "steal_share": steal, "probe_ms_before": before, "probe_ms_after": probe_ms()})
    return out


def load(model: Path, num: int, concurrency: int) -> tuple[float, int]:
    """Wall seconds and streamed chunks of `num` completions of 64 tokens at `concurrency`."""
    pending = list(range(num))
    lock, chunks = threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index = pending.pop()
            body = {
                "model": str(model),
                "prompt": f"hello world {index} " * 20,
                "max_tokens": 64,
                "ignore_eos": True,
                "stream": True,
            }
            with requests.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, stream=True, timeout=120) as r:
                count = sum(1 for line in r.iter_lines() if line and line != b"data: [DONE]")
            with lock:
                chunks[0] += count

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started, chunks[0]


def session(model: Path, flags: list[str], no_aslr: bool = False) -> dict[str, Any]:
    # setarch -R: the server and its children at fixed addresses, to test whether a slow session is an unlucky layout.
    argv = [
        *(["setarch", platform.machine(), "-R"] if no_aslr else []),
        *launch_argv(sys.executable, str(model), flags),
        "--port",
        str(PORT),
        "--gpu-memory-utilization",
        "0.1",
        "--max-model-len",
        "1024",
    ]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(300):
            try:
                if requests.get(f"http://127.0.0.1:{PORT}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        load(model, 8, 4)  # warm-up
        root = psutil.Process(server.pid)
        processes = [root, *root.children(recursive=True)]
        before = thread_cpu(processes)
        tok_s, stolen, wall = timed_load(model)
        after = thread_cpu(processes)
        # The same server twice more: is its speed fixed at its start, and does the hypervisor's steal follow it?
        again = [timed_load(model) for _ in range(2)]
        probed = probed_loads(model, 4)
        threads = sorted(
            (
                (round(cpu - before.get(key, ("", 0.0, -1))[1], 2), name, core)
                for key, (name, cpu, core) in after.items()
                if cpu - before.get(key, ("", 0.0, -1))[1] > 0.05
            ),
            reverse=True,
        )
        return {
            "tok_s": tok_s,
            "steal_share": stolen,
            "tok_s_again": [again_tok_s for again_tok_s, _, _ in again],
            "steal_share_again": [steal for _, steal, _ in again],
            "probed": probed,
            "wall_s": round(wall, 2),
            "server_cpu_s": round(sum(t[0] for t in threads), 2),
            "threads": threads[:6],
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager: no torch.compile artifact")
    parser.add_argument("--no-aslr", action="store_true", help="start each server under setarch -R (fixed addresses)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-mem-threads-") as tmp:
        model = Path(tmp) / "tiny"
        build_tiny_model(model)
        found = []
        for _ in range(args.sessions):
            found.append(session(model, ["--enforce-eager"] if args.eager else [], args.no_aslr))
            print(json.dumps(found[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"eager": args.eager, "no_aslr": args.no_aslr, "sessions": found}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
