from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from pytest_vllm_mem.baseline import (
    METRICS,
    BaselineEntry,
    BaselineError,
    BaselineStore,
    Comparison,
    EnvKey,
    Tolerance,
    ToleranceError,
    compare,
    format_gate_failure,
    gate_failures,
    git_commit,
    median,
    parse_tolerance,
    parse_tolerance_mapping,
    parse_tolerance_spec,
    resolve_tolerances,
    spread_range,
)

ENV = EnvKey("24gb", "NVIDIA L4", "0.32.0")
MIB = 2**20
GIB = 2**30


def entry(test_id: str = "tests/test_x.py::test_a", metrics: dict[str, float] | None = None, **kw) -> BaselineEntry:
    defaults = dict(
        spread={}, runs=3, config="vllm serve m --max-model-len 2048", recorded_at="2026-11-30T05:00:00Z",
        commit="abc1234", host="ci-1",
    )
    defaults.update(kw)
    return BaselineEntry(test_id=test_id, env=ENV, metrics=metrics or {"output_throughput": 1000.0}, **defaults)


# ---------------------------------------------------------------------------------------------- tolerance parsing


@pytest.mark.parametrize(
    "metric, text, expected",
    [
        ("output_throughput", "15%", Tolerance(relative=0.15, unit="tok/s")),
        ("output_throughput", " 2.5 % ", Tolerance(relative=0.025, unit="tok/s")),
        ("load_peak_memory", "256MiB", Tolerance(absolute=256 * MIB, unit="bytes")),
        ("load_peak_memory", "1GiB", Tolerance(absolute=GIB, unit="bytes")),
        ("load_peak_memory", "2GB", Tolerance(absolute=2e9, unit="bytes")),
        ("load_peak_memory", "512mb", Tolerance(absolute=512e6, unit="bytes")),
        ("load_peak_memory", "1048576", Tolerance(absolute=MIB, unit="bytes")),
        ("ttft_p50", "50ms", Tolerance(absolute=50.0, unit="ms")),
        ("ttft_p50", "1.5s", Tolerance(absolute=1500.0, unit="ms")),
        ("ttft_p50", "0.15", Tolerance(absolute=0.15, unit="ms")),
        ("kv_cache_tokens", "100", Tolerance(absolute=100.0, unit="tokens")),
        ("kv_cache_tokens", "100 tokens", Tolerance(absolute=100.0, unit="tokens")),
        ("output_throughput", "50", Tolerance(absolute=50.0, unit="tok/s")),
        ("output_throughput", "50tok/s", Tolerance(absolute=50.0, unit="tok/s")),
        ("request_throughput", "0.5", Tolerance(absolute=0.5, unit="req/s")),
        ("ttft_p99", "0%", Tolerance(relative=0.0, unit="ms")),
    ],
)
def test_parse_tolerance_forms(metric: str, text: str, expected: Tolerance) -> None:
    assert parse_tolerance(text, METRICS[metric]) == expected


@pytest.mark.parametrize(
    "metric, text, fragment",
    [
        ("output_throughput", "", "is not understood"),
        ("output_throughput", "fast", "is not understood"),
        ("output_throughput", "-5%", "is not understood"),
        ("output_throughput", "5ms%", "is not understood"),
        ("output_throughput", "256MiB", "does not fit tok/s"),
        ("ttft_p50", "256MiB", "does not fit ms"),
        ("load_peak_memory", "50ms", "does not fit bytes"),
        ("load_peak_memory", "8g", "does not fit bytes"),
        ("load_peak_memory", "0.15", "fraction"),
        ("kv_cache_tokens", "0.15", "fraction"),
    ],
)
def test_parse_tolerance_errors_name_input_and_forms(metric: str, text: str, fragment: str) -> None:
    with pytest.raises(ToleranceError) as info:
        parse_tolerance(text, METRICS[metric])
    message = str(info.value)
    assert repr(text) in message and metric in message and fragment in message
    assert "'10%'" in message and "\n" not in message


