"""Stands in for a vLLM server that never becomes healthy (a hung model download, a stuck compile, a deadlock).

It takes vLLM's arguments, prints a few log lines, binds --host:--port and listens without ever answering (a /health
request connects, then waits for its own timeout), and sleeps. It starts two sleeping children: one in its process
group and one in a session of its own, so a test can check that stopping the server reaches both (the group kill and
the by-PID kill of children that left the group). With HANG_IGNORE_TERM=1 all three ignore SIGTERM, so only the
SIGKILL after the grace period stops them. HANG_PIDS_FILE, when set, receives the three pids.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

CHILD = (
    "import os, signal, time\n"
    "if os.environ.get('HANG_IGNORE_TERM'): signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "time.sleep(3600)\n"
)


def arg(name: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def model() -> str:
    """The model, positional as `vllm serve` takes it (sys.argv[1]); --model as older launches passed it."""
    argv = sys.argv[1:]
    return argv[0] if argv[:1] and not argv[0].startswith("-") else arg("--model", "stub")


def main() -> None:
    if os.environ.get("HANG_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pid = os.getpid()
    print(f"(APIServer pid={pid}) INFO [api_utils.py:286] non-default args: {sys.argv[1:]}", flush=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((arg("--host", "127.0.0.1"), int(arg("--port", "0"))))
    listener.listen(64)  # the kernel accepts connections; nobody ever reads them
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    detached = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True)
    if os.environ.get("HANG_PIDS_FILE"):
        with open(os.environ["HANG_PIDS_FILE"], "w") as handle:
            handle.write(f"{pid} {child.pid} {detached.pid}\n")
    print(f"(EngineCore pid={child.pid}) INFO [core.py:133] Initializing a V1 LLM engine (v0.0.0-stub)", flush=True)
    print(f"(Worker pid={child.pid}) INFO [cpu_model_runner.py:68] Starting to load model {model()}...", flush=True)
    print(f"(Worker pid={child.pid}) INFO [stub] waiting for a lock that is never released", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
