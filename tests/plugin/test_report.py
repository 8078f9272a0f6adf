"""report.py and results.py: the summary table, markdown, results JSON and TestRecord's metrics."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes import GIB, FakeServer, load, make_record

from pytest_vllm_mem.baseline.results import TestRecord
from pytest_vllm_mem.baseline.store import BaselineEntry, BaselineStore, EnvKey
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.memory import DeviceInfo
from pytest_vllm_mem.plugin.gate import Gate, env_key
from pytest_vllm_mem.plugin.report import (
    COLUMNS,
    ReportWriter,
    RunFacts,
    baseline_cell,
    format_table,
    markdown_table,
    table_rows,
    upgrade_lines,
    upgrade_markdown,
)


def comparison(metric: str, status: str, change_pct: float | None) -> dict[str, Any]:
    return {
        "metric": metric,
        "status": status,
        "change_pct": change_pct,
        "baseline": 1.0,
        "now": 1.0,
        "tolerance": "10%",
        "message": f"{metric} moved",
    }


# ---------------------------------------------------------------------------------------------------------- results


def test_record_metrics_are_medians_over_completed_loads() -> None:
    record = make_record(
        "t::x",
        load(throughput=100.0),
        load(throughput=300.0),
        load(throughput=200.0),
        load(throughput=9999.0, completed=0),
    )
    metrics = record.metrics()
    assert metrics["output_throughput"] == 200.0
    assert metrics["startup_peak_memory"] == 4 * GIB
    assert metrics["load_peak_memory"] == 5 * GIB
    assert metrics["kv_cache_tokens"] == 123_456
    assert metrics["ttft_p99"] == 91.6 and metrics["ttft_p50"] == 40.0 and metrics["tpot_p50"] == 9.0
    assert record.metric_samples()["output_throughput"] == [100.0, 300.0, 200.0]


def test_record_peak_and_outcome() -> None:
    record = make_record("t::x", load(peak=3 * GIB), load(peak=7 * GIB))
    assert record.peak_memory_bytes == 7 * GIB
    assert record.outcome == "ok"
    assert make_record(startup={"ok": False}).outcome == "not started"
    assert make_record(failure={"kind": "oom_kv_cache", "summary": "s"}).outcome == "oom_kv_cache"
    assert make_record(startup={}, loads=[]).peak_memory_bytes == 0


def test_record_dict_round_trip() -> None:
    record = make_record(notes=["emulating"])
    data = json.loads(json.dumps(record.to_dict()))
    assert data["outcome"] == "ok" and data["peak_memory_bytes"] == 5 * GIB
    assert data["metrics"]["output_throughput"] == 1234.4
    again = TestRecord.from_dict(data)  # derived keys (outcome, metrics) are ignored
    assert again.to_dict() == record.to_dict()


# ---------------------------------------------------------------------------------------------------------- table


def test_table_row_cells() -> None:
    [(cells, color)] = table_rows(
        [make_record(baseline_status="compared", comparisons=[comparison("kv_cache_tokens", "ok", 0.0)])]
    )
    assert cells == ["test_chat[tiny]", "ok", "5.00 GiB / 24gb", "123,456", "1,234", "92 ms", "within tolerance"]
    assert len(cells) == len(COLUMNS)
    assert color == "green"


@pytest.mark.parametrize(
    ("status", "comparisons", "text", "color"),
    [
        ("none", [], "-", None),
        ("missing", [], "missing", None),
        ("updated", [], "updated", None),
        (
            "compared",
            [comparison("ttft_p99", "improved", -30.0), comparison("output_throughput", "regressed", -20.04)],
            "output_throughput -20.0%",
            "red",
        ),
        ("compared", [comparison("ttft_p99", "improved", -30.0)], "ttft_p99 -30.0% (update?)", "yellow"),
        ("compared", [comparison("ttft_p99", "regressed", None)], "ttft_p99 from 0", "red"),
        ("compared", [comparison("ttft_p99", "new", None)], "within tolerance", "green"),
        (
            "compared",
            [comparison("ttft_p99", "improved", -30.0), comparison("output_throughput", "warned", -36.5)],
            "output_throughput -36.5% (warned: provisional baseline)",
            "yellow",
        ),
    ],
)
def test_baseline_cell(status: str, comparisons: list[dict[str, Any]], text: str, color: str | None) -> None:
    assert baseline_cell(make_record(baseline_status=status, comparisons=comparisons)) == (text, color)


def test_failed_rows_are_red_and_show_dashes() -> None:
    record = make_record(failure={"kind": "oom_weights", "summary": "s"}, startup={"ok": False}, memory={}, loads=[])
    [(cells, color)] = table_rows([record])
    assert cells[1:6] == ["oom_weights", "-", "-", "-", "-"]
    assert color == "red"


def test_auto_tier_rows_show_no_tier() -> None:
    [(cells, _)] = table_rows([make_record(tier="auto (85.0gb)", tier_bytes=0)])
    assert cells[2] == "5.00 GiB"


def test_format_table_aligns_columns() -> None:
    rows = [cells for cells, _ in table_rows([make_record(), make_record("t.py::test_with_a_much_longer_name")])]
    lines = format_table(rows)
    assert len(lines) == 4
    assert lines[0].split()[:2] == ["test", "outcome"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    # Every column starts at the same offset on every line.
    offset = lines[0].index("outcome")
    assert all(line[offset:].startswith(("ok", "-", "outcome")) for line in lines)
    assert all(line == line.rstrip() for line in lines)


def test_format_table_without_rows() -> None:
    assert format_table([]) == ["  ".join(COLUMNS), "  ".join("-" * len(c) for c in COLUMNS)]


def test_markdown_table() -> None:
    piped = make_record("t.py::test_x[a|b]", plot="plots/x.png")
    text = markdown_table([make_record(), piped], "tier 24gb, cuda device NVIDIA L4")
    lines = text.splitlines()
    assert lines[0] == "### vLLM memory and serving (tier 24gb, cuda device NVIDIA L4)"
    assert lines[2] == "| " + " | ".join(COLUMNS) + " |"
    assert lines[3] == "|---|---|---|---|---|---|---|"
    assert lines[4].startswith("| test_chat[tiny] | ok | 5.00 GiB / 24gb |")
    assert lines[5].startswith("| [test_x[a\\|b]](plots/x.png) | ok |")
    assert all(line.count(" | ") == len(COLUMNS) - 1 for line in lines[4:])
    assert text.endswith("\n")


# ---------------------------------------------------------------------------------------------------------- writer


@dataclass
class FakeSettings:
    vllm_baseline: Path
    vllm_results: Path | None = None
    vllm_markdown: Path | None = None
    vllm_plots: Path | None = None
    vllm_update_baseline: bool = False
    vllm_require_baseline: bool = False
    vllm_strict: bool = False
    vllm_gate_alpha: float = 0.025
    vllm_confirm_sessions: int = 2


def fake_settings(writer: ReportWriter) -> FakeSettings:
    """The writer's settings, to change for one test (the writer reads them through a read-only Protocol)."""
    assert isinstance(writer.settings, FakeSettings)
    return writer.settings