def test_tolerance_str() -> None:
    assert str(Tolerance(relative=0.05)) == "5%"
    assert str(parse_tolerance("256MiB", METRICS["load_peak_memory"])) == "256 MiB"
    assert str(parse_tolerance("50ms", METRICS["ttft_p50"])) == "50 ms"
    assert str(parse_tolerance("1000", METRICS["kv_cache_tokens"])) == "1,000 tokens"
    assert str(Tolerance(relative=0.1, absolute=GIB, unit="bytes")) == "10% or 1 GiB"


def test_tolerance_needs_a_part_and_refuses_negatives() -> None:
    with pytest.raises(ToleranceError):
        Tolerance()
    with pytest.raises(ToleranceError):
        Tolerance(relative=-0.1)


def test_parse_tolerance_spec() -> None:
    spec = parse_tolerance_spec(" output_throughput=15%, load_peak_memory=256MiB ,")
    assert spec == {
        "output_throughput": Tolerance(relative=0.15, unit="tok/s"),
        "load_peak_memory": Tolerance(absolute=256 * MIB, unit="bytes"),
    }
    assert parse_tolerance_spec("") == {}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("throughput=15%", "Known metrics: startup_peak_memory, load_peak_memory"),
        ("output_throughput", "is not METRIC=TOLERANCE"),
        ("output_throughput=", "is not METRIC=TOLERANCE"),
        ("output_throughput=5%,output_throughput=6%", "given twice"),
        ("ttft_p50=lots", "Tolerance 'lots' for ttft_p50"),
    ],
)
def test_parse_tolerance_spec_errors(text: str, fragment: str) -> None:
    with pytest.raises(ToleranceError) as info:
        parse_tolerance_spec(text, source="--vllm-tolerance")
    assert fragment in str(info.value)
    assert str(info.value).startswith(f"In --vllm-tolerance {text!r}: ")


def test_parse_tolerance_mapping_for_markers() -> None:
    own = Tolerance(relative=0.3)
    assert parse_tolerance_mapping({"ttft_p99": "30%", "tpot_p50": own}) == {
        "ttft_p99": Tolerance(relative=0.3, unit="ms"),
        "tpot_p50": own,
    }
    with pytest.raises(ToleranceError, match="pass a string"):
        parse_tolerance_mapping({"output_throughput": 0.15})  # type: ignore[dict-item]
    with pytest.raises(ToleranceError, match="Known metrics"):
        parse_tolerance_mapping({"nope": "5%"})


def test_precedence_marker_over_cli_over_ini_over_default() -> None:
    ini = parse_tolerance_spec("output_throughput=11%,ttft_p50=21%,tpot_p50=31%")
    cli = parse_tolerance_spec("output_throughput=12%,ttft_p50=22%")
    marker = parse_tolerance_spec("output_throughput=13%")
    resolved = resolve_tolerances(cli=cli, ini=ini, marker=marker)
    assert resolved["output_throughput"].relative == pytest.approx(0.13)
    assert resolved["ttft_p50"].relative == pytest.approx(0.22)
    assert resolved["tpot_p50"].relative == pytest.approx(0.31)
    assert resolved["load_peak_memory"] == METRICS["load_peak_memory"].default_tolerance
    assert set(resolved) == set(METRICS)


def test_default_tolerances() -> None:
    relative = {name: m.default_tolerance.relative for name, m in METRICS.items()}
    assert relative == {
        "startup_peak_memory": 0.05, "load_peak_memory": 0.05, "kv_cache_tokens": 0.05,
        "output_throughput": 0.10, "request_throughput": 0.10,
        "ttft_p50": 0.20, "ttft_p99": 0.20, "tpot_p50": 0.20,
    }


# ------------------------------------------------------------------------------------------ direction and gating


