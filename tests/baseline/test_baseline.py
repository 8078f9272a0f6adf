from __future__ import annotations

import json
import multiprocessing
import multiprocessing.synchronize
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fakes import Measurement

from pytest_vllm_mem.baseline.compare import Comparison, compare, format_gate_failure, gate_failures
from pytest_vllm_mem.baseline.metrics import (
    GATED,
    METRICS,
    Tolerance,
    ToleranceError,
    parse_tolerance,
    parse_tolerance_mapping,
    parse_tolerance_spec,
    record_samples,
    resolve_tolerances,
)
from pytest_vllm_mem.baseline.store import (
    KEEP_VERSIONS,
    BaselineEntry,
    BaselineError,
    BaselineStore,
    EnvKey,
    median,
    spread_range,
)
from pytest_vllm_mem.launch.git import git_commit

ENV = EnvKey("24gb", "NVIDIA L4", "0.32.0")
MIB = 2**20
GIB = 2**30


def entry(
    test_id: str = "tests/test_x.py::test_a", metrics: dict[str, float] | None = None, **changes: Any
) -> BaselineEntry:
    made = BaselineEntry(
        test_id=test_id,
        metrics=metrics or {"output_throughput": 1000.0},
        env=ENV,
        spread={},
        runs=3,
        config="vllm serve m --max-model-len 2048",
        recorded_at="2026-11-30T05:00:00Z",
        commit="abc1234",
        host="ci-1",
    )
    return replace(made, **changes)


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
        (
            "throughput=15%",
            "Known metrics: kv_cache_memory, kv_cache_tokens, kv_cache_blocks, startup_peak_memory, load_peak_memory",
        ),
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
    assert set(resolved) == set(GATED)


