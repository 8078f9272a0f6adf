"""The baseline gate on a noisy runner, replayed as CI would meet it: false failures of a config against its own
baseline, and the detection of real and injected regressions, for the old rule (fixed tolerances) and the new ones.

Collect: one tiny-model vLLM CPU server per session, in time order, each session a "CI job" that runs the load of
the issue's example test (64 prompts, concurrency 8, 64 output tokens) a few times. Same-config sessions alternate
with regressed ones (`max_num_seqs` 6, 4, 3, 2, 1 under a concurrency of 8: fewer sequences per step), so a baseline
and a later run of the same config come from different servers minutes apart. Every load's result is kept, with the
server's CPU time during it (the `cpu_per_token` metric of the CPU backend).

Replay (`replay`): same-config session i is the baseline a push to main recorded, with the sessions before it (up to
the 5 the baseline file keeps) as its history, exactly as `--vllm-update-baseline` would have accumulated them
(`BaselineEntry.continuing`); every later same-config session j > i is a CI run compared with it. Only baselines with
at least 2 earlier sessions are replayed, so every rule is judged on the same runs. A run is its session's first
`repeat` loads, and each pair goes through the plugin's own code (`metrics.record_samples`,
`BaselineEntry.from_samples`, `compare.compare` with the rule's judge). A same-config run that fails is a false
failure; a regressed session (compared with every replayed baseline) or an injected regression that fails on a
throughput or latency metric is a detection.

Injected regressions put a known slowdown onto the measured same-config runs (the runner's real noise, a known
change). At a fixed concurrency a server that serves d% fewer tokens per second keeps each request longer by
1/(1-d) (Little's law), so a throughput-only drop with latencies unchanged cannot happen; two kinds can:
"more work" (every time figure / (1-d), throughput x (1-d), the server's CPU per token / (1-d): a slower kernel, more
Python per step) and "more waiting" (the same, but the CPU per token unchanged: an idle wait added per step).

    python benchmarks/gate_noise.py [--quick] [--json results/gate_noise.json] [--budget-s S]
    python benchmarks/gate_noise.py --from results/gate_noise.json   # replay saved loads, no server
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
LOAD: dict[str, Any] = {"num_prompts": 64, "concurrency": 8, "max_tokens": 64}
SAME = "same"
# (session name, extra server flags, loads), in time order: 8 same-config "CI jobs" of 5 loads (runs of repeat 1, 3
# and 5 can be cut from each), 5 regressed ones of 3 loads between and after them. About 16 minutes on 2 quiet cores.
SESSIONS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("same-1", {}, 5),
    ("same-2", {}, 5),
    ("same-3", {}, 5),
    ("max_num_seqs=6", {"max_num_seqs": 6}, 3),
    ("same-4", {}, 5),
    ("max_num_seqs=4", {"max_num_seqs": 4}, 3),
    ("same-5", {}, 5),
    ("same-6", {}, 5),
    ("max_num_seqs=3", {"max_num_seqs": 3}, 3),
    ("same-7", {}, 5),
    ("max_num_seqs=2", {"max_num_seqs": 2}, 3),
    ("same-8", {}, 5),
    # One sequence at a time under a concurrency of 8: requests queue, throughput falls by about 70%.
    ("max_num_seqs=1", {"max_num_seqs": 1}, 3),
)
QUICK_SESSIONS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("same-1", {}, 3),
    ("same-2", {}, 3),
    ("same-3", {}, 3),
    ("max_num_seqs=2", {"max_num_seqs": 2}, 3),
)
# For fresh-start confirmation (issue 25): a baseline with a full window of earlier sessions, the run, and the fresh
# servers a confirmation starts after it, all distinct sessions: 16 same-config sessions of 3 loads, nothing else
# between them (the injected regressions stand for real ones). About 15 minutes on 2 quiet cores.
LONG_SESSIONS: tuple[tuple[str, dict[str, Any], int], ...] = tuple((f"same-{i}", {}, 3) for i in range(1, 17))
# A busy runner, made on purpose (--busy): 12 same-config sessions of 3 loads, a CPU-burning process beside every load
# of sessions 3, 4, 8 and 9 and beside the middle load of sessions 6 and 11 (by index here), the rest quiet. What the
# plugin records of each load (others_cpu_share) says which ran beside it, without being told.
BUSY_SESSIONS: tuple[tuple[str, dict[str, Any], int], ...] = tuple((f"same-{i}", {}, 3) for i in range(1, 13))
BURNED_LOADS = {2: (0, 1, 2), 3: (0, 1, 2), 5: (1,), 7: (0, 1, 2), 8: (0, 1, 2), 10: (1,)}
REPEATS = (1, 3, 5)
KEEP_HISTORY = 5  # what the baseline file keeps (baseline_store.KEEP_HISTORY)
MIN_EARLIER = 2  # baselines replayed: those with this many earlier sessions (noise.MIN_HISTORY)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _burner() -> subprocess.Popen[bytes]:
    """A process that keeps one CPU busy: the neighbour of a busy runner (stopped by its pid)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def collect(
    quick: bool, out: Path, budget_s: float | None = None, long: bool = False, busy: bool = False
) -> dict[str, Any]:
    """Start each session's server once, run its loads, keep everything the plugin's record would hold."""
    from agreement import start_tiny_server

    from pytest_vllm_mem.load.client import LoadSpec
    from pytest_vllm_mem.load.measure import measured_load

    workdir = Path(tempfile.mkdtemp(prefix="vllm-mem-gate-noise-"))
    data: dict[str, Any] = {
        "load": LOAD,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(),
        "load_average_before": os.getloadavg(),
        "sessions": [],
    }
    started = time.monotonic()
    plan = QUICK_SESSIONS if quick else LONG_SESSIONS if long else BUSY_SESSIONS if busy else SESSIONS
    for index, (name, flags, loads) in enumerate(plan):
        if budget_s is not None and time.monotonic() - started > budget_s:
            print(f"budget of {budget_s:g} s spent: {name} and later sessions not started", flush=True)
            data["skipped"] = [*data.get("skipped", []), name]
            continue
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
            for number in range(loads):
                burner = _burner() if busy and number in BURNED_LOADS.get(index, ()) else None
                try:
                    result = measured_load(server, LoadSpec(**LOAD))
                finally:
                    if burner is not None:
                        burner.kill()
                        burner.wait()
                session["loads"].append(
                    {**result.to_dict(), "load_average": os.getloadavg()[0], "burner": burner is not None}
                )
                cpu = f"{result.cpu_ms_per_token:5.2f}" if result.cpu_ms_per_token is not None else "    -"
                print(
                    f"{name:>15}  {result.output_throughput:7.1f} tok/s  ttft p50 {result.ttft.p50:6.1f} ms  "
                    f"tpot p50 {result.tpot.p50:5.2f} ms  cpu {cpu} ms/token  "
                    f"others {result.others_cpu_share or 0:4.0%}{'  (burner)' if burner is not None else ''}",
                    flush=True,
                )
        finally:
            state.close()
        data["sessions"].append(session)
        data["collect_s"] = time.monotonic() - started
        data["load_average_after"] = os.getloadavg()
        write_json(out, data)  # after every session: a crash keeps what was measured
        print(f"{name}: startup {startup_s:.0f} s, {time.monotonic() - started:.0f} s so far", flush=True)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 short sessions (a smoke test, not figures)")
    parser.add_argument("--json", default=str(ROOT / "results" / "gate_noise.json"), help="where the loads go")
    parser.add_argument("--long", action="store_true", help="16 same-config sessions of 3 loads (fresh-start replay)")
    parser.add_argument("--busy", action="store_true", help="12 sessions of 3 loads, a CPU burner beside some loads")
    parser.add_argument("--budget-s", type=float, help="start no session after this many seconds (a shared machine)")
    parser.add_argument("--from", dest="source", help="replay the loads saved in this file; start no server")
    args = parser.parse_args()
    data = (
        json.loads(Path(args.source).read_text())
        if args.source
        else collect(args.quick, Path(args.json), args.budget_s, long=args.long, busy=args.busy)
    )
    figures = evaluate_and_print(data)
    if args.source is None or args.json != parser.get_default("json"):
        write_json(Path(args.json), {**data, "evaluation": figures})


