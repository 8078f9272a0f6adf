"""The baseline gate on a noisy runner: false failures of a config against its own baseline, and the detection of
real regressions, for the old rule (fixed tolerances) and the noise-scaled one.

Collect: one tiny-model vLLM CPU server per session, many loads against each (the load of the issue's example test:
64 prompts, concurrency 8, 64 output tokens). Three sessions of the same config, interleaved in time with three
regressed ones (max_num_seqs=4, 3 and 2 under a concurrency of 8: fewer sequences per step), so a baseline and a later
run of the same config come from different servers at different times, as in CI. Every load's result is kept.

Evaluate: a "run" is `repeat` consecutive loads of one session; the baseline is `repeat` loads of another session.
Each pair goes through the plugin's real code (metrics.record_samples, BaselineEntry.from_samples, and the
comparison) with the old rule, the new one, and the new one with history: the baseline entry as a CI that refreshed
it once per session would have accumulated it (BaselineEntry.continuing, what BaselineStore.update calls, over the
other same-config sessions, then the baseline's own), so the judge sees earlier sessions' medians. A same-config
pair that fails is a false failure, a regressed pair that fails on a throughput or latency metric is a detection.

`--layout history` (the default) starts more, shorter sessions (6 same-config ones of 6 loads, 2 regressed ones) so
that there are earlier sessions to keep; `--layout classic` is the first layout (3 + 3 sessions, 15 loads each).

    python benchmarks/gate_noise.py [--quick] [--layout history|classic] [--json results/gate_noise.json]
    python benchmarks/gate_noise.py --from results/gate_noise.json [more.json ...]   # evaluate saved loads again
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# The example test: vllm_load(num_prompts=64, concurrency=8, max_tokens=64).
LOAD = {"num_prompts": 64, "concurrency": 8, "max_tokens": 64}
SAME = "same"
# (session name, extra server flags, loads). Same-config sessions alternate with regressed ones so that time drift
# of the shared machine lands between baseline and run, as it does between two CI jobs.
SESSIONS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("same-1", {}, 15),
    ("max_num_seqs=4", {"max_num_seqs": 4}, 9),
    ("same-2", {}, 15),
    ("max_num_seqs=3", {"max_num_seqs": 3}, 6),
    ("same-3", {}, 15),
    ("max_num_seqs=2", {"max_num_seqs": 2}, 6),
)
# Sessions are what the history needs: six of the same config (each one can be "now" with up to five earlier ones
# kept), shorter so the whole collection stays near 10 minutes on 2 cores.
HISTORY_SESSIONS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("same-1", {}, 6),
    ("same-2", {}, 6),
    ("max_num_seqs=4", {"max_num_seqs": 4}, 3),
    ("same-3", {}, 6),
    ("same-4", {}, 6),
    ("max_num_seqs=2", {"max_num_seqs": 2}, 3),
    ("same-5", {}, 6),
    ("same-6", {}, 6),
)
LAYOUTS = {"classic": SESSIONS, "history": HISTORY_SESSIONS}
QUICK_LOADS = {SAME: 6, "max_num_seqs=4": 3, "max_num_seqs=3": 3, "max_num_seqs=2": 3}


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def collect(quick: bool, out: Path, layout: str = "history", budget_s: float | None = None) -> dict[str, Any]:
    """Start each session's server once, run its loads, keep everything the plugin's record would hold."""
    from agreement import start_tiny_server

    from pytest_vllm_mem.load import LoadSpec
    from pytest_vllm_mem.measure import measured_load

    workdir = Path(tempfile.mkdtemp(prefix="vllm-mem-gate-noise-"))
    data: dict[str, Any] = {
        "load": LOAD,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(),
        "layout": layout,
        "load_average_before": os.getloadavg(),
        "sessions": [],
    }
    started = time.monotonic()
    for name, flags, loads in LAYOUTS[layout]:
        if budget_s is not None and time.monotonic() - started > budget_s:
            print(f"budget of {budget_s:g} s spent: {name} and later sessions not started", flush=True)
            data["skipped"] = [*data.get("skipped", []), name]
            continue
        if quick:
            loads = QUICK_LOADS[SAME if name.startswith(SAME) else name]
        t0 = time.monotonic()
        state, server = start_tiny_server(workdir / "logs", **flags)
        startup_s = time.monotonic() - t0
        session: dict[str, Any] = {
            "name": name,
            "flags": flags,
            "launched": str(server.launched),
            "startup_s": startup_s,
            "started_at": time.time(),
            "startup": server.startup.to_dict() if server.startup else {},
            "memory": server.memory.to_dict() if server.memory else {},
            "loads": [],
        }
        try:
            for _ in range(loads):
                result = measured_load(server, LoadSpec(**LOAD))
                session["loads"].append({**result.to_dict(), "load_average": os.getloadavg()[0]})
                print(
                    f"{name:>15}  {result.output_throughput:7.1f} tok/s  ttft p50 {result.ttft.p50:6.1f} ms  "
                    f"p99 {result.ttft.p99:6.1f} ms  tpot p50 {result.tpot.p50:5.2f} ms",
                    flush=True,
                )
        finally:
            state.close()
        data["sessions"].append(session)
        data["collect_s"] = time.monotonic() - started
        data["load_average_after"] = os.getloadavg()
        _write_json(out, data)  # after every session: a crash keeps what was measured
        print(f"{name}: startup {startup_s:.0f} s, {time.monotonic() - started:.0f} s so far", flush=True)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few loads per session (a smoke test, not figures)")
    parser.add_argument("--json", default=str(ROOT / "results" / "gate_noise.json"), help="where the loads go")
    parser.add_argument("--budget-s", type=float, help="start no session after this many seconds (a shared machine)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="history", help="which sessions to start")
    parser.add_argument(
        "--from",
        dest="source",
        nargs="+",
        help="evaluate the loads saved in these files (their sessions together, in order); start no server",
    )
    args = parser.parse_args()
    if args.source:
        data = merge([json.loads(Path(path).read_text()) for path in args.source])
    else:
        data = collect(args.quick, Path(args.json), args.layout, args.budget_s)
    figures = evaluate_and_print(data)
    if args.source is None or args.json != parser.get_default("json"):
        _write_json(Path(args.json), {**data, "evaluation": figures})


def merge(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One document of several collections' sessions, in file order; names get the file's number when several."""
    if len(documents) == 1:
        return documents[0]
    sessions = [
        {**session, "name": f"{session['name']}@{i + 1}"}
        for i, doc in enumerate(documents)
        for session in doc["sessions"]
    ]
    return {**documents[0], "sessions": sessions, "merged_from": [doc.get("date") for doc in documents]}