def test_default_tolerances() -> None:
    relative = {name: m.default_tolerance.relative for name, m in METRICS.items() if m.default_tolerance}
    assert relative == {
        "startup_peak_memory": 0.05,
        "load_peak_memory": 0.05,
        "kv_cache_memory": 0.05,
        "output_throughput": 0.10,
        "request_throughput": 0.10,
        "ttft_p50": 0.20,
        "tpot_p50": 0.20,
        "cpu_per_token": 0.10,
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
    now: dict[str, list[float]] = {
        "output_throughput": [1200.0],
        "load_peak_memory": [11 * GIB],
        "ttft_p50": [110.0],
        "kv_cache_tokens": [5000],
    }
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
    comparisons = compare(entry(metrics={"ttft_p50": 100.0}), {"ttft_p50": [50.0]}, {})
    assert [c.status for c in comparisons] == ["improved"]
    assert gate_failures(comparisons, strict=False) == []
    assert gate_failures(comparisons, strict=True) == comparisons


def test_missing_baseline_is_new_and_never_fails() -> None:
    comparisons = compare(None, {"output_throughput": [1.0], "load_peak_memory": [1e12]}, {})
    assert {c.status for c in comparisons} == {"new"}
    assert gate_failures(comparisons, strict=True) == []
    assert comparisons[0].message() == "load_peak_memory: 931.32 GiB now, no baseline value yet"


def test_compare_skips_unknown_and_unmeasured_metrics_and_handles_zero_baseline() -> None:
    base = entry(metrics={"kv_cache_memory": 0, "ttft_p99": 10.0})
    comparisons = compare(base, {"kv_cache_memory": [10], "custom_metric": [3.0], "tpot_p50": [float("nan")]}, {})
    assert [(c.metric, c.status, c.change_pct) for c in comparisons] == [("kv_cache_memory", "improved", None)]
    assert "(from 0," in comparisons[0].message()


def test_comparison_message() -> None:
    c = Comparison(
        "output_throughput",
        1204.5,
        812.3,
        (812.3 - 1204.5) / 1204.5 * 100,
        Tolerance(relative=0.1, unit="tok/s"),
        "regressed",
    )
    assert c.message() == "output_throughput: 812.3 tok/s now vs 1,204.5 tok/s baseline (-32.6%, tolerance 10%)"
    mem = compare(
        entry(metrics={"load_peak_memory": 5 * GIB}),
        {"load_peak_memory": [5.5 * GIB]},
        {"load_peak_memory": Tolerance(absolute=256 * MIB, unit="bytes")},
    )[0]
    assert mem.message() == (
        "load_peak_memory: 5.50 GiB now vs 5.00 GiB baseline on vLLM 0.32.0 (+10.0%, tolerance 256 MiB)"
    )


def test_format_gate_failure_has_provenance() -> None:
    base = entry(metrics={"output_throughput": 1000.0}, spread={"output_throughput": [980.0, 1000.0, 1010.0]})
    failures = gate_failures(compare(base, {"output_throughput": [700.0]}, {}), strict=False)
    text = format_gate_failure("tests/test_x.py::test_a", failures, base, hint="rerun with --update to accept")
    assert text.splitlines()[0] == (
        "tests/test_x.py::test_a: 1 metric outside tolerance of the baseline for 24gb|NVIDIA L4|vllm 0.32.0"
    )
    assert (
        "regressed  output_throughput: 700.0 tok/s now vs 1,000.0 tok/s baseline on vLLM 0.32.0 (-30.0%, tolerance 10%)"
    ) in text
    assert "compared across" not in text  # same version: no upgrade line
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


def test_entry_from_samples_uses_medians_and_keeps_spread() -> None:
    samples = {
        "output_throughput": [900.0, 1100.0, 1000.0],
        "ttft_p50": [float("nan"), 40.0],
        "kv_cache_tokens": [5000.0],
        "tpot_p50": [float("inf")],
    }
    made = BaselineEntry.from_samples("t", ENV, samples, config="c", commit=None, host="h")
    assert made.metrics == {"kv_cache_tokens": 5000.0, "output_throughput": 1000.0, "ttft_p50": 40.0}
    assert made.spread == {
        "kv_cache_tokens": [5000.0],
        "output_throughput": [900.0, 1100.0, 1000.0],
        "ttft_p50": [40.0],
    }
    assert made.runs == 3 and made.recorded_at.endswith("Z")
    assert median([3, 1, 2, 10]) == 2.5 and spread_range([3.0, 1.0, 2.0]) == (1.0, 3.0)
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError, match="no measured values"):
        BaselineEntry.from_samples("t", ENV, {"ttft_p50": [float("nan")]}, config="c")


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
        (
            '{"schema": 1,\n  "baselines": {,}}',
            "not valid JSON: Expecting property name enclosed in double quotes at line 2",
        ),
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
    BaselineStore(a).update([])  # nothing new: the same bytes, and the file is left alone
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


def _write_many(
    path: str, prefix: str, count: int, barrier: multiprocessing.synchronize.Barrier
) -> None:  # runs in a spawned process
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


def test_update_into_an_unwritable_place_is_a_baseline_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = BaselineStore(blocker / "baselines.json")  # its folder cannot exist: a file is in the way
    with pytest.raises(BaselineError) as info:
        store.update([entry()])
    message = str(info.value)
    assert str(blocker / "baselines.json") in message and "could not be written" in message
    assert "--vllm-baseline" in message and "\n" not in message


# ---------------------------------------------------------------------------------------------------- catalogue


def test_server_figures_are_read_from_the_record_and_from_each_fresh_server_of_a_confirmation() -> None:
    def server(peak_gib: float, cache: str | None) -> dict[str, Any]:
        startup = {"ok": True, "duration_s": 30.0, "peak_memory_bytes": peak_gib * GIB}
        return {"startup": startup, "memory": {"compile_cache": cache, "kv_cache_gib": 1.0}}

    first = server(2.5, "cold")
    record = Measurement(first["startup"], first["memory"], restarts=[server(2.2, "warm"), server(2.21, "warm")])
    samples = record_samples(record)
    assert samples["startup_peak_memory"] == [round(2.5 * GIB), round(2.2 * GIB), round(2.21 * GIB)]
    assert samples["kv_cache_memory"] == [GIB, GIB, GIB]
    # Startup time stays apart by the compile cache's state, fresh servers included.
    assert samples["startup_time_cold"] == [30.0] and samples["startup_time_warm"] == [30.0, 30.0]