# ---- replay --------------------------------------------------------------------------------------------------------

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
# What a detection may fail on: the throughput and latency metrics (memory and KV do not move with these flags).
NOISY = ("output_throughput", "request_throughput", "ttft_p50", "ttft_p99", "tpot_p50", "cpu_per_token")


@dataclass(frozen=True)
class _Run:
    """What metrics.Metric.read needs of a test record: the server's startup and memory figures, and some loads."""

    startup: dict[str, Any]
    memory: dict[str, Any]
    loads: list[dict[str, Any]]
    restarts: list[dict[str, Any]]  # a confirmation's fresh servers (TestRecord.restarts)


def _samples(
    session: dict[str, Any], loads: list[dict[str, Any]], fresh: list[dict[str, Any]] | None = None
) -> dict[str, list[float]]:
    """The samples of a run of `loads` on `session`'s server, and of the `fresh` servers a confirmation started."""
    from pytest_vllm_mem.baseline.metrics import record_samples

    restarts = [{"startup": other["startup"], "memory": other["memory"]} for other in fresh or []]
    return record_samples(_Run(session["startup"], session["memory"], loads, restarts))


def _run(session: dict[str, Any], repeat: int) -> list[dict[str, Any]] | None:
    """A CI job's run: the session's first `repeat` completed loads (None when it has fewer)."""
    loads = [load for load in session["loads"] if load.get("completed")]
    return loads[:repeat] if len(loads) >= repeat else None


