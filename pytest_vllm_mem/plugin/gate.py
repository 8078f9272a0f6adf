"""The per-test gate: a peak above the tier, or a metric worse than its baseline beyond tolerance, fails the test.

One Gate per session (made in pytest_configure): it holds the session's one BaselineStore, so the baseline file is
read once and every test compares against the same content.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest

from pytest_vllm_mem.baseline.compare import (
    Judge,
    compare,
    format_gate_failure,
    gate_failures,
    select_baseline,
    tolerance_judge,
)
from pytest_vllm_mem.baseline.metrics import (
    METRICS,
    Tolerance,
    ToleranceError,
    parse_tolerance_mapping,
    parse_tolerance_spec,
    resolve_tolerances,
)
from pytest_vllm_mem.baseline.noise import NoiseJudge, is_noisy
from pytest_vllm_mem.baseline.results import TestRecord, failure_dict
from pytest_vllm_mem.baseline.store import BaselineEntry, BaselineError, BaselineStore, EnvKey, git_commit
from pytest_vllm_mem.diagnosis.advice import advise, render_steps
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis
from pytest_vllm_mem.launch.server import VLLMServer
from pytest_vllm_mem.settings import UsageError
from pytest_vllm_mem.units import format_bytes

if TYPE_CHECKING:
    from pytest_vllm_mem.plugin.state import SessionState


class GateSettings(Protocol):
    """The settings the gate reads (Settings has them)."""

    @property
    def vllm_baseline(self) -> Path: ...

    @property
    def vllm_update_baseline(self) -> bool: ...

    @property
    def vllm_require_baseline(self) -> bool: ...

    @property
    def vllm_strict(self) -> bool: ...

    @property
    def vllm_gate_alpha(self) -> float: ...


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
    """The record's environment. Its vLLM version is the one that served (the server's own log, else the
    --vllm-python interpreter's vLLM), never the plugin's interpreter's."""
    return EnvKey(record.tier, record.device, record.vllm_version or "unknown")


def tier_problem(record: TestRecord, tier_is_auto: bool) -> str | None:
    # A tier is one card's memory: the fullest GPU of the server is what must fit, not the sum over its GPUs.
    peak = record.largest_gpu_peak_bytes
    if tier_is_auto or not record.tier_bytes or peak <= record.tier_bytes:
        return None
    per_gpu = record.peak_memory_per_gpu
    where = f" on GPU {per_gpu.index(peak)} of {len(per_gpu)}" if len(per_gpu) > 1 else ""
    return (
        f"peak memory {format_bytes(peak)}{where} exceeds the {record.tier} tier "
        f"({format_bytes(record.tier_bytes)}) by {format_bytes(peak - record.tier_bytes)}"
    )


class Gate:
    """Tolerances of the command line and ini, the session's baseline store, and the judge of each metric."""

    def __init__(
        self,
        settings: GateSettings,
        cli: dict[str, Tolerance] | None = None,
        ini: dict[str, Tolerance] | None = None,
        *,
        judge: Judge = tolerance_judge,
    ) -> None:
        self.settings = settings
        self.cli = cli or {}
        self.ini = ini or {}
        self.judge = judge
        # Earlier sessions' medians are what the noise judge weighs; memory figures need none.
        self.store = BaselineStore(
            settings.vllm_baseline, history_metrics=frozenset(name for name, m in METRICS.items() if is_noisy(m))
        )

    @classmethod
    def from_config(cls, config: pytest.Config, settings: GateSettings) -> Gate:
        cli, ini = tolerance_layers(config)
        # Throughput and latency wobble on shared runners: judged against the noise their runs show (noise.py).
        return cls(settings, cli, ini, judge=NoiseJudge(alpha=settings.vllm_gate_alpha))

    def evaluate(
        self, record: TestRecord, marker: dict[str, Tolerance], *, tier_is_auto: bool, server: VLLMServer | None = None
    ) -> str | None:
        """Compare `record` with the tier and the baseline; returns the failure text, or None when the test passes.
        Fills the record's comparisons and baseline match (also in update mode, for the upgrade report). `server`:
        the test's server, whose launched config and startup figures the advice for a peak over the tier uses."""
        problems = []
        over_tier = tier_problem(record, tier_is_auto)
        if over_tier:
            steps = (
                advise(
                    None,
                    server.launched,
                    server.memory,
                    tier_bytes=record.tier_bytes,
                    peak_bytes=record.largest_gpu_peak_bytes,
                )
                if server is not None
                else []
            )
            problems.append("\n".join([over_tier, *render_steps(steps)]))
            record.failure = failure_dict(Diagnosis("tier_exceeded", over_tier), steps, None)
        samples = record.metric_samples()
        if not samples:
            return "\n\n".join(problems) or None
        tolerances = resolve_tolerances(self.cli, self.ini, marker)
        settings = self.settings
        env = env_key(record)
        try:
            match = select_baseline(self.store.entries_for(record.test_id), env)
        except BaselineError as error:
            raise UsageError(str(error)) from None
        entry = match.entry if match is not None else None
        comparisons = compare(entry, samples, tolerances, judge=self.judge)
        record.comparisons = [c.to_dict() for c in comparisons]
        record.baseline = match.to_dict() if match is not None else None
        if settings.vllm_update_baseline:
            record.baseline_status = "updated"
            return "\n\n".join(problems) or None
        record.baseline_status = "missing" if entry is None else "compared"
        if entry is None and settings.vllm_require_baseline:
            problems.append(
                f"no baseline for {record.test_id} on {env.as_str()} (nor another vLLM version on this "
                f"tier and device) in {settings.vllm_baseline} (--vllm-require-baseline): record one "
                "with --vllm-update-baseline"
            )
        failures = gate_failures(comparisons, settings.vllm_strict)
        if failures:
            problems.append(
                format_gate_failure(
                    record.test_id,
                    failures,
                    entry,
                    running_version=env.vllm_version,
                    hint="if this change is intended, rerun with --vllm-update-baseline",
                )
            )
        return "\n\n".join(problems) or None

    def entries(self, records: list[TestRecord], rootdir: Path | str) -> list[BaselineEntry]:
        """Entries for the tests that ran, passed and measured something, for --vllm-update-baseline."""
        commit = git_commit(rootdir)
        entries = []
        for record in records:
            samples = record.metric_samples()
            if record.baseline_status != "updated" or not record.passed or not samples:
                continue
            entries.append(
                BaselineEntry.from_samples(
                    record.test_id, env_key(record), samples, config=record.launched, commit=commit
                )
            )
        return entries

    def update(self, records: list[TestRecord], rootdir: Path | str) -> int:
        """Write the entries of `records` into the baseline file; raises BaselineError when it cannot."""
        entries = self.entries(records, rootdir)
        self.store.update(entries)
        return len(entries)


def evaluate_record(
    state: SessionState, record: TestRecord, marker: dict[str, Tolerance], server: VLLMServer | None = None
) -> str | None:
    """The gate of the session for one record (the hook's entry point)."""
    return state.gate.evaluate(record, marker, tier_is_auto=state.tier.auto, server=server)