def test_every_metric_reads_itself_from_a_record() -> None:
    load = {
        "completed": 8,
        "peak_memory_bytes": 3 * GIB,
        "output_throughput": 100.0,
        "request_throughput": 2.0,
        "ttft_ms": {"p50": 40.0, "p99": 90.0},
        "tpot_ms": {"p50": 9.0},
    }
    record = Measurement(
        startup={"ok": True, "duration_s": 31.5, "peak_memory_bytes": 2 * GIB},
        memory={
            "weights_gib": 0.5,
            "kv_cache_gib": 1.25,
            "kv_cache_tokens": 108_160,
            "max_concurrency": 52.81,
            "graph_capture_gib": 0.0,
            "requested_gib": 1.05,
            "device_total_gib": 10.46,
        },
        loads=[load, {**load, "output_throughput": 300.0}, {**load, "completed": 0, "output_throughput": 9e9}],
    )
    samples = record_samples(record)
    assert samples["output_throughput"] == [100.0, 300.0]  # one per completed load; the failed load is left out
    assert samples["ttft_p99"] == [90.0, 90.0] and samples["tpot_p50"] == [9.0, 9.0]
    assert samples["startup_peak_memory"] == [2 * GIB]  # one per server
    assert samples["weights_memory"] == [0.5 * GIB] and samples["kv_cache_memory"] == [1.25 * GIB]
    assert samples["device_memory"] == [round(10.46 * GIB)]  # whole bytes
    assert samples["startup_time"] == [31.5]
    assert "graph_memory" not in samples  # 0.0: vLLM captured no graphs, nothing to compare
    assert list(samples) == [name for name in METRICS if name in samples]  # catalogue order
    assert all(METRICS[name].gated == (METRICS[name].default_tolerance is not None) for name in METRICS)


def test_a_report_only_figure_takes_no_tolerance() -> None:
    with pytest.raises(ToleranceError) as info:
        parse_tolerance_spec("weights_memory=5%", source="--vllm-tolerance")
    message = str(info.value)
    assert (
        "report-only figure" in message
        and "Gated metrics: kv_cache_memory, kv_cache_tokens, kv_cache_blocks, startup_peak_memory" in message
    )
    with pytest.raises(ToleranceError, match="report-only"):
        parse_tolerance_mapping({"max_concurrency": "5%"})


# ------------------------------------------------------------------------------------------------ schema, retention


def test_a_future_schema_is_one_paragraph_naming_file_and_schemas(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    path.write_text('{"schema": 7, "baselines": {"t": {"x": "a layout this version cannot know"}}}')
    with pytest.raises(BaselineError) as info:
        BaselineStore(path).load()
    message = str(info.value)
    assert str(path) in message and "schema 7" in message and "reads schema 1" in message
    assert "newer pytest-vllm-mem" in message and "\n" not in message


def test_a_file_written_before_the_upgrade_report_keeps_loading(tmp_path: Path) -> None:
    # The layout of the plugin's first release: the eight gated metrics only.
    old = {
        "metrics": {"output_throughput": 1000.0, "kv_cache_tokens": 5000.0},
        "runs": 1,
        "config": "c",
        "recorded_at": "2026-11-30T05:00:00Z",
        "commit": None,
        "host": "h",
        "spread": {"output_throughput": [1000.0], "kv_cache_tokens": [5000.0]},
    }
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps({"schema": 1, "baselines": {"t": {ENV.as_str(): old}}}))
    loaded = BaselineStore(path).get("t", ENV)
    assert loaded is not None and loaded.metrics["kv_cache_tokens"] == 5000.0
    by_name = {c.metric: c for c in compare(loaded, {"kv_cache_tokens": [5000.0], "weights_memory": [GIB]}, {})}
    assert by_name["kv_cache_tokens"].status == "info" and by_name["weights_memory"].status == "new"