# ---- evaluation ---------------------------------------------------------------------------------------------------

# The old rule: the fixed band on the medians with the defaults before the noise-aware gate (baseline.py, f7ea9db).
OLD_TOLERANCES = {
    "startup_peak_memory": 0.05,
    "load_peak_memory": 0.05,
    "kv_cache_tokens": 0.05,
    "output_throughput": 0.10,
    "request_throughput": 0.10,
    "ttft_p50": 0.20,
    "ttft_p99": 0.20,
    "tpot_p50": 0.20,
}
REPEATS = (1, 2, 3, 5)


@dataclass(frozen=True)
class _Run:
    """What metrics.Metric.read needs of a test record: the server's startup and memory figures, and some loads."""

    startup: dict[str, Any]
    memory: dict[str, Any]
    loads: list[dict[str, Any]]


def _samples(session: dict[str, Any], loads: list[dict[str, Any]]) -> dict[str, list[float]]:
    from pytest_vllm_mem.metrics import record_samples

    return record_samples(_Run(session["startup"], session["memory"], loads))


def _chunks(session: dict[str, Any], repeat: int) -> list[list[dict[str, Any]]]:
    loads = [load for load in session["loads"] if load.get("completed")]
    return [loads[i : i + repeat] for i in range(0, len(loads) - repeat + 1, repeat)]