def test_direction_memory_up_is_worse_throughput_down_is_worse() -> None:
    five = Tolerance(relative=0.05)
    assert five.allows(100, 105, higher_is_better=False)  # exactly at the edge passes
    assert not five.allows(100, 106, higher_is_better=False)
    assert five.allows(100, 50, higher_is_better=False)  # less memory is never a regression
    assert five.allows(1000, 950, higher_is_better=True)
    assert not five.allows(1000, 940, higher_is_better=True)
    assert five.allows(1000, 5000, higher_is_better=True)


def test_relative_vs_absolute() -> None:
    relative = Tolerance(relative=0.05)
    absolute = Tolerance(absolute=256 * MIB, unit="bytes")
    baseline = 10 * GIB  # 5% of 10 GiB = 512 MiB
    assert relative.allows(baseline, baseline + 400 * MIB, False)
    assert not absolute.allows(baseline, baseline + 400 * MIB, False)
    assert absolute.allows(baseline, baseline + 256 * MIB, False)
    both = Tolerance(relative=0.01, absolute=256 * MIB)  # the looser applies: 256 MiB > 1% of 10 GiB
    assert both.allows(baseline, baseline + 200 * MIB, False)


def test_compare_statuses_and_strict_gate() -> None:
    base = entry(metrics={"output_throughput": 1000.0, "load_peak_memory": 10 * GIB, "ttft_p50": 100.0})
    now = {"output_throughput": 1200.0, "load_peak_memory": 11 * GIB, "ttft_p50": 110.0, "kv_cache_tokens": 5000}
    by_name = {c.metric: c for c in compare(base, now, resolve_tolerances({}, {}, {}))}
    assert by_name["output_throughput"].status == "improved"
    assert by_name["output_throughput"].change_pct == pytest.approx(20.0)
    assert by_name["load_peak_memory"].status == "regressed"
    assert by_name["ttft_p50"].status == "ok"
    assert by_name["kv_cache_tokens"].status == "new" and by_name["kv_cache_tokens"].baseline is None
    comparisons = list(by_name.values())
    assert [c.metric for c in gate_failures(comparisons, strict=False)] == ["load_peak_memory"]
    assert {c.metric for c in gate_failures(comparisons, strict=True)} == {"load_peak_memory", "output_throughput"}


def test_improvement_beyond_tolerance_fails_only_in_strict() -> None:
    comparisons = compare(entry(metrics={"ttft_p50": 100.0}), {"ttft_p50": 50.0}, {})
    assert [c.status for c in comparisons] == ["improved"]
    assert gate_failures(comparisons, strict=False) == []
    assert gate_failures(comparisons, strict=True) == comparisons


def test_missing_baseline_is_new_and_never_fails() -> None:
    comparisons = compare(None, {"output_throughput": 1.0, "load_peak_memory": 1e12}, {})
    assert {c.status for c in comparisons} == {"new"}
    assert gate_failures(comparisons, strict=True) == []
    assert comparisons[0].message() == "load_peak_memory: 931.32 GiB now, no baseline value yet"


def test_compare_skips_unknown_and_unmeasured_metrics_and_handles_zero_baseline() -> None:
    base = entry(metrics={"kv_cache_tokens": 0, "ttft_p99": 10.0})
    comparisons = compare(base, {"kv_cache_tokens": 10, "custom_metric": 3.0, "tpot_p50": float("nan")}, {})
    assert [(c.metric, c.status, c.change_pct) for c in comparisons] == [("kv_cache_tokens", "improved", None)]
    assert "(from 0," in comparisons[0].message()


def test_comparison_message() -> None:
    c = Comparison("output_throughput", 1204.5, 812.3, (812.3 - 1204.5) / 1204.5 * 100,
                   Tolerance(relative=0.1, unit="tok/s"), "regressed")
    assert c.message() == "output_throughput: 812.3 tok/s now vs 1,204.5 tok/s baseline (-32.6%, tolerance 10%)"
    mem = compare(entry(metrics={"load_peak_memory": 5 * GIB}), {"load_peak_memory": 5.5 * GIB},
                  {"load_peak_memory": Tolerance(absolute=256 * MIB, unit="bytes")})[0]
    assert mem.message() == "load_peak_memory: 5.50 GiB now vs 5.00 GiB baseline (+10.0%, tolerance 256 MiB)"


