"""Reports: the terminal summary table, the upgrade report, the results JSON, the markdown summary, and baseline
updates at session end. A results, markdown or baseline file that cannot be written fails the run (`failed`)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, cast

from pytest_vllm_mem.baseline.compare import JUDGED
from pytest_vllm_mem.baseline.results import TestRecord
from pytest_vllm_mem.baseline.store import BaselineError
from pytest_vllm_mem.baseline.summary import dumps_results, results_summary
from pytest_vllm_mem.launch.launcher import RunningServer
from pytest_vllm_mem.launch.server import VLLMServer
from pytest_vllm_mem.memory import DeviceInfo
from pytest_vllm_mem.plan.preflight import kv_cell
from pytest_vllm_mem.plugin.gate import Gate
from pytest_vllm_mem.units import format_bytes, format_quantity


class Terminal(Protocol):
    """What the summary writes to (pytest's TerminalReporter)."""

    def section(self, title: str, sep: str = ...) -> None: ...

    def line(self, msg: str, **markup: bool) -> None: ...


COLUMNS = ("test", "outcome", "peak / tier", "KV tokens", "out tok/s", "TTFT p99", "vs baseline")
UPGRADE_COLUMNS = ("figure", "baseline", "now", "change", "status")


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
    warned = [c for c in record.comparisons if c["status"] == "warned"]
    across = f" (vs vLLM {record.upgraded_from})" if record.upgraded_from else ""
    if regressed:
        c = regressed[0]
        return f"{c['metric']} {_change(c)}{across}", "red"
    if warned:
        c = warned[0]
        return f"{c['metric']} {_change(c)} (warned: provisional baseline){across}", "yellow"
    if improved:
        c = improved[0]
        return f"{c['metric']} {_change(c)} (update?){across}", "yellow"
    return f"within tolerance{across}", "green"


def _change(comparison: dict[str, Any]) -> str:
    # Change_pct is None against a baseline of 0 (a hand-edited file); formatting it crashed the summary.
    pct = comparison.get("change_pct")
    detail = comparison.get("detail") or ""
    if detail[:1] in ("+", "-") and pct is not None:
        return detail.split(";")[0]  # the noise judge's statistics: "-18.0% +- 6.1%, 3 runs vs 3"
    return f"{pct:+.1f}%" if pct is not None else "from 0"


def peak_cell(record: TestRecord) -> str:
    """`5.00 GiB / 24gb`; a server on several GPUs shows its fullest GPU's peak, which a tier (one GPU's memory)
    limits, then every GPU's: `21.30 GiB / 24gb (per GPU: 20.10 GiB, 21.30 GiB)`."""
    tier = f" / {record.tier}" if record.tier_bytes else ""
    per_gpu = record.peak_memory_per_gpu
    if len(record.nodes) > 1:  # a multi-node server: the fullest node (or GPU) is what is held to the tier
        nodes = ", ".join(format_bytes(node["peak_memory_bytes"]) for node in record.nodes)
        return f"{format_bytes(record.largest_gpu_peak_bytes)}{tier} (per node: {nodes})"
    if len(per_gpu) > 1:
        return f"{format_bytes(record.largest_gpu_peak_bytes)}{tier} (per GPU: {', '.join(map(format_bytes, per_gpu))})"
    return f"{format_bytes(record.peak_memory_bytes)}{tier}" if record.peak_memory_bytes else "-"


def placement_lines(records: list[TestRecord]) -> list[str]:
    """Where each server on a cluster ran: per test, each rank's node and its peak there."""
    lines = []
    for record in records:
        ranks = [
            f"rank {node['rank']} on {node['hostname']} ({node['address']}, node {node['node_id'][:12]}), peak "
            f"{format_bytes(node['peak_memory_bytes'])}"
            for node in record.nodes
        ]
        if ranks:
            lines.append(f"  {_short_test_id(record.test_id)}: {'; '.join(ranks)}")
    return ["servers on the cluster:", *lines] if lines else []


def table_rows(records: list[TestRecord]) -> list[tuple[list[str], str | None]]:
    rows = []
    for record in records:
        ttft = _load_value(record, "ttft_p99")
        throughput = _load_value(record, "output_throughput")
        kv = record.memory.get("kv_cache_tokens")
        cell, color = baseline_cell(record)
        rows.append(
            (
                [
                    _short_test_id(record.test_id),
                    record.outcome,
                    peak_cell(record),
                    kv_cell(kv, record.plan),
                    f"{throughput:,.0f}" if throughput else "-",
                    f"{ttft:,.0f} ms" if ttft else "-",
                    cell,
                ],
                color if record.outcome == "ok" else "red",
            )
        )
    return rows


def format_table(rows: list[list[str]], columns: Sequence[str] = COLUMNS) -> list[str]:
    # Max(x, *()) is max(x), a TypeError, so a table without rows crashed; max([...]) takes one or more.
    widths = [max([len(columns[i]), *(len(row[i]) for row in rows)]) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(cells)).rstrip()

    return [line(columns), line(["-" * w for w in widths])] + [line(row) for row in rows]


def upgrade_rows(record: TestRecord) -> list[list[str]]:
    """Every figure of a test compared across vLLM versions: baseline, now, change, and what the gate made of it."""
    rows = []
    for c in record.comparisons:
        unit = c.get("unit", "")
        base = "-" if c["baseline"] is None else format_quantity(c["baseline"], unit)
        if c.get("recorded") is not None:
            base += "*"  # re-planned for this run's device memory (see the note)
        status = c["status"]
        if c.get("tolerance") and status in JUDGED:
            status = f"{status} (tolerance {c['tolerance']})"
        elif status == "info":
            status = "reported"
        rows.append(
            [c["metric"], base, format_quantity(c["now"], unit), "-" if c["baseline"] is None else _change(c), status]
        )
    return rows


def upgrade_groups(records: list[TestRecord]) -> dict[tuple[str, str], list[TestRecord]]:
    """The records compared with another vLLM version's baseline, by (baseline version, running version)."""
    groups: dict[tuple[str, str], list[TestRecord]] = {}
    for record in records:
        if record.upgraded_from and record.comparisons:
            groups.setdefault((record.upgraded_from, record.vllm_version or "unknown"), []).append(record)
    return groups


def _upgrade_title(old: str, new: str, count: int) -> str:
    tests = f"{count} test" + ("" if count == 1 else "s")
    return f"vLLM upgrade {old} -> {new}: {tests} compared with the vLLM {old} baseline (no {new} entry yet)"


def _upgrade_header(old: str, new: str) -> list[str]:
    """The upgrade table's columns (terminal and markdown), the two versions named."""
    return [UPGRADE_COLUMNS[0], f"vLLM {old}", f"vLLM {new}", *UPGRADE_COLUMNS[3:]]


def _upgrade_notes(records: list[TestRecord]) -> list[str]:
    notes = dict.fromkeys(c["note"] for record in records for c in record.comparisons if c.get("note"))
    return [f"* {note}" for note in notes]


def upgrade_lines(records: list[TestRecord]) -> list[str]:
    """The upgrade report for the terminal: per test, every figure old vs new with its change."""
    lines = []
    for (old, new), group in upgrade_groups(records).items():
        lines.append(_upgrade_title(old, new, len(group)))
        for record in group:
            baseline = record.baseline or {}
            lines.append(
                f"{_short_test_id(record.test_id)}: baseline {baseline.get('env')}, recorded "
                f"{baseline.get('recorded_at')}, commit {baseline.get('commit') or 'unknown'}"
            )
            lines.extend("  " + line for line in format_table(upgrade_rows(record), _upgrade_header(old, new)))
        lines.extend(_upgrade_notes(group))
    return lines


def upgrade_markdown(records: list[TestRecord]) -> str:
    parts = []
    for (old, new), group in upgrade_groups(records).items():
        parts.append(f"#### {_upgrade_title(old, new, len(group))}\n")
        for record in group:
            baseline = record.baseline or {}
            parts.append(
                f"**{_short_test_id(record.test_id)}** (baseline recorded {baseline.get('recorded_at')}, "
                f"commit {baseline.get('commit') or 'unknown'})\n"
            )
            parts.append(_markdown_rows(_upgrade_header(old, new), upgrade_rows(record)))
        notes = _upgrade_notes(group)
        if notes:
            parts.append("\n".join(notes) + "\n")
    return "\n".join(parts)


def upgrade_document(records: list[TestRecord]) -> list[dict[str, Any]]:
    """The upgrade report in the results JSON: per test, the versions and every figure's comparison."""
    return [
        {
            "test_id": record.test_id,
            "from": old,
            "to": new,
            "baseline": record.baseline,
            "figures": [
                {
                    k: c.get(k)
                    for k in (
                        "metric",
                        "unit",
                        "baseline",
                        "now",
                        "change_pct",
                        "status",
                        "tolerance",
                        "recorded",
                        "note",
                    )
                }
                for c in record.comparisons
            ],
        }
        for (old, new), group in upgrade_groups(records).items()
        for record in group
    ]


def _markdown_rows(header: Sequence[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def _link(path: str, relative_to: Path | None) -> str:
    """Plot links relative to the markdown file, so they still work when CI uploads the folder."""
    if relative_to is None:
        return path
    return os.path.relpath(path, relative_to)


def markdown_table(records: list[TestRecord], header: str, relative_to: Path | None = None) -> str:
    lines = [
        f"### vLLM memory and serving ({header})",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for (cells, _), record in zip(table_rows(records), records):
        if record.plot:
            cells[0] = f"[{cells[0]}]({_link(record.plot, relative_to)})"
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RunFacts:
    """What the session knows of where it ran, read when a report is written."""

    device: DeviceInfo | None  # None: no server was prepared in this process (e.g. a pytest-xdist controller)
    tier: str  # the tier's name; without a device, the --vllm-gpu text
    vllm_version: str | None
    leaked: tuple[int, ...] = ()  # pids of servers still running at session end (stopped then)


class ReportSettings(Protocol):
    """The settings the report writer reads (Settings has them)."""

    @property
    def vllm_baseline(self) -> Path: ...
    @property
    def vllm_update_baseline(self) -> bool: ...
    @property
    def vllm_results(self) -> Path | None: ...
    @property
    def vllm_markdown(self) -> Path | None: ...
    @property
    def vllm_plots(self) -> Path | None: ...


class ReportWriter:
    """Writes the session's reports. Handed what it needs (pytest-benchmark's style): the settings, the gate, the
    rootdir, and `facts`, read at write time, for the device, tier, vLLM version and leaked servers."""

    def __init__(self, settings: ReportSettings, gate: Gate, rootpath: Path, facts: Callable[[], RunFacts]) -> None:
        self.settings = settings
        self.gate = gate
        self.rootpath = rootpath
        self.facts = facts
        self.baseline_written: int | None = None
        self.errors: list[str] = []  # files the run was asked for and did not get: they fail the run
        self.warnings: list[str] = []  # extras that went wrong (plots, the CI step summary): shown, not fatal
        self.written: dict[str, Path] = {}  # option -> file actually written, for the summary

    @property
    def failed(self) -> bool:
        """True when a results, markdown or baseline file could not be written: CI must not lose figures quietly."""
        return bool(self.errors)

    def header(self, records: list[TestRecord] | None = None) -> str:
        facts = self.facts()
        device = facts.device
        if device is None:
            if not records:
                return "no server started"
            # The pytest-xdist controller started no server: its workers' records say where they ran.
            first = records[0]
            return f"tier {first.tier}, {first.backend} device {first.device}, vLLM {first.vllm_version}"
        return (
            f"tier {facts.tier}, {device.backend} device {device.name} "
            f"({format_bytes(device.total_bytes)}), vLLM {facts.vllm_version or 'unknown'}"
        )

    def finish_record(self, record: TestRecord, server: RunningServer | None) -> None:
        """Per-test work at teardown (plots of the timeline of the test's server). A cluster server's samples stay
        on its node: no plot, said once."""
        if not self.settings.vllm_plots or server is None:
            return
        if record.nodes:  # placed on a cluster
            message = "--vllm-plots: servers on a cluster are not plotted (their samples stay on their nodes)"
            if message not in self.warnings:
                self.warnings.append(message)
        else:
            from pytest_vllm_mem.plugin.plots import plot_record

            try:
                local = cast(VLLMServer, server)  # a server not on a cluster runs here, with its sampler
                record.plot = str(plot_record(record, local, self.settings.vllm_plots))
            except ImportError:
                message = "--vllm-plots needs matplotlib: pip install 'pytest-vllm-mem[plots]'"
                if message not in self.warnings:
                    self.warnings.append(message)
            except (ValueError, OSError) as error:
                self.warnings.append(f"--vllm-plots {self.settings.vllm_plots}: no plot for {record.test_id}: {error}")

    def write_all(self, records: list[TestRecord]) -> None:
        settings = self.settings
        if settings.vllm_update_baseline:
            try:
                self.baseline_written = self.gate.update(records, self.rootpath)
            except BaselineError as error:
                self.errors.append(str(error))
        if settings.vllm_results:
            self._write(settings.vllm_results, dumps_results(self.results_document(records)), "--vllm-results")
        markdown_dir = settings.vllm_markdown.parent if settings.vllm_markdown else None
        upgrade = upgrade_markdown(records)
        markdown = markdown_table(records, self.header(records), markdown_dir) if records else ""
        markdown += f"\n{upgrade}" if upgrade else ""  # a blank line ends the table before the next heading
        if settings.vllm_markdown and records:
            self._write(settings.vllm_markdown, markdown, "--vllm-markdown")
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary and records:
            try:
                with open(summary, "a") as handle:
                    handle.write(markdown)
            except OSError as error:
                self.warnings.append(f"could not append to GITHUB_STEP_SUMMARY={summary}: {error}")

    def environment(self, records: list[TestRecord]) -> dict[str, Any]:
        """Tier, device and vLLM of this run: from the session, or (pytest-xdist controller) from its records."""
        facts = self.facts()
        device = facts.device
        if device is not None:
            return {
                "tier": facts.tier,
                "device": device.name,
                "backend": device.backend,
                "vllm_version": facts.vllm_version,
            }
        first = records[0] if records else None
        return {
            "tier": first.tier if first else facts.tier,
            "device": first.device if first else None,
            "backend": first.backend if first else None,
            "vllm_version": first.vllm_version if first else None,
        }

    def results_document(self, records: list[TestRecord]) -> dict[str, Any]:
        return {
            "schema": 1,
            "created_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(),
            "header": self.header(records),
            **self.environment(records),
            "server_startups": len({(r.server_pid, r.startup.get("duration_s")) for r in records if r.server_pid}),
            "leaked_server_pids": list(self.facts().leaked),
            "upgrades": upgrade_document(records),
            "tests": (tests := [record.to_dict() for record in records]),
            "summary": results_summary(tests),  # recomputed from the tests' raw samples (cli/merge.py does too)
        }

    def _write(self, path: Path, text: str, option: str) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, path)
            self.written[option] = path
        except OSError as error:
            if tmp.parent.is_dir():
                tmp.unlink(missing_ok=True)
            self.errors.append(
                f"{option} {path}: could not write the file ({error.strerror or error}); "
                "pass a path in a writable folder"
            )

    def terminal_summary(self, terminal: Terminal, records: list[TestRecord]) -> None:
        leaked = list(self.facts().leaked)
        if not records and not leaked and not self.errors and not self.warnings:
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
            for line in placement_lines(records):
                terminal.line(line)
            missing = [r for r in records if r.baseline_status == "missing"]
            if missing:
                terminal.line(
                    f"{len(missing)} test(s) have no baseline in {self.settings.vllm_baseline}: "
                    "record with --vllm-update-baseline"
                )
            from pytest_vllm_mem.plugin.gate import suite_lines

            for line in suite_lines(self.gate, records):
                terminal.line(line)
            for line in upgrade_lines(records):
                terminal.line(line, **({"red": True} if " regressed " in f" {line} " else {}))
        if self.baseline_written is not None:
            versions = sorted({r.vllm_version or "unknown" for r in records if r.baseline_status == "updated"})
            dropped = self.gate.store.dropped
            pruned = (
                (
                    f"; dropped {len(dropped)} entries of older vLLM versions (the file keeps "
                    f"{self.gate.store.keep_versions} per test, tier and device)"
                )
                if dropped
                else ""
            )
            terminal.line(
                f"baseline: wrote {self.baseline_written} entries (vLLM {', '.join(versions) or '-'}) to "
                f"{self.settings.vllm_baseline}{pruned}"
            )
        for step in self.gate.steps:
            terminal.line(f"baseline history: {step}", yellow=True)
        for option, path in self.written.items():
            terminal.line(f"{option.replace('--vllm-', '')}: {path}")
        if leaked:
            terminal.line(f"stopped {len(leaked)} vLLM server(s) still running at session end: pids {leaked}", red=True)
        for warning in self.warnings:
            terminal.line(f"warning: {warning}", yellow=True)
        for error in self.errors:
            terminal.line(f"error: {error}", red=True)
        if self.errors:
            terminal.line(
                "the run fails: a file it was asked to write was not written (see the errors above)", red=True
            )