L4 = DeviceInfo("cuda", "NVIDIA L4", 24_150_000_000, 0)
STARTED = RunFacts(L4, "24gb", "0.32.0")  # a session that started a server on an L4


class FakeTerminal:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, bool]]] = []

    def section(self, title: str, sep: str = "=") -> None:
        self.lines.append((f"== {title}", {}))

    def line(self, msg: str, **markup: bool) -> None:
        self.lines.append((msg, markup))


@pytest.fixture
def writer(tmp_path: Path) -> ReportWriter:
    settings = FakeSettings(
        tmp_path / "baselines.json",
        vllm_results=tmp_path / "out" / "results.json",
        vllm_markdown=tmp_path / "summary.md",
    )
    return ReportWriter(settings, Gate(settings), tmp_path, lambda: STARTED)


def test_results_document_is_json(writer: ReportWriter) -> None:
    # Two servers (one each); startups are counted from the records, which is all a pytest-xdist controller has.
    records = [
        make_record(server_pid=101),
        make_record(
            "t::y", baseline_status="compared", server_pid=102, comparisons=[comparison("ttft_p99", "ok", 1.0)]
        ),
    ]
    document = json.loads(json.dumps(writer.results_document(records)))
    assert document["schema"] == 1
    assert document["tier"] == "24gb" and document["device"] == "NVIDIA L4" and document["backend"] == "cuda"
    assert document["vllm_version"] == "0.32.0" and document["server_startups"] == 2
    assert [t["test_id"] for t in document["tests"]] == ["tests/test_a.py::test_chat[tiny]", "t::y"]
    assert document["tests"][0]["metrics"]["kv_cache_tokens"] == 123_456