@dataclass(frozen=True)
class Rule:
    name: str
    judge: Callable[..., Any]
    tolerances: dict[str, Any]
    history: bool = False  # the baseline entry keeps earlier sessions' medians


def rules() -> list[Rule]:
    from pytest_vllm_mem.compare import tolerance_judge
    from pytest_vllm_mem.metrics import METRICS, Tolerance, resolve_tolerances
    from pytest_vllm_mem.noise import noise_aware_judge

    old = {name: Tolerance(relative=value, unit=METRICS[name].unit) for name, value in OLD_TOLERANCES.items()}
    return [
        Rule("old: fixed tolerances", tolerance_judge, old),
        Rule("new: noise-scaled (plugin defaults)", noise_aware_judge, resolve_tolerances({}, {}, {})),
        Rule("new + history of earlier sessions", noise_aware_judge, resolve_tolerances({}, {}, {}), history=True),
    ]


def sweep(
    data: dict[str, Any], ks: tuple[float, ...] = (2.0, 2.5, 3.0, 4.0), repeats: tuple[int, ...] = (3, 5)
) -> list[dict[str, Any]]:
    """The noise rule with other k: same-config false failures and throughput-only detections (how k was chosen)."""
    from pytest_vllm_mem.metrics import resolve_tolerances
    from pytest_vllm_mem.noise import NoiseJudge

    sessions = data["sessions"]
    same = [s for s in sessions if s["name"].startswith(SAME)]
    regressed = [s for s in sessions if not s["name"].startswith(SAME)]
    rows = []
    for repeat in repeats:
        for k in ks:
            rule = Rule(f"k={k:g}", NoiseJudge(k=k), resolve_tolerances({}, {}, {}))
            row: dict[str, Any] = {"repeat": repeat, "k": k}
            pairs = [
                (b, bl, n, nl)
                for b in same
                for n in same
                if b is not n
                for bl, nl in zip(_chunks(b, repeat), _chunks(n, repeat))
            ]
            row["same"] = (sum(bool(judge_pair(rule, *pair)) for pair in pairs), len(pairs))
            for r in regressed:
                now_chunks = _chunks(r, repeat)
                outcomes = [
                    any(
                        c.metric == "output_throughput"
                        for c in judge_pair(rule, b, bl, r, now_chunks[i % len(now_chunks)])
                    )
                    for b in same
                    for i, bl in enumerate(_chunks(b, repeat))
                    if now_chunks
                ]
                row[r["name"]] = (sum(outcomes), len(outcomes))
            rows.append(row)
    return rows


def judge_pair(
    rule: Rule,
    base_session: dict[str, Any],
    base_loads: list[dict[str, Any]],
    now_session: dict[str, Any],
    now_loads: list[dict[str, Any]],
    *,
    strict: bool = False,
    earlier: tuple[tuple[dict[str, Any], list[dict[str, Any]]], ...] = (),
) -> list[Any]:
    """The comparisons the plugin makes for a test whose baseline was recorded from `base_loads` and which now ran
    `now_loads`; the failing ones (not strict). `earlier`: (session, loads) recorded before the baseline, oldest
    first, each refreshing the entry as --vllm-update-baseline does (with rule.history)."""
    from pytest_vllm_mem.baseline_store import BaselineEntry, EnvKey
    from pytest_vllm_mem.compare import compare, gate_failures
    from pytest_vllm_mem.metrics import METRICS
    from pytest_vllm_mem.noise import is_noisy

    env = EnvKey("auto", "cpu", "0.32.0")
    noisy = {name for name, metric in METRICS.items() if is_noisy(metric)}
    entry: BaselineEntry | None = None
    for session, loads in (*(earlier if rule.history else ()), (base_session, base_loads)):
        fresh = BaselineEntry.from_samples("gate_noise", env, _samples(session, loads), config=base_session["launched"])
        entry = fresh.continuing(entry, metrics=noisy)
    assert entry is not None
    tolerances = {name: rule.tolerances[name] for name in rule.tolerances}
    # Metrics a rule has no tolerance for (report-only under it) are not gated: pass the plugin's own mapping.
    comparisons = compare(entry, _samples(now_session, now_loads), tolerances, judge=rule.judge)
    return gate_failures([c for c in comparisons if c.metric in tolerances], strict=strict)