@dataclass(frozen=True)
class Rule:
    name: str
    judge: Callable[..., Any]
    tolerances: dict[str, Any]
    history: bool = False  # the baseline entry keeps earlier sessions' medians


def rules() -> list[Rule]:
    from pytest_vllm_mem.baseline.compare import tolerance_judge
    from pytest_vllm_mem.baseline.metrics import METRICS, Tolerance, resolve_tolerances
    from pytest_vllm_mem.baseline.noise import noise_aware_judge

    old = {name: Tolerance(relative=value, unit=METRICS[name].unit) for name, value in OLD_TOLERANCES.items()}
    new = resolve_tolerances({}, {}, {})
    without_cpu = {name: tolerance for name, tolerance in new.items() if name != "cpu_per_token"}
    return [
        Rule("old: fixed tolerances", tolerance_judge, old),
        Rule("new, no history", noise_aware_judge, new),
        Rule("new + history, without cpu_per_token", noise_aware_judge, without_cpu, history=True),
        Rule("new + history (plugin defaults)", noise_aware_judge, new, history=True),
    ]


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
    from pytest_vllm_mem.baseline.compare import compare, gate_failures
    from pytest_vllm_mem.baseline.metrics import METRICS
    from pytest_vllm_mem.baseline.noise import is_noisy
    from pytest_vllm_mem.baseline.store import BaselineEntry, EnvKey

    env = EnvKey("auto", "cpu", "0.32.0")
    noisy = {name for name, metric in METRICS.items() if is_noisy(metric)}
    entry: BaselineEntry | None = None
    for session, loads in (*(earlier if rule.history else ()), (base_session, base_loads)):
        fresh = BaselineEntry.from_samples("gate_noise", env, _samples(session, loads), config=base_session["launched"])
        entry = fresh.continuing(entry, metrics=noisy)
    assert entry is not None
    comparisons = compare(entry, _samples(now_session, now_loads), rule.tolerances, judge=rule.judge)
    # Metrics a rule has no tolerance for (report-only under it) are not gated.
    return gate_failures([c for c in comparisons if c.metric in rule.tolerances], strict=strict)


INJECTED = (0.15, 0.30, 0.70)
_TIMES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def slower(load: dict[str, Any], drop: float, more_work: bool) -> dict[str, Any]:
    """`load` served `drop` slower: throughput x (1 - drop), every per-request time / (1 - drop); with `more_work`
    the server's CPU per token too (the same work takes longer), else it stays (the server waits, idle)."""
    factor = 1 / (1 - drop)
    out = {
        **load,
        "output_throughput": load["output_throughput"] * (1 - drop),
        "request_throughput": load["request_throughput"] * (1 - drop),
        **{key: {k: v * factor for k, v in load[key].items()} for key in _TIMES if isinstance(load.get(key), dict)},
    }
    if more_work and load.get("cpu_ms_per_token"):
        out["cpu_ms_per_token"] = load["cpu_ms_per_token"] * factor
    return out


@dataclass(frozen=True)
class Pair:
    """One replayed CI run: the baseline session, its run, its earlier sessions' runs, the later session's run."""

    base: dict[str, Any]
    base_loads: list[dict[str, Any]]
    earlier: tuple[tuple[dict[str, Any], list[dict[str, Any]]], ...]
    now: dict[str, Any]
    now_loads: list[dict[str, Any]]


Baseline = tuple[int, list[dict[str, Any]], tuple[tuple[dict[str, Any], list[dict[str, Any]]], ...]]


def _baselines(same: list[dict[str, Any]], repeat: int) -> list[Baseline]:
    """(index, its run, the earlier sessions' runs) of each same-config session that can be a replayed baseline."""
    found = []
    for i, session in enumerate(same):
        base_loads = _run(session, repeat)
        if base_loads is None:
            continue
        earlier = tuple((s, r) for s in same[max(0, i - KEEP_HISTORY) : i] if (r := _run(s, repeat)) is not None)
        if len(earlier) >= MIN_EARLIER:
            found.append((i, base_loads, earlier))
    return found