def test_results_document_without_a_server(writer: ReportWriter) -> None:
    writer.facts = lambda: RunFacts(None, "24gb", None)
    document = writer.results_document([])
    assert document["tier"] == "24gb" and document["device"] is None and document["server_startups"] == 0
    assert writer.header() == "no server started"


def test_write_all_writes_results_markdown_and_step_summary(
    writer: ReportWriter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    writer.write_all([make_record()])
    assert writer.errors == []
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["tests"][0]["outcome"] == "ok"
    markdown = (tmp_path / "summary.md").read_text()
    assert "tier 24gb, cuda device NVIDIA L4" in markdown and "test_chat[tiny]" in markdown
    assert summary.read_text() == markdown
    assert writer.baseline_written is None
    assert not (tmp_path / "baselines.json").exists()


def test_write_all_updates_the_baseline(writer: ReportWriter, tmp_path: Path) -> None:
    fake_settings(writer).vllm_update_baseline = True
    updated = make_record(baseline_status="updated")
    failed = make_record("t::failed", baseline_status="updated", passed=False)
    writer.write_all([updated, failed])
    assert writer.baseline_written == 1 and not writer.failed
    entry = BaselineStore(tmp_path / "baselines.json").get(updated.test_id, env_key(updated))
    assert entry is not None and entry.metrics == updated.metrics()


def test_write_errors_are_collected_not_raised(writer: ReportWriter, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    fake_settings(writer).vllm_results = blocker / "results.json"  # a folder that cannot exist
    writer.write_all([make_record()])
    [error] = writer.errors
    assert error.startswith(f"--vllm-results {blocker / 'results.json'}: could not write the file")
    assert writer.failed  # the plugin turns this into a non-zero exit


def test_a_baseline_that_cannot_be_written_fails_the_run(writer: ReportWriter, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    fake_settings(writer).vllm_update_baseline = True
    writer.gate = Gate(FakeSettings(blocker / "baselines.json"))
    writer.write_all([make_record(baseline_status="updated")])
    assert writer.failed and writer.baseline_written is None
    [error] = writer.errors
    assert str(blocker / "baselines.json") in error and "could not be written" in error
    terminal = FakeTerminal()
    writer.terminal_summary(terminal, [make_record()])
    assert (
        "the run fails: a file it was asked to write was not written (see the errors above)",
        {"red": True},
    ) in terminal.lines


def test_a_missing_plot_library_is_a_warning_not_a_failure(
    writer: ReportWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    fake_settings(writer).vllm_plots = Path("plots")
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    writer.finish_record(make_record(), FakeServer(VLLMConfig("m")))
    assert writer.warnings == ["--vllm-plots needs matplotlib: pip install 'pytest-vllm-mem[plots]'"]
    assert not writer.failed


def test_terminal_summary(writer: ReportWriter) -> None:
    records = [
        make_record(baseline_status="missing"),
        make_record(
            "t::slow", baseline_status="compared", comparisons=[comparison("output_throughput", "regressed", -25.0)]
        ),
    ]
    writer.facts = lambda: dataclasses.replace(STARTED, leaked=(4242,))
    writer.errors.append("could not append")
    terminal = FakeTerminal()
    writer.terminal_summary(terminal, records)
    texts = [text for text, _ in terminal.lines]
    assert texts[0] == "== vLLM memory and serving"
    assert texts[1] == "tier 24gb, cuda device NVIDIA L4 (22.49 GiB), vLLM 0.32.0"
    assert texts[2].startswith("test") and set(texts[3].replace(" ", "")) == {"-"}
    assert "missing" in texts[4] and terminal.lines[4][1] == {}
    assert "output_throughput -25.0%" in texts[5] and terminal.lines[5][1] == {"red": True}
    assert any("1 test(s) have no baseline" in text for text in texts)
    assert any("pids [4242]" in text for text in texts)
    assert ("error: could not append", {"red": True}) in terminal.lines


def test_terminal_summary_is_silent_without_records(writer: ReportWriter) -> None:
    terminal = FakeTerminal()
    writer.terminal_summary(terminal, [])
    assert terminal.lines == []


# ---------------------------------------------------------------------------------------------------------- upgrade


def upgraded_record(writer: ReportWriter, tmp_path: Path, throughput: float = 1234.4) -> TestRecord:
    """A 0.32.0 record compared by the real gate with a baseline recorded on vLLM 0.27.1."""
    old = make_record(
        memory={"kv_cache_tokens": 100_000, "kv_cache_gib": 1.5, "weights_gib": 0.5, "max_concurrency": 48.8}
    )
    samples = {**old.metric_samples(), "output_throughput": [1500.0]}
    entry = BaselineEntry.from_samples(
        old.test_id,
        EnvKey("24gb", "NVIDIA L4", "0.27.1"),
        samples,
        config="c",
        commit="abc1234",
        host="ci-1",
        recorded_at="2026-11-30T05:00:00Z",
    )
    BaselineStore(writer.settings.vllm_baseline).update([entry])
    record = make_record(
        "tests/test_a.py::test_chat[tiny]",
        load(throughput=throughput),
        memory={"kv_cache_tokens": 123_456, "kv_cache_gib": 1.85, "weights_gib": 0.5, "max_concurrency": 60.3},
    )
    writer.gate.evaluate(record, {}, tier_is_auto=False)
    return record


def test_upgrade_report_shows_every_figure_old_vs_new(writer: ReportWriter, tmp_path: Path) -> None:
    record = upgraded_record(writer, tmp_path)
    lines = upgrade_lines([record, make_record("t::same_version")])
    text = "\n".join(lines)
    assert lines[0] == (
        "vLLM upgrade 0.27.1 -> 0.32.0: 1 test compared with the vLLM 0.27.1 baseline (no 0.32.0 entry yet)"
    )
    assert "test_chat[tiny]: baseline 24gb|NVIDIA L4|vllm 0.27.1, recorded 2026-11-30T05:00:00Z, commit abc1234" in text
    header = lines[2].split()
    assert header == ["figure", "vLLM", "0.27.1", "vLLM", "0.32.0", "change", "status"]
    rows = {line.split()[0]: line for line in lines[4:]}
    for figure in (
        "startup_peak_memory",
        "load_peak_memory",
        "kv_cache_tokens",
        "output_throughput",
        "request_throughput",
        "ttft_p50",
        "ttft_p99",
        "tpot_p50",
        "weights_memory",
        "kv_cache_memory",
        "max_concurrency",
        "startup_time",
    ):
        assert figure in rows, figure
    # The pool in GiB is gated; the token line vLLM derives from it is reported (issue 25, vllm#51041).
    assert rows["kv_cache_tokens"].split()[1:] == ["100,000", "tokens", "123,456", "tokens", "+23.5%", "reported"]
    assert "1.50 GiB" in rows["kv_cache_memory"] and "1.85 GiB" in rows["kv_cache_memory"]
    assert rows["kv_cache_memory"].endswith("improved (tolerance 5%)")
    assert "-17.7%" in rows["output_throughput"] and "regressed (tolerance 10%)" in rows["output_throughput"]


def test_upgrade_report_in_markdown_json_and_terminal(writer: ReportWriter, tmp_path: Path) -> None:
    record = upgraded_record(writer, tmp_path)
    markdown = upgrade_markdown([record])
    assert markdown.startswith("#### vLLM upgrade 0.27.1 -> 0.32.0")
    assert "| figure | vLLM 0.27.1 | vLLM 0.32.0 | change | status |" in markdown
    assert "| kv_cache_tokens | 100,000 tokens | 123,456 tokens | +23.5% | reported |" in markdown
    assert "| kv_cache_memory | 1.50 GiB | 1.85 GiB | +23.3% | improved (tolerance 5%) |" in markdown
    [upgrade] = writer.results_document([record])["upgrades"]
    assert upgrade["from"] == "0.27.1" and upgrade["to"] == "0.32.0" and upgrade["baseline"]["exact"] is False
    figures = {f["metric"]: f for f in upgrade["figures"]}
    assert figures["weights_memory"]["status"] == "info" and figures["weights_memory"]["baseline"] == 0.5 * GIB
    terminal = FakeTerminal()
    writer.terminal_summary(terminal, [record])
    texts = [text for text, _ in terminal.lines]
    assert any(text.startswith("vLLM upgrade 0.27.1 -> 0.32.0") for text in texts)
    assert "(vs vLLM 0.27.1)" in texts[4]  # the row's baseline cell names the version
    regressed = [markup for text, markup in terminal.lines if text.strip().startswith("output_throughput")]
    assert regressed == [{"red": True}]
    writer.write_all([record])
    assert "|\n\n#### vLLM upgrade 0.27.1 -> 0.32.0" in (tmp_path / "summary.md").read_text()


def test_no_upgrade_report_without_a_version_change(writer: ReportWriter, tmp_path: Path) -> None:
    record = make_record()
    writer.gate.evaluate(record, {}, tier_is_auto=False)
    assert upgrade_lines([record]) == [] and upgrade_markdown([record]) == ""
    assert writer.results_document([record])["upgrades"] == []


def test_an_unwritable_results_file_fails_the_pytest_run(pytester: pytest.Pytester) -> None:
    # The inner test passes and starts no server; only the results file cannot be written (a file blocks its folder).
    pytester.makepyfile(test_inner="def test_a():\n    pass\n")
    (pytester.path / "blocker").write_text("")
    target = pytester.path / "blocker" / "results.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--vllm-results={target}")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    output = result.stdout.str()
    assert f"error: --vllm-results {target}: could not write the file" in output
    assert "the run fails: a file it was asked to write was not written" in output
    ok = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--vllm-results={pytester.path / 'r.json'}")
    assert ok.ret == pytest.ExitCode.OK and json.loads((pytester.path / "r.json").read_text())["tests"] == []


def test_a_server_on_several_gpus_shows_its_fullest_gpu_and_each_gpu() -> None:
    # TP=2: 18 GiB in all, never more than 10 GiB on one card (a 24gb tier is per GPU).
    record = make_record(
        "tests/test_a.py::test_tp[2]",
        {**load(peak=18 * GIB), "peak_memory_per_gpu": [8 * GIB, 10 * GIB]},
        startup={
            "ok": True,
            "kind": "ok",
            "duration_s": 40.0,
            "peak_memory_bytes": 16 * GIB,
            "peak_memory_per_gpu": [9 * GIB, 7 * GIB],
        },
    )
    [(cells, _)] = table_rows([record])
    assert cells[2] == "10.00 GiB / 24gb (per GPU: 9.00 GiB, 10.00 GiB)"  # each GPU's own peak over startup and load
    assert "| 10.00 GiB / 24gb (per GPU: 9.00 GiB, 10.00 GiB) |" in markdown_table([record], "h")
    data = record.to_dict()
    assert data["peak_memory_bytes"] == 18 * GIB and data["largest_gpu_peak_bytes"] == 10 * GIB
    assert data["peak_memory_per_gpu"] == [9 * GIB, 10 * GIB]
    assert TestRecord.from_dict(data).to_dict() == data  # derived keys are not fields: read back without them


def test_one_gpu_or_the_cpu_shows_the_peak_alone() -> None:
    single = make_record(
        startup={
            "ok": True,
            "kind": "ok",
            "duration_s": 1.0,
            "peak_memory_bytes": 4 * GIB,
            "peak_memory_per_gpu": [4 * GIB],
        }
    )
    assert table_rows([single])[0][0][2] == "5.00 GiB / 24gb"
    cpu = make_record(tier="", tier_bytes=0, backend="cpu")
    assert table_rows([cpu])[0][0][2] == "5.00 GiB" and cpu.to_dict()["peak_memory_per_gpu"] == []
