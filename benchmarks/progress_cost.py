"""What live progress costs the load client and the memory sampler: the same work with progress on and off, as ratios.

Load client: client_cost.py's trivial streaming endpoint in a separate process; run_load against it, alternately
without an observer and under one (plain lines rendered into memory, a real MemorySampler for the peak, the
progress thread at its default 0.5 s), `--pairs` times; client CPU per request (getrusage of this whole process, so
the progress thread is counted) and requests/s, medians. Sampler: a MemorySampler (default period, ProcessTreeProbe)
over a child process tree for `--seconds`, alternately alone and with a StartupWatch polled every 0.25 s as the
health loop polls it (log tail of a growing log, running peak read from the sampler each 0.5 s tick); the sampler
thread's own CPU time per second, and the watch's CPU per poll. No vLLM needed.

    python benchmarks/progress_cost.py [--pairs 5] [--num-prompts 3000] [--seconds 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from client_cost import cpu_seconds  # noqa: E402

from pytest_vllm_mem.config import VLLMConfig  # noqa: E402
from pytest_vllm_mem.launch.watch import watch_startup  # noqa: E402
from pytest_vllm_mem.memory import MemorySampler, ProcessTreeProbe  # noqa: E402
from pytest_vllm_mem.plugin.terminal import Renderer  # noqa: E402
from pytest_vllm_mem.progress import Observer, observing  # noqa: E402

LOG_LINE = (
    "(EngineCore pid=7) INFO 11-30 04:58:51 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with "
    "config: model='tiny-model', speculative_config=None\n"
)


class Discard:
    """A terminal that keeps nothing (the text is still formatted: the renderer's cost is counted)."""

    width = 120

    def __init__(self) -> None:
        self.written = 0

    def line(self, text: str) -> None:
        self.written += 1

    def status(self, text: str) -> None:
        self.written += 1

    def clear_status(self) -> None:
        pass


class FakeServer:
    """What the watches read of a server: its sampler, log, start time, config."""

    def __init__(self, sampler: MemorySampler, log_path: Path) -> None:
        self.sampler = sampler
        self.log_path = log_path
        self.started_at = time.monotonic()
        self.config = VLLMConfig("tiny", max_model_len=1024)
        self.loads_run = 1

    def peak_between(self, since: float) -> int:
        return self.sampler.peak_between(since)


def _observer(server: FakeServer | None, terminal: Discard) -> Observer:
    renderer = Renderer(terminal, "plain", 0)
    if server is None:
        return Observer(renderer, "bench::progress", 24 * 10**9, "24gb")
    return Observer(renderer, "bench::progress", 24 * 10**9, "24gb", server.peak_between, lambda: server.loads_run)


def load_pair(base_url: str, num_prompts: int, server: FakeServer, terminal: Discard) -> dict[str, dict[str, float]]:
    from pytest_vllm_mem.load.client import run_load

    rows = {}
    for name, observer in (("off", None), ("on", _observer(server, terminal))):
        cpu = cpu_seconds()
        with observing(observer):
            result = run_load(base_url, "fake", num_prompts=num_prompts, concurrency=64, max_tokens=4, timeout_s=600)
        cpu = cpu_seconds() - cpu
        assert result.ok, result.errors
        rows[name] = {"cpu_ms_per_req": 1000 * cpu / result.completed, "req_per_s": result.request_throughput}
    return rows


def measure_load(pairs: int, num_prompts: int) -> dict[str, Any]:
    endpoint = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "client_cost.py"), "--serve"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    terminal = Discard()
    sampler = MemorySampler(ProcessTreeProbe(), endpoint.pid).start()
    try:
        base_url = f"http://127.0.0.1:{int(endpoint.stdout.readline())}"  # type: ignore[union-attr]
        server = FakeServer(sampler, Path(os.devnull))
        load_pair(base_url, 300, server, terminal)  # warm both paths
        runs = [load_pair(base_url, num_prompts, server, terminal) for _ in range(pairs)]
    finally:
        sampler.stop()
        os.killpg(endpoint.pid, signal.SIGTERM)
        endpoint.wait(10)
    figures: dict[str, Any] = {"pairs": pairs, "num_prompts": num_prompts, "lines_rendered": terminal.written}
    for key in ("cpu_ms_per_req", "req_per_s"):
        off = statistics.median(run["off"][key] for run in runs)
        on = statistics.median(run["on"][key] for run in runs)
        ratios = [run["on"][key] / run["off"][key] for run in runs]
        figures[key] = {
            "off": off,
            "on": on,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return figures


def sampler_window(root_pid: int, seconds: float, with_watch: bool, log: Path) -> dict[str, float]:
    started_at = time.monotonic()
    sampler = MemorySampler(ProcessTreeProbe(), root_pid).start()
    polls = 0
    poll_cpu = 0.0
    try:
        if with_watch:
            server = FakeServer(sampler, log)
            with observing(_observer(server, Discard())):
                watch = watch_startup(server)
            with open(log, "a") as out:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    out.write(LOG_LINE)  # a log growing as a starting server's does (~4 lines/s here)
                    out.flush()
                    started = time.thread_time()
                    watch.poll()
                    poll_cpu += time.thread_time() - started
                    polls += 1
                    time.sleep(0.25)
            watch.finish(None)
        else:
            time.sleep(seconds)
    finally:
        wall = time.monotonic() - started_at
        sampler.stop()
    return {
        "sampler_cpu_ms_per_s": 1000 * sampler.cpu_time_s / wall,
        "samples": len(sampler.samples),
        "watch_polls": polls,
        "watch_cpu_us_per_poll": 1e6 * poll_cpu / polls if polls else 0.0,
    }


def measure_sampler(pairs: int, seconds: float) -> dict[str, Any]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    log = Path(tempfile.mkdtemp(prefix="vllm-mem-progress-")) / "server.log"
    log.write_text("")
    try:
        runs = [
            (sampler_window(child.pid, seconds, False, log), sampler_window(child.pid, seconds, True, log))
            for _ in range(pairs)
        ]
    finally:
        child.kill()
        child.wait(10)
    off = statistics.median(run[0]["sampler_cpu_ms_per_s"] for run in runs)
    on = statistics.median(run[1]["sampler_cpu_ms_per_s"] for run in runs)
    ratios = [run[1]["sampler_cpu_ms_per_s"] / run[0]["sampler_cpu_ms_per_s"] for run in runs]
    return {
        "pairs": pairs,
        "seconds": seconds,
        "sampler_cpu_ms_per_s": {
            "off": off,
            "on": on,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        },
        "watch_cpu_us_per_poll": statistics.median(run[1]["watch_cpu_us_per_poll"] for run in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="on/off pairs, alternated (default 5)")
    parser.add_argument("--num-prompts", type=int, default=3000, help="requests per load run (default 3000)")
    parser.add_argument("--seconds", type=float, default=6.0, help="sampler window per run (default 6)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args()
    threading.current_thread().name = "progress-cost"
    figures: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load": measure_load(args.pairs, args.num_prompts),
        "sampler": measure_sampler(args.pairs, args.seconds),
    }
    load, sampler = figures["load"], figures["sampler"]
    cpu, rate, sam = load["cpu_ms_per_req"], load["req_per_s"], sampler["sampler_cpu_ms_per_s"]
    print(f"{os.cpu_count()} CPUs, {args.pairs} alternating on/off pairs (medians; ratio = on / off, min-max)")
    print(
        f"  load client CPU/request  off {cpu['off']:.3f} ms  on {cpu['on']:.3f} ms  ratio {cpu['ratio_median']:.3f}"
        f" ({cpu['ratio_min']:.3f}-{cpu['ratio_max']:.3f})"
    )
    print(
        f"  load requests/s          off {rate['off']:.0f}  on {rate['on']:.0f}  ratio {rate['ratio_median']:.3f}"
        f" ({rate['ratio_min']:.3f}-{rate['ratio_max']:.3f})"
    )
    print(
        f"  sampler CPU ms/s         off {sam['off']:.3f}  on {sam['on']:.3f}  ratio {sam['ratio_median']:.3f}"
        f" ({sam['ratio_min']:.3f}-{sam['ratio_max']:.3f})"
    )
    print(f"  startup watch            {sampler['watch_cpu_us_per_poll']:.0f} us CPU per health poll (every 0.25 s)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