def same_pairs(same: list[dict[str, Any]], repeat: int) -> list[Pair]:
    pairs = []
    for i, base_loads, earlier in _baselines(same, repeat):
        for later in same[i + 1 :]:
            now_loads = _run(later, repeat)
            if now_loads is not None:
                pairs.append(Pair(same[i], base_loads, earlier, later, now_loads))
    return pairs


def regressed_pairs(same: list[dict[str, Any]], regressed: dict[str, Any], repeat: int) -> list[Pair]:
    now_loads = _run(regressed, repeat)
    if now_loads is None:
        return []
    return [
        Pair(same[i], base_loads, earlier, regressed, now_loads) for i, base_loads, earlier in _baselines(same, repeat)
    ]


def _fails(rule: Rule, pair: Pair, now_loads: list[dict[str, Any]] | None = None) -> list[Any]:
    loads = pair.now_loads if now_loads is None else now_loads
    return judge_pair(rule, pair.base, pair.base_loads, pair.now, loads, earlier=pair.earlier)


def evaluate(data: dict[str, Any]) -> dict[str, Any]:
    """False failures of same-config runs and detections of regressed ones, per repeat and rule."""
    sessions = data["sessions"]
    same = [s for s in sessions if s["name"].startswith(SAME)]
    regressed = [s for s in sessions if not s["name"].startswith(SAME)]
    figures: dict[str, Any] = {"effects": effects(same, regressed), "results": []}
    for repeat in REPEATS:
        pairs = same_pairs(same, repeat)
        if not pairs:
            continue
        for rule in rules():
            row: dict[str, Any] = {"repeat": repeat, "rule": rule.name}
            failed: dict[str, int] = {}
            runs_failed = 0
            for pair in pairs:
                failures = _fails(rule, pair)
                runs_failed += bool(failures)
                for c in failures:
                    failed[c.metric] = failed.get(c.metric, 0) + 1
            row["same"] = {"runs": len(pairs), "failed": runs_failed, "by_metric": failed}
            for more_work in (True, False):
                for drop in INJECTED:
                    caught = sum(
                        any(
                            c.metric in NOISY
                            for c in _fails(rule, pair, [slower(load, drop, more_work) for load in pair.now_loads])
                        )
                        for pair in pairs
                    )
                    kind = "more work" if more_work else "more waiting"
                    row[f"{kind} -{drop:.0%}"] = {"runs": len(pairs), "caught": caught}
            for r in regressed:
                trials = caught = 0
                by_metric: dict[str, int] = {}
                example = None
                for pair in regressed_pairs(same, r, repeat):
                    failures = [c for c in _fails(rule, pair) if c.metric in NOISY]
                    trials += 1
                    caught += bool(failures)
                    for c in failures:
                        by_metric[c.metric] = by_metric.get(c.metric, 0) + 1
                    if failures and example is None:
                        example = [c.message() for c in failures]
                if trials:
                    row[r["name"]] = {"runs": trials, "caught": caught, "by_metric": by_metric, "example": example}
            figures["results"].append(row)
    figures["sweep"] = sweep(same)
    return figures


def sweep(same: list[dict[str, Any]], alphas: tuple[float, ...] = (0.05, 0.025, 0.01)) -> list[dict[str, Any]]:
    """The window rule at other one-sided levels, repeats 3 and 5: same-config false failures and injected 30%
    "more work" and "more waiting" detections (how the default alpha was chosen)."""
    from pytest_vllm_mem.baseline.metrics import resolve_tolerances
    from pytest_vllm_mem.baseline.noise import NoiseJudge

    rows = []
    for repeat in (3, 5):
        pairs = same_pairs(same, repeat)
        for alpha in alphas:
            rule = Rule(f"alpha={alpha:g}", NoiseJudge(alpha=alpha), resolve_tolerances({}, {}, {}), history=True)
            row: dict[str, Any] = {
                "repeat": repeat,
                "alpha": alpha,
                "same": (sum(bool(_fails(rule, p)) for p in pairs), len(pairs)),
            }
            for more_work in (True, False):
                caught = sum(
                    any(c.metric in NOISY for c in _fails(rule, p, [slower(x, 0.30, more_work) for x in p.now_loads]))
                    for p in pairs
                )
                row["more work -30%" if more_work else "more waiting -30%"] = (caught, len(pairs))
            rows.append(row)
    return rows


def _median(values: list[float]) -> float:
    from pytest_vllm_mem.baseline.noise import median

    return median(values)