def test_format_gate_failure_has_provenance() -> None:
    base = entry(metrics={"output_throughput": 1000.0}, spread={"output_throughput": [980.0, 1000.0, 1010.0]})
    failures = gate_failures(compare(base, {"output_throughput": 700.0}, {}), strict=False)
    text = format_gate_failure("tests/test_x.py::test_a", failures, base, hint="rerun with --update to accept")
    assert text.splitlines()[0] == (
        "tests/test_x.py::test_a: 1 metric outside tolerance of the baseline for 24gb|NVIDIA L4|vllm 0.32.0"
    )
    assert "regressed  output_throughput: 700.0 tok/s now vs 1,000.0 tok/s baseline (-30.0%, tolerance 10%)" in text
    assert "baseline runs ranged 980.0 tok/s .. 1,010.0 tok/s" in text
    assert "baseline recorded 2026-11-30T05:00:00Z on host ci-1, commit abc1234, 3 runs, vLLM 0.32.0" in text
    assert "baseline config: vllm serve m --max-model-len 2048" in text
    assert text.endswith("rerun with --update to accept")


# ------------------------------------------------------------------------------------------------------- entries


def test_env_key_round_trip_and_separator() -> None:
    assert ENV.as_str() == "24gb|NVIDIA L4|vllm 0.32.0"
    assert EnvKey.from_str(ENV.as_str()) == ENV
    odd = EnvKey("cpu", "Weird | CPU  name", "0.32.0")
    assert odd.device == "Weird / CPU name"
    assert EnvKey.from_str(odd.as_str()) == odd


def test_entry_from_runs_uses_medians_and_keeps_spread() -> None:
    runs = [{"output_throughput": 900.0, "ttft_p50": float("nan")}, {"output_throughput": 1100.0},
            {"output_throughput": 1000.0, "ttft_p50": 40.0}]
    made = BaselineEntry.from_runs("t", ENV, runs, config="c", commit=None, host="h")
    assert made.metrics == {"output_throughput": 1000.0, "ttft_p50": 40.0}
    assert made.spread == {"output_throughput": [900.0, 1100.0, 1000.0], "ttft_p50": [40.0]}
    assert made.runs == 3 and made.recorded_at.endswith("Z")
    assert median([3, 1, 2, 10]) == 2.5 and spread_range([3.0, 1.0, 2.0]) == (1.0, 3.0)
    with pytest.raises(ValueError):
        median([])


# --------------------------------------------------------------------------------------------------------- store


def test_missing_file_is_empty(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "nope" / "baselines.json")
    assert store.load() == {}
    assert store.get("t", ENV) is None


