"""Reports: the terminal summary table, the results JSON, the markdown summary, and baseline updates at session end."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from .baseline import BaselineError, BaselineStore
from .gate import baseline_entries
from .results import TestRecord
from .units import format_bytes

if TYPE_CHECKING:
    from .state import SessionState

COLUMNS = ("test", "outcome", "peak / tier", "KV tokens", "out tok/s", "TTFT p99", "vs baseline")


def _short_test_id(test_id: str) -> str:
    return test_id.rsplit("::", 1)[-1]


def _load_value(record: TestRecord, key: str) -> float | None:
    return record.metrics().get(key)


def baseline_cell(record: TestRecord) -> tuple[str, str | None]:
    """The 'vs baseline' text and its color: worst regression, else biggest move, else the status."""
    if record.baseline_status in ("none", "updated", "missing"):
        return {"none": "-", "updated": "updated", "missing": "missing"}[record.baseline_status], None
    regressed = [c for c in record.comparisons if c["status"] == "regressed"]
    improved = [c for c in record.comparisons if c["status"] == "improved"]
    if regressed:
        c = regressed[0]
        return f"{c['metric']} {_change(c)}", "red"
    if improved:
        c = improved[0]
        return f"{c['metric']} {_change(c)} (update?)", "yellow"
    return "within tolerance", "green"


def _change(comparison: dict[str, Any]) -> str:
    # Change_pct is None against a baseline of 0 (a hand-edited file); formatting it crashed the summary.
    pct = comparison.get("change_pct")
    return f"{pct:+.1f}%" if pct is not None else "from 0"


def table_rows(records: list[TestRecord]) -> list[tuple[list[str], str | None]]:
    rows = []
    for record in records:
        tier = f" / {record.tier}" if record.tier_bytes else ""
        ttft = _load_value(record, "ttft_p99")
        throughput = _load_value(record, "output_throughput")
        kv = record.memory.get("kv_cache_tokens")
        cell, color = baseline_cell(record)
        rows.append(([
            _short_test_id(record.test_id),
            record.outcome,
            f"{format_bytes(record.peak_memory_bytes)}{tier}" if record.peak_memory_bytes else "-",
            f"{kv:,}" if kv else "-",
            f"{throughput:,.0f}" if throughput else "-",
            f"{ttft:,.0f} ms" if ttft else "-",
            cell,
        ], color if record.outcome == "ok" else "red"))
    return rows


def format_table(rows: list[list[str]]) -> list[str]:
    # Max(x, *()) is max(x), a TypeError, so a table without rows crashed; max([...]) takes one or more.
    widths = [max([len(COLUMNS[i]), *(len(row[i]) for row in rows)]) for i in range(len(COLUMNS))]
    line = lambda cells: "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(cells)).rstrip()  # noqa: E731
    return [line(COLUMNS), line(["-" * w for w in widths])] + [line(row) for row in rows]


def _link(path: str, relative_to: Path | None) -> str:
    """Plot links relative to the markdown file, so they still work when CI uploads the folder."""
    if relative_to is None:
        return path
    return os.path.relpath(path, relative_to)


def markdown_table(records: list[TestRecord], header: str, relative_to: Path | None = None) -> str:
    lines = [f"### vLLM memory and serving ({header})", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for (cells, _), record in zip(table_rows(records), records):
        if record.plot:
            cells[0] = f"[{cells[0]}]({_link(record.plot, relative_to)})"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


class ReportWriter:
    def __init__(self, state: "SessionState", config: pytest.Config) -> None:
        self.state = state
        self.config = config
        self.baseline_written: int | None = None
        self.errors: list[str] = []
        self.written: dict[str, Path] = {}  # option -> file actually written, for the summary

    def header(self, records: list[TestRecord] | None = None) -> str:
        state = self.state
        if state._device is None:
            if not records:
                return "no server started"
            # The pytest-xdist controller started no server: its workers' records say where they ran.
            first = records[0]
            return f"tier {first.tier}, {first.backend} device {first.device}, vLLM {first.vllm_version}"
        device = state.device
        return (f"tier {state.tier.name}, {device.backend} device {device.name} "
                f"({format_bytes(device.total_bytes)}), vLLM {state.parser_table.version}")

    def finish_record(self, record: TestRecord) -> None:
        """Per-test work at teardown (plots of the server timeline)."""
        if self.state.settings.vllm_plots and record.timeline:
            from .plots import plot_record

            try:
                record.plot = str(plot_record(record, self.state.settings.vllm_plots))
            except ImportError:
                message = "--vllm-plots needs matplotlib: pip install 'pytest-vllm-mem[plots]'"
                if message not in self.errors:
                    self.errors.append(message)
            except (ValueError, OSError) as error:
                self.errors.append(f"--vllm-plots {self.state.settings.vllm_plots}: no plot for {record.test_id}: "
                                   f"{error}")

    def write_all(self, records: list[TestRecord]) -> None:
        settings = self.state.settings
        if settings.vllm_update_baseline:
            entries = baseline_entries(records, self.config.rootpath)
            try:
                BaselineStore(settings.vllm_baseline).update(entries)
                self.baseline_written = len(entries)
            except BaselineError as error:
                self.errors.append(str(error))
        if settings.vllm_results:
            self._write(settings.vllm_results, json.dumps(self.results_document(records), indent=2) + "\n",
                        "--vllm-results")
        markdown_dir = settings.vllm_markdown.parent if settings.vllm_markdown else None
        markdown = markdown_table(records, self.header(records), markdown_dir) if records else ""
        if settings.vllm_markdown and records:
            self._write(settings.vllm_markdown, markdown, "--vllm-markdown")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and records:
            try:
                with open(summary, "a") as handle:
                    handle.write(markdown)
            except OSError as error:
                self.errors.append(f"could not append to GITHUB_STEP_SUMMARY={summary}: {error}")

    def environment(self, records: list[TestRecord]) -> dict[str, Any]:
        """Tier, device and vLLM of this run: from the session, or (pytest-xdist controller) from its records."""
        state = self.state
        if state._device is not None:
            return {"tier": state.tier.name, "device": state.device.name, "backend": state.device.backend,
                    "vllm_version": state.parser_table.version if state._parser else None}
        first = records[0] if records else None
        return {"tier": first.tier if first else state.tier_text, "device": first.device if first else None,
                "backend": first.backend if first else None, "vllm_version": first.vllm_version if first else None}

    def results_document(self, records: list[TestRecord]) -> dict[str, Any]:
        state = self.state
        return {
            "schema": 1,
            "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(),
            "header": self.header(records),
            **self.environment(records),
            "server_startups": len({(r.server_pid, r.startup.get("duration_s")) for r in records if r.server_pid}),
            "leaked_server_pids": getattr(state, "leaked", []),
            "tests": [record.to_dict() for record in records],
        }

    def _write(self, path: Path, text: str, option: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
            self.written[option] = path
        except OSError as error:
            self.errors.append(f"{option} {path}: could not write the file ({error.strerror or error}); "
                               "pass a path in a writable folder")

    def terminal_summary(self, terminal, records: list[TestRecord]) -> None:
        leaked = getattr(self.state, "leaked", [])
        if not records and not leaked and not self.errors:
            return
        terminal.section("vLLM memory and serving", sep="=")
        terminal.line(self.header(records))
        if records:
            rows = table_rows(records)
            lines = format_table([cells for cells, _ in rows])
            for line in lines[:2]:
                terminal.line(line)
            for line, (_, color) in zip(lines[2:], rows):
                terminal.line(line, **({color: True} if color else {}))
            missing = [r for r in records if r.baseline_status == "missing"]
            if missing:
                terminal.line(f"{len(missing)} test(s) have no baseline in {self.state.settings.vllm_baseline}: "
                              "record with --vllm-update-baseline")
        if self.baseline_written is not None:
            terminal.line(f"baseline: wrote {self.baseline_written} entries to {self.state.settings.vllm_baseline}")
        for option, path in self.written.items():
            terminal.line(f"{option.replace('--vllm-', '')}: {path}")
        if leaked:
            terminal.line(f"stopped {len(leaked)} vLLM server(s) still running at session end: pids {leaked}",
                          red=True)
        for error in self.errors:
            terminal.line(f"error: {error}", red=True)