def effects(same: list[dict[str, Any]], regressed: list[dict[str, Any]]) -> dict[str, Any]:
    """Per session: each metric's median and robust spread; per regressed session, its change against the pooled
    same-config sessions (what the flag really does); the spread of the same-config sessions' medians."""
    from pytest_vllm_mem.baseline.noise import pooled_spread

    out: dict[str, Any] = {"sessions": {}, "changes": {}, "between_sessions": {}}
    pooled: dict[str, list[float]] = {}
    medians: dict[str, list[float]] = {}
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
                medians.setdefault(name, []).append(_median(values))
    for session in regressed:
        samples = _samples(session, session["loads"])
        out["changes"][session["name"]] = {
            name: _median(values) / _median(pooled[name]) - 1
            for name, values in samples.items()
            if name in NOISY and name in pooled
        }
    out["between_sessions"] = {name: pooled_spread(values) for name, values in medians.items() if name in NOISY}
    return out


def evaluate_and_print(data: dict[str, Any]) -> dict[str, Any]:
    figures = evaluate(data)
    print("\nper session, in time order: median (robust spread of one load, min..max)")
    for name, metrics in figures["effects"]["sessions"].items():
        cells = []
        for metric in ("output_throughput", "ttft_p50", "tpot_p50", "cpu_per_token", "kv_cache_tokens"):
            m = metrics.get(metric)
            if m:
                spread = f"{m['spread'] * 100:.1f}%" if m["spread"] is not None else "-"
                cells.append(f"{metric} {m['median']:.4g} ({spread}, {m['min']:.4g}..{m['max']:.4g})")
        print(f"  {name:>15} startup {metrics['startup_s']:.0f} s, {metrics['loads']} loads: " + "; ".join(cells))
    between = figures["effects"]["between_sessions"]
    print(
        "\nspread of the same-config sessions' medians (robust, log scale): "
        + ", ".join(f"{name} {value * 100:.1f}%" for name, value in between.items() if value is not None)
    )
    print("\nwhat each flag really does (median vs the pooled same-config loads)")
    for name, changes in figures["effects"]["changes"].items():
        print(f"  {name:>15}: " + ", ".join(f"{m} {v * 100:+.0f}%" for m, v in changes.items()))
    print("\nreplayed CI runs: same config failed (false failures); regressions caught on a throughput/latency metric")
    for row in figures["results"]:
        same = row["same"]
        cells = [f"same {same['failed']}/{same['runs']} failed {same['by_metric'] or ''}"]
        for key, value in row.items():
            if isinstance(value, dict) and key != "same":
                cells.append(f"{key} {value['caught']}/{value['runs']}")
        print(f"  repeat {row['repeat']}  {row['rule']:<38} " + "; ".join(cells))
    print("\nthe window rule at other one-sided levels alpha (same-config runs failed; injected 30% caught)")
    for row in figures["sweep"]:
        print(
            f"  repeat {row['repeat']}  alpha={row['alpha']:<6g} "
            + "; ".join(f"{key} {value[0]}/{value[1]}" for key, value in row.items() if isinstance(value, tuple))
        )
    return figures


# ---- issue 25's targets: suite-level control and confirmation, on every saved collection at once ---------------

# The rules replayed: (name, confirmation on fresh servers, a busy runner's loads left out).
MODES = (("no confirm", False, False), ("confirm", True, False), ("confirm, busy loads left out", True, True))
SUITE_TESTS = 20
SUITE_RUNS = 20


@dataclass(frozen=True)
class Case:
    """One replayed test of a suite: its baseline entry (with whatever history it had), this run's loads, the runs of
    the sessions after it (what the plugin's confirmation on fresh servers would measure: each later session's first
    `repeat` loads, in time order), and the pooled session spreads of the other sessions (what the baseline file's
    other tests show of this runner)."""

    entry: Any
    now_session: dict[str, Any]
    now_loads: list[dict[str, Any]]
    fresh: list[tuple[dict[str, Any], list[dict[str, Any]]]]  # (session, its first `repeat` loads)
    pooled: dict[str, Any]