def _env(version: str, tier: str = "24gb") -> EnvKey:
    return EnvKey(tier, "NVIDIA L4", version)


def test_update_keeps_the_newest_versions_per_test_tier_and_device(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    store = BaselineStore(path)
    versions = ["0.9.2", "0.10.2", "0.11.0", "0.27.1"]
    assert KEEP_VERSIONS == 3
    for version in versions:
        store.update([entry(env=_env(version)), entry("other", env=_env(version))])
    store.update([entry(env=_env("0.9.2", tier="80gb"))])  # another tier: its own versions
    loaded = BaselineStore(path).load()
    kept = sorted(env for (test_id, env) in loaded if test_id == "tests/test_x.py::test_a")
    assert kept == sorted(
        [_env("0.10.2").as_str(), _env("0.11.0").as_str(), _env("0.27.1").as_str(), _env("0.9.2", tier="80gb").as_str()]
    )
    assert ("other", _env("0.9.2").as_str()) not in loaded and ("other", _env("0.10.2").as_str()) in loaded
    # Writing an older version (a branch still on it) keeps it, and drops the oldest of the others.
    store.update([entry(env=_env("0.8.5"))])
    assert store.dropped == [("tests/test_x.py::test_a", _env("0.10.2").as_str())]
    now_kept = {env for (test_id, env) in BaselineStore(path).load() if test_id == "tests/test_x.py::test_a"}
    assert _env("0.8.5").as_str() in now_kept and _env("0.10.2").as_str() not in now_kept and len(now_kept) == 4


def test_versions_that_do_not_parse_are_dropped_first(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    store = BaselineStore(path, keep_versions=2)
    for version in ("unknown", "0.27.1", "0.32.0"):
        store.update([entry(env=_env(version))])
    assert store.dropped == [("tests/test_x.py::test_a", _env("unknown").as_str())]


# ---- history of earlier sessions ------------------------------------------------------------------------------


def test_refreshing_an_entry_keeps_the_earlier_sessions_medians(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    store = BaselineStore(path, history_metrics={"output_throughput"})
    for value in (1000.0, 1100.0, 900.0):
        store.update([entry(metrics={"output_throughput": value, "kv_cache_tokens": 5000.0})])
    got = BaselineStore(path).load()[("tests/test_x.py::test_a", ENV.as_str())]
    assert got.metrics["output_throughput"] == 900.0
    # Oldest first, the entry's own median not among them; memory-like figures not kept (history_metrics).
    assert got.history == {"output_throughput": [1000.0, 1100.0]}
    text = path.read_text()
    assert '"history": {\n          "output_throughput": [\n            1000.0,\n            1100.0\n' in text


def test_history_is_bounded_and_restarts_when_the_config_changes(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    store = BaselineStore(path, keep_history=3)
    for value in range(1, 7):
        store.update([entry(metrics={"output_throughput": float(value)})])
    key = ("tests/test_x.py::test_a", ENV.as_str())
    assert BaselineStore(path).load()[key].history == {"output_throughput": [3.0, 4.0, 5.0]}
    store.update([entry(metrics={"output_throughput": 7.0}, config="vllm serve m --max-num-seqs 4")])
    assert BaselineStore(path).load()[key].history == {}
    # Another environment's entry does not inherit either.
    other = EnvKey("24gb", "NVIDIA L4", "0.33.0")
    store.update([entry(metrics={"output_throughput": 8.0}, env=other)])
    assert BaselineStore(path).load()[("tests/test_x.py::test_a", other.as_str())].history == {}


def test_an_entry_without_history_writes_no_history_key(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    BaselineStore(path).update([entry()])
    assert "history" not in json.loads(path.read_text())["baselines"]["tests/test_x.py::test_a"][ENV.as_str()]


def test_a_malformed_history_is_one_paragraph_naming_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    BaselineStore(path).update([entry()])
    document = json.loads(path.read_text())
    document["baselines"]["tests/test_x.py::test_a"][ENV.as_str()]["history"] = {"output_throughput": [1.0, "fast"]}
    path.write_text(json.dumps(document))
    before = path.read_bytes()
    with pytest.raises(BaselineError) as info:
        BaselineStore(path).load()
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "'history' must map metric names" in message
    assert "tests/test_x.py::test_a" in message
    with pytest.raises(BaselineError):
        BaselineStore(path).update([entry()])
    assert path.read_bytes() == before


@dataclass
class GateOptions:
    """The settings a Gate reads (plugin.gate.GateSettings)."""

    vllm_baseline: Path
    vllm_update_baseline: bool = True
    vllm_require_baseline: bool = False
    vllm_strict: bool = False
    vllm_gate_alpha: float = 0.025
    vllm_confirm_sessions: int = 2


def test_the_gates_store_keeps_history_for_throughput_and_latency_only(tmp_path: Path) -> None:
    from pytest_vllm_mem.plugin.gate import Gate

    settings = GateOptions(tmp_path / "baselines.json")
    gate = Gate(settings)
    for value in (1000.0, 900.0):
        samples = {"output_throughput": [value, value + 10], "ttft_p50": [40.0], "startup_peak_memory": [2e9]}
        gate.store.update([BaselineEntry.from_samples("t", ENV, samples, config="c")])
    got = BaselineStore(settings.vllm_baseline).load()[("t", ENV.as_str())]
    assert got.history == {"output_throughput": [1005.0], "ttft_p50": [40.0]}


# ---- the series of sessions with their commits (issue 25) -----------------------------------------------------------


def test_refreshes_keep_a_bounded_series_of_sessions_with_their_commits(tmp_path: Path) -> None:
    from pytest_vllm_mem.baseline.store import KEEP_SESSIONS

    path = tmp_path / "baselines.json"
    store = BaselineStore(path, history_metrics={"output_throughput"})
    for i in range(KEEP_SESSIONS + 5):
        store.update([entry(metrics={"output_throughput": 1000.0 + i, "kv_cache_memory": 5.0}, commit=f"c{i}")])
    loaded = BaselineStore(path).get("tests/test_x.py::test_a", ENV)
    assert loaded is not None and len(loaded.sessions) == KEEP_SESSIONS  # bounded: the newest earlier sessions
    last = loaded.sessions[-1]
    assert last["commit"] == f"c{KEEP_SESSIONS + 3}" and last["medians"] == {"output_throughput": 1000.0 + 33}
    values, commits = loaded.series("output_throughput")
    assert values[-2:] == [1033.0, 1034.0] and commits[-1] == f"c{KEEP_SESSIONS + 4}"
    assert len(values) == KEEP_SESSIONS + 1  # the kept sessions and the entry's own
    # Another config measured something else: no series carried, as for the history.
    store.update([entry(metrics={"output_throughput": 1.0}, config="vllm serve other")])
    moved = BaselineStore(path).get("tests/test_x.py::test_a", ENV)
    assert moved is not None and moved.sessions == [] and "sessions" not in moved.to_dict()


def test_a_file_without_sessions_loads_and_a_broken_series_is_named(tmp_path: Path) -> None:
    path = tmp_path / "baselines.json"
    data = entry().to_dict()
    assert "sessions" not in data  # an entry without a series keeps the older files' bytes
    path.write_text(json.dumps({"schema": 1, "baselines": {"t": {ENV.as_str(): data}}}))
    assert BaselineStore(path).get("t", ENV) is not None
    path.write_text(json.dumps({"schema": 1, "baselines": {"t": {ENV.as_str(): {**data, "sessions": [{"x": 1}]}}}}))
    with pytest.raises(BaselineError, match="'sessions' must be a list of"):
        BaselineStore(path).load()
