"""The per-test gate: a peak above the tier, or a metric worse than its baseline beyond tolerance, fails the test."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

import pytest

from .baseline import (BaselineEntry, BaselineError, BaselineStore, EnvKey, Tolerance, ToleranceError, compare,
                       format_gate_failure, gate_failures, git_commit, parse_tolerance_mapping,
                       parse_tolerance_spec, resolve_tolerances)
from .advice import advise, render_steps
from .diagnose import Diagnosis
from .results import TestRecord, failure_dict
from .server import VLLMServer
from .settings import UsageError
from .units import format_bytes

if TYPE_CHECKING:
    from .state import SessionState


def tolerance_layers(config: pytest.Config) -> tuple[dict[str, Tolerance], dict[str, Tolerance]]:
    """(command line, ini) tolerances, kept apart so a marker beats the CLI and the CLI beats the ini."""
    try:
        cli = parse_tolerance_spec(config.getoption("vllm_tolerance") or "", source="--vllm-tolerance")
        ini = parse_tolerance_spec(config.getini("vllm_tolerance") or "", source="ini vllm_tolerance")
    except ToleranceError as error:
        raise UsageError(str(error)) from None
    return cli, ini


def marker_tolerances(item: pytest.Item) -> dict[str, Tolerance]:
    merged: dict[str, Tolerance] = {}
    for mark in reversed(list(item.iter_markers("vllm_tolerance"))):  # closest marker (function) wins
        try:
            merged.update(parse_tolerance_mapping(mark.kwargs, source=f"@pytest.mark.vllm_tolerance on {item.nodeid}"))
        except ToleranceError as error:
            raise UsageError(str(error)) from None
    return merged


def env_key(record: TestRecord) -> EnvKey:
    return EnvKey(record.tier, record.device, record.vllm_version or "unknown")


def tier_problem(record: TestRecord, tier_is_auto: bool) -> str | None:
    if tier_is_auto or not record.tier_bytes or record.peak_memory_bytes <= record.tier_bytes:
        return None
    over = record.peak_memory_bytes - record.tier_bytes
    return (f"peak memory {format_bytes(record.peak_memory_bytes)} exceeds the {record.tier} tier "
            f"({format_bytes(record.tier_bytes)}) by {format_bytes(over)}")


def evaluate_record(state: "SessionState", record: TestRecord, marker: dict[str, Tolerance]) -> str | None:
    """Compare `record` with the tier and the baseline; returns the failure text, or None when the test passes."""
    problems = []
    over_tier = tier_problem(record, state.tier.auto)
    if over_tier:
        server = record.timeline.get("server") if record.timeline else None
        steps = advise(None, server.launched, server.memory, tier_bytes=record.tier_bytes,
                       peak_bytes=record.peak_memory_bytes) if isinstance(server, VLLMServer) else []
        problems.append("\n".join([over_tier, *render_steps(steps)]))
        record.failure = failure_dict(Diagnosis("tier_exceeded", over_tier), steps, None)
    metrics = record.metrics()
    if not metrics:
        return "\n\n".join(problems) or None
    tolerances = resolve_tolerances(state.tolerances_cli, state.tolerances_ini, marker)
    settings = state.settings
    try:
        entry = BaselineStore(settings.vllm_baseline).get(record.test_id, env_key(record))
    except BaselineError as error:
        raise UsageError(str(error)) from None
    comparisons = compare(entry, metrics, tolerances)
    record.comparisons = [{**asdict(c), "tolerance": str(c.tolerance), "message": c.message()} for c in comparisons]
    if settings.vllm_update_baseline:
        record.baseline_status = "updated"
        return "\n\n".join(problems) or None
    record.baseline_status = "missing" if entry is None else "compared"
    if entry is None and settings.vllm_require_baseline:
        problems.append(f"no baseline for {record.test_id} on {env_key(record).as_str()} in {settings.vllm_baseline} "
                        "(--vllm-require-baseline): record one with --vllm-update-baseline")
    failures = gate_failures(comparisons, settings.vllm_strict)
    if failures:
        problems.append(format_gate_failure(record.test_id, failures, entry,
                                            hint="if this change is intended, rerun with --vllm-update-baseline"))
    return "\n\n".join(problems) or None


def baseline_entries(records: list[TestRecord], rootdir) -> list[BaselineEntry]:
    """Entries for the tests that ran, passed and measured something, for --vllm-update-baseline."""
    commit = git_commit(rootdir)
    entries = []
    for record in records:
        if record.baseline_status != "updated" or not record.passed or not record.metrics():
            continue
        samples = record.metric_samples()
        runs = max((len(v) for v in samples.values()), default=1)
        per_run = [{name: values[i] for name, values in samples.items() if i < len(values)} for i in range(runs)]
        static = {k: v for k, v in record.metrics().items() if k not in samples}  # startup figures: one per server
        per_run = [{**static, **run} for run in per_run] or [static]
        entries.append(BaselineEntry.from_runs(record.test_id, env_key(record), per_run, config=record.launched,
                                               commit=commit))
    return entries