def test_round_trip_and_layout(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "baselines.json"
    original = entry(spread={"output_throughput": [990.0, 1000.0]})
    BaselineStore(path).update([original])
    document = json.loads(path.read_text())
    assert document == {"schema": 1, "baselines": {original.test_id: {ENV.as_str(): original.to_dict()}}}
    assert path.read_text().endswith("}\n")
    assert BaselineStore(path).get(original.test_id, ENV) == original


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"schema": 1,\n  "baselines": {,}}', "not valid JSON: Expecting property name enclosed in double quotes at line 2"),
        ("<<<<<<< HEAD\n{}", "not valid JSON"),
        ("[1, 2]", "top level is a list"),
        ('{"schema": 2, "baselines": {}}', "written by a newer pytest-vllm-mem"),
        ('{"baselines": {}}', "'schema' is None"),
        ('{"schema": 1, "baselines": []}', "'baselines' is list"),
        ('{"schema": 1, "baselines": {"t": 3}}', "baselines['t'] is not an object"),
        ('{"schema": 1, "baselines": {"t": {"no-env": {}}}}', "is not 'TIER|DEVICE|vllm VERSION'"),
        ('{"schema": 1, "baselines": {"t": {"a|b|vllm 1": {"metrics": {"x": "1"}}}}}', "'metrics' must map"),
        ('{"schema": 1, "baselines": {"t": {"a|b|vllm 1": {"metrics": {}, "runs": 0}}}}', "'runs' must be"),
    ],
)
def test_corrupt_or_wrong_schema_raises_and_leaves_file_alone(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "my-baselines.json"
    path.write_bytes(content.encode())
    with pytest.raises(BaselineError) as info:
        BaselineStore(path).load()
    assert str(path) in str(info.value) and fragment in str(info.value)
    with pytest.raises(BaselineError):
        BaselineStore(path).update([entry()])
    assert path.read_bytes() == content.encode()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_update_touches_only_given_entries(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    store = BaselineStore(path)
    store.update([entry("t1", {"output_throughput": 1.0}), entry("t2", {"output_throughput": 2.0})])
    other_env = EnvKey("48gb", "NVIDIA L40S", "0.32.0")
    store.update([BaselineEntry("t1", other_env, {"output_throughput": 9.0}, runs=1, config="c", host="h")])
    # a foreign key inside an untouched entry survives a rewrite of its neighbours
    document = json.loads(path.read_text())
    document["baselines"]["t2"][ENV.as_str()]["note"] = "kept"
    path.write_text(json.dumps(document))
    store.update([entry("t1", {"output_throughput": 5.0})])
    loaded = BaselineStore(path).load()
    assert loaded[("t1", ENV.as_str())].metrics == {"output_throughput": 5.0}
    assert loaded[("t1", other_env.as_str())].metrics == {"output_throughput": 9.0}
    assert loaded[("t2", ENV.as_str())].metrics == {"output_throughput": 2.0}
    assert json.loads(path.read_text())["baselines"]["t2"][ENV.as_str()]["note"] == "kept"


def test_formatting_is_stable(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    entries = [entry("t2", {"ttft_p50": 12.5, "output_throughput": 1000.0}), entry("t1")]
    BaselineStore(a).update(entries)
    first = a.read_bytes()
    mtime = a.stat().st_mtime_ns
    BaselineStore(a).update(entries)
    assert a.read_bytes() == first and a.stat().st_mtime_ns == mtime
    BaselineStore(b).update(list(reversed(entries)))
    assert b.read_bytes() == first
    assert first.decode().startswith('{\n  "baselines": {\n    "t1": {')


def test_update_refuses_non_finite_numbers(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    with pytest.raises(BaselineError, match="non-finite"):
        BaselineStore(path).update([entry(metrics={"output_throughput": float("nan")})])
    assert not path.exists()


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_update_keeps_file_mode(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text('{"schema": 1, "baselines": {}}')
    path.chmod(0o640)
    BaselineStore(path).update([entry()])
    assert path.stat().st_mode & 0o777 == 0o640


def _write_many(path: str, prefix: str, count: int, barrier) -> None:  # runs in a spawned process
    store = BaselineStore(path)
    barrier.wait()
    for i in range(count):
        store.update([entry(f"{prefix}{i}", {"output_throughput": float(i)})])


def test_two_processes_updating_concurrently_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "baselines.json")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    workers = [context.Process(target=_write_many, args=(path, prefix, 50, barrier)) for prefix in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    loaded = BaselineStore(path).load()
    assert len(loaded) == 100
    assert loaded[("a49", ENV.as_str())].metrics == {"output_throughput": 49.0}
    assert loaded[("b0", ENV.as_str())].metrics == {"output_throughput": 0.0}


def test_git_commit(tmp_path: Path) -> None:
    assert git_commit(tmp_path) is None  # not a repository: quietly None
    assert git_commit(tmp_path / "missing") is None