def _entry(sessions: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> Any:
    """The baseline entry that recording these (session, loads), oldest first, with --vllm-update-baseline leaves."""
    from pytest_vllm_mem.baseline.metrics import METRICS
    from pytest_vllm_mem.baseline.noise import is_noisy
    from pytest_vllm_mem.baseline.store import BaselineEntry, EnvKey

    noisy = {name for name, metric in METRICS.items() if is_noisy(metric)}
    entry = None
    for session, loads in sessions:
        fresh = BaselineEntry.from_samples(
            "gate_noise", EnvKey("auto", "cpu", "0.32.0"), _samples(session, loads), config=session["launched"]
        )
        entry = fresh.continuing(entry, metrics=noisy)
    return entry


def _pooled(sames: list[list[dict[str, Any]]], leave_out: dict[str, Any], repeat: int) -> dict[str, Any]:
    """Per metric, the pooled spread of the session medians of every collection (one window each) without the
    session judged: a stand-in for the windows of a suite's other tests on this runner (each collection 7 degrees
    of freedom; a real 20-test suite with 5 earlier sessions each has 100)."""
    from pytest_vllm_mem.baseline.noise import NOISY_GATED, pooled_prior

    priors = {}
    for name in NOISY_GATED:
        windows = [
            [
                _median(samples[name])
                for s in same
                if s is not leave_out
                and (r := _run(s, repeat)) is not None
                and name in (samples := _samples(s, r))  # none: every load's delivery coalesced (latency)
            ]
            for same in sames
        ]
        prior = pooled_prior(windows)
        if prior is not None:
            priors[name] = prior
    return priors


def _busy(load: dict[str, Any]) -> bool:
    from pytest_vllm_mem.baseline.metrics import busy_load

    return busy_load(load)


def _quiet(loads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loads the gate judges (TestRecord.quiet, metrics.quiet_loads)."""
    from pytest_vllm_mem.baseline.metrics import quiet_loads

    return [dict(load) for load in quiet_loads(loads)]


def cases(
    sames: list[list[dict[str, Any]]],
    repeat: int,
    history: bool,
    busy_aware: bool = False,
    fresh_sessions: int | None = None,
) -> list[Case]:
    """Every (baseline, later run) pair of same-config sessions of each collection. history=False: the baseline
    recorded once from one session (a new user's first record); True: refreshed over the sessions before it (up to
    KEEP_HISTORY, at least MIN_EARLIER), as the replay above. Only runs followed by CONFIRM_SESSIONS more sessions
    (a confirmation's fresh servers) are cases. `busy_aware`: baselines recorded from the quiet loads (Gate.entries),
    and a confirmation's fresh servers are the later sessions not wholly run beside a busy neighbour (the plugin waits
    for the runner to quiet down before measuring them). `fresh_sessions`: how many later sessions a case needs
    (CONFIRM_SESSIONS by default)."""
    from pytest_vllm_mem.baseline.noise import CONFIRM_SESSIONS

    needed = CONFIRM_SESSIONS if fresh_sessions is None else fresh_sessions

    out = []
    for same in sames:
        for i, base in enumerate(same):
            base_loads = _run(base, repeat)
            if base_loads is None:
                continue
            earlier = [(s, r) for s in same[max(0, i - KEEP_HISTORY) : i] if (r := _run(s, repeat)) is not None]
            if history and len(earlier) < MIN_EARLIER:
                continue
            recorded = [*(earlier if history else []), (base, base_loads)]
            entry = _entry([(s, _quiet(r)) for s, r in recorded] if busy_aware else recorded)
            for j in range(i + 1, len(same)):
                later = same[j]
                loads = [load for load in later["loads"] if load.get("completed")]
                if len(loads) < repeat:
                    continue
                runs = [(s, r) for s in same[j + 1 :] if (r := _run(s, repeat)) is not None]
                if busy_aware:
                    runs = [(s, r) for s, r in runs if not all(map(_busy, r))]
                fresh = runs[:needed]
                if len(fresh) < needed:
                    continue  # a confirmation here would have had fewer fresh servers than the plugin starts
                out.append(Case(entry, later, loads[:repeat], fresh, _pooled(sames, later, repeat)))
    return out


def verdict(
    case: Case,
    families: int,
    *,
    confirm: bool,
    change: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    alpha: float | None = None,
    pooled: bool = False,
    busy_aware: bool = False,
    fresh_sessions: int | None = None,
    provisional: bool = True,
) -> tuple[list[Any], int]:
    """(failing comparisons, fresh servers started) for one test of a suite of `families` tests, through the plugin's
    own pieces: the judge at the suite's share (Gate.plan), compare, gate_failures and the confirmation rule of
    Gate.evaluate (noise.confirm_on_fresh_sessions: a suspect family re-measured on up to CONFIRM_SESSIONS fresh
    servers, here the sessions that came after the run). `pooled`: the judge has the pooled spreads of the suite's
    other tests (Gate._pool_priors). `busy_aware`: judged on the quiet loads where there are any (TestRecord.quiet).
    `fresh_sessions`: the most fresh servers a confirmation starts (--vllm-confirm-sessions; CONFIRM_SESSIONS).
    `provisional`: NoiseJudge.provisional (False: a baseline without a window is judged as one with it)."""
    from pytest_vllm_mem.baseline.compare import compare, gate_failures
    from pytest_vllm_mem.baseline.metrics import resolve_tolerances
    from pytest_vllm_mem.baseline.noise import (
        CONFIRM_SESSIONS,
        DEFAULT_ALPHA,
        NoiseJudge,
        SuiteLevel,
        confirm_on_fresh_sessions,
    )

    level = SuiteLevel(DEFAULT_ALPHA if alpha is None else alpha, families=families)
    judge = NoiseJudge(alpha=level.per_comparison, priors=case.pooled if pooled else {}, provisional=provisional)
    tolerances = resolve_tolerances({}, {}, {})
    touch = change or (lambda load: load)
    loads = [{**touch(load), "session": 0} for load in case.now_loads]
    started: list[dict[str, Any]] = []  # the fresh servers so far: their startup figures are samples too

    def judged(sessions: int) -> list[Any]:
        kept = _quiet(loads) if busy_aware else loads
        count = len({load["session"] for load in kept})
        samples = _samples(case.now_session, kept, started)
        launched = case.now_session["launched"]
        return compare(case.entry, samples, tolerances, judge=judge, now_sessions=count, now_config=launched)

    def rerun(sessions: int) -> list[Any] | None:
        if sessions - 2 >= len(case.fresh):
            return None
        session, fresh_loads = case.fresh[sessions - 2]
        started.append(session)
        loads.extend({**touch(load), "session": sessions - 1} for load in fresh_loads)
        return judged(sessions)

    comparisons = judged(1)
    plain = [c for c in gate_failures(comparisons, False) if not c.confirmable]
    sessions = 1
    if confirm and not plain:
        most = CONFIRM_SESSIONS if fresh_sessions is None else fresh_sessions
        comparisons, sessions = confirm_on_fresh_sessions(comparisons, rerun, most)
    return gate_failures(comparisons, False), sessions - 1


def targets(collections: list[dict[str, Any]], seed: int = 25) -> dict[str, Any]:
    """Issue 25's three targets over the saved collections (each file its own runner history; cases never mix
    files): record-then-rerun with the defaults; healthy 20-test suites; a 30% throughput regression in one test of
    a 20-test suite, with confirmation on."""
    import random

    rng = random.Random(seed)
    out: dict[str, Any] = {}
    sames = [[s for s in data["sessions"] if s["name"].startswith(SAME)] for data in collections]
    for repeat, history in ((1, False), (1, True), (3, True)):
        key = f"repeat={repeat}, {'history' if history else 'baseline recorded once'}"
        row: dict[str, Any] = {}
        for tag, confirm, busy_aware in MODES:
            pool = cases(sames, repeat, history, busy_aware=busy_aware)
            row[f"{tag}: cases"] = len(pool)
            if not pool:
                continue
            one = [verdict(c, 1, confirm=confirm, busy_aware=busy_aware) for c in pool]
            row[f"one-test suite, {tag}: failed"] = sum(bool(f) for f, _ in one)
            row[f"one-test suite, {tag}: failed on throughput or latency"] = sum(
                any(c.metric in NOISY for c in f) for f, _ in one
            )
            row[f"one-test suite, {tag}: fresh servers started"] = sum(ran for _, ran in one)
            suite = [verdict(c, SUITE_TESTS, confirm=confirm, pooled=True, busy_aware=busy_aware) for c in pool]
            failed_tests = [bool(f) for f, _ in suite]
            p = sum(failed_tests) / len(failed_tests)
            runs = [any(rng.choice(failed_tests) for _ in range(SUITE_TESTS)) for _ in range(SUITE_RUNS)]
            row[f"{SUITE_TESTS}-test suite, {tag}: tests failed"] = sum(failed_tests)
            row[f"{SUITE_TESTS}-test suite, {tag}: tests failed on throughput or latency"] = sum(
                any(c.metric in NOISY for c in f) for f, _ in suite
            )
            row[f"{SUITE_TESTS}-test suite, {tag}: fresh servers started"] = sum(ran for _, ran in suite)
            row[f"{SUITE_TESTS}-test suite, {tag}: fresh servers per healthy run"] = (
                SUITE_TESTS * sum(ran for _, ran in suite) / len(suite)
            )
            row[f"{SUITE_TESTS}-test suite, {tag}: runs failed of {SUITE_RUNS} (resampled)"] = sum(runs)
            row[f"{SUITE_TESTS}-test suite, {tag}: P(run fails) = 1-(1-p)^{SUITE_TESTS}"] = 1 - (1 - p) ** SUITE_TESTS
            # What the suite-level gate catches: injected slowdowns of one test of a 20-test suite.
            for drop, more_work in ((0.20, True), (0.30, True), (0.30, False), (0.40, True), (0.50, True)):
                results = [
                    verdict(
                        case,
                        SUITE_TESTS,
                        confirm=confirm,
                        pooled=True,
                        busy_aware=busy_aware,
                        change=lambda load, d=drop, mw=more_work: slower(load, d, mw),  # type: ignore[misc]
                    )
                    for case in pool
                ]
                kind = "more work" if more_work else "more waiting"
                row[f"{SUITE_TESTS}-test suite, {tag}: -{drop:.0%} {kind} caught"] = sum(
                    any(c.metric in NOISY for c in f) for f, _ in results
                )
                row[f"{SUITE_TESTS}-test suite, {tag}: -{drop:.0%} {kind} fresh servers"] = sum(r for _, r in results)
        row["healthy runs of a one-test suite that fail at a suite alpha of 0.05, confirm"] = sum(
            bool(verdict(c, 1, confirm=True, alpha=0.05)[0]) for c in pool
        )
        if not history:
            # A baseline recorded once is provisional (NoiseJudge.provisional): the same runs judged as if it had a
            # window (the rule before it), and a new user's whole suite, where no test has history to pool.
            row["one-test suite, confirm, not provisional: failed"] = sum(
                bool(verdict(c, 1, confirm=True, provisional=False)[0]) for c in pool
            )
            fresh = [verdict(c, SUITE_TESTS, confirm=True) for c in pool]
            row[f"{SUITE_TESTS}-test suite, nothing pooled (a new user's), confirm: tests failed"] = sum(
                bool(f) for f, _ in fresh
            )
            slowed = [verdict(c, SUITE_TESTS, confirm=True, change=lambda load: slower(load, 0.30, True)) for c in pool]
            row[f"{SUITE_TESTS}-test suite, nothing pooled (a new user's), confirm: -30% more work caught"] = sum(
                any(c.metric in NOISY for c in f) for f, _ in slowed
            )
        out[key] = row
    return out


CONFIRM_COUNTS = (2, 3, 4)


def confirm_sweep(collections: list[dict[str, Any]], repeat: int = 3) -> dict[str, Any]:
    """The cost and the gain of more fresh servers per confirmation (--vllm-confirm-sessions), on the same cases
    (those with max(CONFIRM_COUNTS) later sessions, baselines with a history): per count, the healthy tests of a
    20-test suite that fail, the fresh servers a healthy 20-test run starts, and how often a 30% throughput drop
    (more work, or more waiting) in one test is caught, with the fresh servers that took."""
    sames = [[s for s in data["sessions"] if s["name"].startswith(SAME)] for data in collections]
    pool = cases(sames, repeat, history=True, fresh_sessions=max(CONFIRM_COUNTS))
    out: dict[str, Any] = {"cases": len(pool), "repeat": repeat}
    for count in CONFIRM_COUNTS:

        def judged(
            change: Callable[[dict[str, Any]], dict[str, Any]] | None, most: int = count
        ) -> list[tuple[list[Any], int]]:
            return [
                verdict(case, SUITE_TESTS, confirm=True, pooled=True, change=change, fresh_sessions=most)
                for case in pool
            ]

        healthy = judged(None)
        row = {
            "healthy tests failed": sum(bool(f) for f, _ in healthy),
            "fresh servers per healthy 20-test run": SUITE_TESTS * sum(r for _, r in healthy) / max(len(pool), 1),
        }
        for more_work in (True, False):
            slow = judged(lambda load, mw=more_work: slower(load, 0.30, mw))  # type: ignore[misc]
            kind = "more work" if more_work else "more waiting"
            row[f"-30% {kind} caught"] = sum(any(c.metric in NOISY for c in f) for f, _ in slow)
            row[f"-30% {kind} fresh servers"] = sum(r for _, r in slow)
        out[f"confirm sessions {count}"] = row
    return out


def print_targets(figures: dict[str, Any]) -> None:
    print("\nissue 25 targets (suite-level control, confirmation); cases = (baseline, later run) pairs")
    for key, row in figures.items():
        print(f"  {key}")
        for name, value in row.items():
            print(f"    {name}: {value:.3f}" if isinstance(value, float) else f"    {name}: {value}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--confirm-sweep":
        # python benchmarks/gate_noise.py --confirm-sweep benchmarks/data/gate_noise_ci_*.json
        print(json.dumps(confirm_sweep([json.loads(Path(name).read_text()) for name in sys.argv[2:]]), indent=1))
    elif len(sys.argv) > 1 and sys.argv[1] == "--targets":
        # python benchmarks/gate_noise.py --targets [--json OUT] benchmarks/data/gate_noise_ci_*.json
        names = sys.argv[2:]
        out_path = None
        if names[:1] == ["--json"]:
            out_path, names = Path(names[1]), names[2:]
        found = targets([json.loads(Path(name).read_text()) for name in names])
        print_targets(found)
        if out_path is not None:
            write_json(out_path, {"collections": names, "targets": found})
    else:
        main()