# Throughput drops put onto the measured same-config loads: the machine's real noise, a known regression. Only the
# two throughput figures move (latencies stay as measured), so these count what the throughput gate alone catches.
INJECTED = (0.15, 0.30, 0.70)


def _earlier(
    same: list[dict[str, Any]], exclude: tuple[dict[str, Any], ...], index: int, repeat: int
) -> tuple[tuple[dict[str, Any], list[dict[str, Any]]], ...]:
    """The earlier recordings of a baseline: one run of `repeat` loads of each other same-config session (not the
    baseline's, not now's), in session order. A CI's earlier sessions all precede the baseline; here they are the
    benchmark's other sessions, before and after it (the machine's scatter between sessions is what they carry)."""
    earlier = []
    for session in same:
        chunks = _chunks(session, repeat)
        if any(session is x for x in exclude) or not chunks:
            continue
        earlier.append((session, chunks[index % len(chunks)]))
    return tuple(earlier)


def _slower(load: dict[str, Any], drop: float) -> dict[str, Any]:
    return {
        **load,
        "output_throughput": load["output_throughput"] * (1 - drop),
        "request_throughput": load["request_throughput"] * (1 - drop),
    }


NOISY = ("output_throughput", "request_throughput", "ttft_p50", "ttft_p99", "tpot_p50")


def evaluate(data: dict[str, Any]) -> dict[str, Any]:
    """False failures of same-config pairs and detections of regressed ones, per repeat and rule."""
    sessions = data["sessions"]
    same = [s for s in sessions if s["name"].startswith(SAME)]
    regressed = [s for s in sessions if not s["name"].startswith(SAME)]
    figures: dict[str, Any] = {"effects": effects(same, regressed), "results": []}
    for repeat in REPEATS:
        for rule in rules():
            row: dict[str, Any] = {"repeat": repeat, "rule": rule.name}
            pairs = [
                (b, bl, n, nl, _earlier(same, (b, n), i, repeat))
                for b in same
                for n in same
                if b is not n
                for i, (bl, nl) in enumerate(zip(_chunks(b, repeat), _chunks(n, repeat)))
            ]
            failed: dict[str, int] = {}
            runs_failed = 0
            kept: list[int] = []
            for b, bl, n, nl, earlier in pairs:
                failures = judge_pair(rule, b, bl, n, nl, earlier=earlier)
                kept.append(len(earlier) if rule.history else 0)
                runs_failed += bool(failures)
                for c in failures:
                    failed[c.metric] = failed.get(c.metric, 0) + 1
            # "update?": the summary's hint that a metric improved beyond tolerance (fails only in strict mode).
            update = sum(
                any(c.status == "improved" for c in judge_pair(rule, b, bl, n, nl, strict=True, earlier=earlier))
                for b, bl, n, nl, earlier in pairs
            )
            row["same"] = {"runs": len(pairs), "failed": runs_failed, "by_metric": failed, "update_hint": update}
            row["earlier_sessions"] = sorted(set(kept))
            for drop in INJECTED:
                caught = sum(
                    bool(
                        [
                            c
                            for c in judge_pair(rule, b, bl, n, [_slower(load, drop) for load in nl], earlier=earlier)
                            if c.metric in NOISY
                        ]
                    )
                    for b, bl, n, nl, earlier in pairs
                )
                row[f"injected -{drop:.0%}"] = {"runs": len(pairs), "caught": caught}
            for r in regressed:
                now_chunks = _chunks(r, repeat)
                trials = caught = 0
                example = None
                by_metric: dict[str, int] = {}
                for b in same:
                    for i, bl in enumerate(_chunks(b, repeat)):
                        if not now_chunks:
                            continue
                        now_loads = now_chunks[i % len(now_chunks)]
                        earlier = _earlier(same, (b,), i, repeat)
                        failures = [
                            c for c in judge_pair(rule, b, bl, r, now_loads, earlier=earlier) if c.metric in NOISY
                        ]
                        trials += 1
                        caught += bool(failures)
                        for c in failures:
                            by_metric[c.metric] = by_metric.get(c.metric, 0) + 1
                        if failures and example is None:
                            example = [c.message() for c in failures]
                row[r["name"]] = {"runs": trials, "caught": caught, "by_metric": by_metric, "example": example}
            figures["results"].append(row)
    print("\nthe noise rule with other k (same-config runs failed; output_throughput alone catching each flag)")
    figures["sweep"] = sweep(data)
    for row in figures["sweep"]:
        print(
            f"  repeat {row['repeat']}  k={row['k']:<4g} "
            + "; ".join(f"{key} {value[0]}/{value[1]}" for key, value in row.items() if isinstance(value, tuple))
        )
    return figures


