"""What a slow session of a vLLM CPU server spends its CPU on: per-thread CPU time of the server's processes over one
load, on several fresh servers (issue 25: whole sessions of the 2-core runner ran 36-60% slower than others).

Each session starts `vllm serve` on the tiny model (the plugin's launcher argv, own process group), sends a warm-up
load, then 64 prompts of 64 tokens at concurrency 8 (the gate benchmarks' shape), and reads every server thread's
CPU time (/proc/PID/task/TID) before and after; the server is stopped by its process group.

    flock /tmp/vllm-e2e.lock python benchmarks/session_threads.py [--sessions 5] [--eager] [--json OUT]

About a minute a session on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
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


def session(model: Path, flags: list[str]) -> dict[str, Any]:
    argv = [
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
        wall, chunks = load(model, 64, 8)
        after = thread_cpu(processes)
        threads = sorted(
            (
                (round(cpu - before.get(key, ("", 0.0, -1))[1], 2), name, core)
                for key, (name, cpu, core) in after.items()
                if cpu - before.get(key, ("", 0.0, -1))[1] > 0.05
            ),
            reverse=True,
        )
        return {
            "tok_s": round(chunks / wall),
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
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-mem-threads-") as tmp:
        model = Path(tmp) / "tiny"
        build_tiny_model(model)
        found = []
        for _ in range(args.sessions):
            found.append(session(model, ["--enforce-eager"] if args.eager else []))
            print(json.dumps(found[-1]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"eager": args.eager, "sessions": found}, indent=1) + "\n")


if __name__ == "__main__":
    main()