def _median(values: list[float]) -> float:
    from pytest_vllm_mem.noise import median

    return median(values)


def effects(same: list[dict[str, Any]], regressed: list[dict[str, Any]]) -> dict[str, Any]:
    """Per session: each metric's median and robust spread; per regressed session, its change against the pooled
    same-config sessions (what the flag really does)."""
    from pytest_vllm_mem.noise import pooled_spread

    out: dict[str, Any] = {"sessions": {}, "changes": {}}
    pooled: dict[str, list[float]] = {}
    for session in same + regressed:
        samples = _samples(session, session["loads"])
        out["sessions"][session["name"]] = {
            "startup_s": session["startup_s"],
            "loads": len(session["loads"]),
            **{
                name: {"median": _median(v), "spread": pooled_spread(v), "min": min(v), "max": max(v)}
                for name, v in samples.items()
            },
        }
        if session in same:
            for name, values in samples.items():
                pooled.setdefault(name, []).extend(values)
    for session in regressed:
        samples = _samples(session, session["loads"])
        out["changes"][session["name"]] = {
            name: _median(values) / _median(pooled[name]) - 1
            for name, values in samples.items()
            if name in NOISY and name in pooled
        }
    return out


def evaluate_and_print(data: dict[str, Any]) -> dict[str, Any]:
    figures = evaluate(data)
    print("\nper session: median (robust spread of one load, min..max)")
    for name, metrics in figures["effects"]["sessions"].items():
        cells = []
        for metric in (
            "output_throughput",
            "ttft_p50",
            "ttft_p99",
            "tpot_p50",
            "load_peak_memory",
            "startup_peak_memory",
            "kv_cache_tokens",
        ):
            m = metrics.get(metric)
            if m:
                spread = f"{m['spread'] * 100:.1f}%" if m["spread"] is not None else "-"
                cells.append(f"{metric} {m['median']:.4g} ({spread}, {m['min']:.4g}..{m['max']:.4g})")
        print(f"  {name:>15} startup {metrics['startup_s']:.0f} s, {metrics['loads']} loads: " + "; ".join(cells))
    print("\nwhat each flag really does (median vs the pooled same-config loads)")
    for name, changes in figures["effects"]["changes"].items():
        print(f"  {name:>15}: " + ", ".join(f"{m} {v * 100:+.0f}%" for m, v in changes.items()))
    print(
        "\nfalse failures (same config vs its own baseline) and detections (regressed config fails on a "
        "throughput or latency metric)"
    )
    for row in figures["results"]:
        same = row["same"]
        cells = [
            f"same {same['failed']}/{same['runs']} failed {same['by_metric'] or ''}, {same['update_hint']} said update?"
        ]
        for key, value in row.items():
            if isinstance(value, dict) and key != "same":
                cells.append(f"{key} caught {value['caught']}/{value['runs']}")
        if row.get("earlier_sessions", [0]) != [0]:
            cells.append(f"earlier sessions kept {row['earlier_sessions']}")
        print(f"  repeat {row['repeat']}  {row['rule']:<38} " + "; ".join(cells))
    return figures


if __name__ == "__main__":
    main()
