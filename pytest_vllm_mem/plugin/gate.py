"""The per-test gate: a peak above the tier, or a metric worse than its baseline beyond tolerance, fails the test.

One Gate per session (made in pytest_configure): it holds the session's one BaselineStore, so the baseline file is
read once and every test compares against the same content.

Suite-level control: once the suite is collected, `plan` shares --vllm-gate-alpha out over the tests that run loads
(noise.SuiteLevel: Bonferroni over families), so each test is still decided as it ends and fails as itself, and the
summary states what a healthy run risks. Confirmation: a noise-judged regression near its limit re-runs the test's
last load once on the same server (the `remeasure` the vllm_load fixture leaves) and is decided on all runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import pytest

from pytest_vllm_mem.baseline.changepoint import find_step
from pytest_vllm_mem.baseline.compare import (
    JUDGED,
    Comparison,
    Judge,
    compare,
    format_gate_failure,
    free_memory_note,
    gate_failures,
    select_baseline,
    tolerance_judge,
)
from pytest_vllm_mem.baseline.metrics import (
    BUSY_SHARE,
    COALESCED_SHARE,
    METRICS,
    Tolerance,
    ToleranceError,
    busy_load,
    coalesced_load,
    parse_tolerance_mapping,
    parse_tolerance_spec,
    resolve_tolerances,
)
from pytest_vllm_mem.baseline.noise import (
    DEFAULT_ALPHA,
    NOISY_GATED,
    NoiseJudge,
    SuiteLevel,
    confirm_on_fresh_sessions,
    is_noisy,
    pooled_prior,
    provisional_text,
)
from pytest_vllm_mem.baseline.results import TestRecord, failure_dict
from pytest_vllm_mem.baseline.store import BaselineEntry, BaselineError, BaselineStore, EnvKey
from pytest_vllm_mem.diagnosis.advice import advise, render_steps
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis
from pytest_vllm_mem.launch.git import git_commit
from pytest_vllm_mem.launch.server import Server
from pytest_vllm_mem.settings import UsageError
from pytest_vllm_mem.tiers import Tier
from pytest_vllm_mem.units import format_bytes


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

    @property
    def vllm_confirm_sessions(self) -> int: ...


CONFIRM_NOTE = "confirmation:"  # the prefix of the record's note on a re-measured verdict
COALESCED_NOTE = "coalesced delivery:"  # the prefix of the record's note on loads whose latencies are not read


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
        alpha = judge.alpha if isinstance(judge, NoiseJudge) else DEFAULT_ALPHA
        self.suite = SuiteLevel(alpha, families=1)
        self.steps: list[str] = []  # steps the written entries' session series show (set by update)
        self._pooled = False  # the judge has the baseline file's pooled session spreads (_pool_priors)
        # Earlier sessions' medians are what the noise judge weighs; memory figures need none.
        self.store = BaselineStore(
            settings.vllm_baseline, history_metrics=frozenset(name for name, m in METRICS.items() if is_noisy(m))
        )

    @classmethod
    def from_config(cls, config: pytest.Config, settings: GateSettings) -> Gate:
        cli, ini = tolerance_layers(config)
        # Throughput and latency wobble on shared runners: judged against the noise their runs show (noise.py).
        return cls(settings, cli, ini, judge=NoiseJudge(alpha=settings.vllm_gate_alpha))

    def plan(self, families: int) -> None:
        """The suite's count of families (tests that run loads), known at collection: each noise-judged comparison
        gets its share of the suite's level."""
        self.suite = SuiteLevel(self.suite.alpha, families=max(1, families), metrics=self.suite.metrics)
        if isinstance(self.judge, NoiseJudge):
            self.judge = replace(self.judge, alpha=self.suite.per_comparison)

    def _pool_priors(self) -> None:
        """Once, before the first comparison: the spread of session medians pooled over the baseline file's tests
        with history, per metric (the runner's, not one test's: noise.pooled_prior)."""
        if self._pooled or not isinstance(self.judge, NoiseJudge):
            return
        self._pooled = True
        try:
            entries = self.store.all_entries()
        except BaselineError as error:
            raise UsageError(str(error)) from None
        priors = {}
        for name in NOISY_GATED:
            windows = [[*e.history[name], e.metrics[name]] for e in entries if name in e.history and name in e.metrics]
            prior = pooled_prior(windows)
            if prior is not None:
                priors[name] = prior
        self.judge = replace(self.judge, priors=priors)

    def evaluate(
        self,
        record: TestRecord,
        marker: dict[str, Tolerance],
        *,
        tier_is_auto: bool,
        server: Server | None = None,
        remeasure: Callable[[], bool] | None = None,
    ) -> str | None:
        """Compare `record` with the tier and the baseline; returns the failure text, or None when the test passes.
        Fills the record's comparisons and baseline match (also in update mode, for the upgrade report). `server`:
        the test's server, whose launched config and startup figures the advice for a peak over the tier uses.
        `remeasure`: runs one more session of the test's load on a fresh server into the record (False when it
        could not); called up to CONFIRM_SESSIONS times when a noise-judged verdict is suspect and nothing fails
        plainly (noise.Decision.suspect)."""
        problems = []
        over_tier = self._over_tier(record, tier_is_auto, server)
        if over_tier:
            problems.append(over_tier)
        judged, left_out = record.quiet()  # loads a busy runner ran are left out where quiet ones exist
        samples = judged.metric_samples()
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
        self._pool_priors()
        comparisons = self._compare(entry, judged, tolerances)
        if left_out:
            record.notes.append(busy_note(left_out, record))
        note_coalesced(record)
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
        less_free = free_memory_note(comparisons)
        if less_free and less_free not in record.notes:
            record.notes.append(less_free)
        failures = gate_failures(comparisons, settings.vllm_strict)
        plain = [c for c in failures if not c.confirmable]
        # Only when nothing else fails the test (a peak over the tier, a missing baseline): then it decides alone.
        suspect = any(c.confirmable for c in comparisons) and not plain and not problems
        if suspect and remeasure is not None and settings.vllm_confirm_sessions > 0:
            failures = self._confirm(record, entry, tolerances, comparisons, remeasure)
        if failures:
            if less_free:
                problems.append(less_free)
            busy = sum(map(busy_load, judged.loads))
            if busy and not left_out:  # no quiet load to judge instead: say so beside the verdict
                problems.append(
                    f"the runner was busy during {busy} of the {len(judged.loads)} loads judged (other processes "
                    f"took over {BUSY_SHARE:.0%} of its CPU): a slower run here may be the runner, not the server"
                )
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

    def _compare(
        self, entry: BaselineEntry | None, judged: TestRecord, tolerances: dict[str, Tolerance]
    ) -> list[Comparison]:
        """`judged` (a record's quiet view, TestRecord.quiet) against `entry`, over all the sessions it ran in."""
        return compare(
            entry,
            judged.metric_samples(),
            tolerances,
            judge=self.judge,
            now_sessions=judged.sessions,
            now_config=judged.launched,
        )

    @staticmethod
    def _over_tier(record: TestRecord, tier_is_auto: bool, server: Server | None) -> str | None:
        """The failure text of a peak over the tier, with the advice for it; records it as the test's failure."""
        over_tier = tier_problem(record, tier_is_auto)
        if not over_tier:
            return None
        steps = (
            advise(
                None,
                server.launched,
                server.memory,
                tier_bytes=record.tier_bytes,
                peak_bytes=record.largest_gpu_peak_bytes,
                requested=server.config,  # advice in the user's units under tier emulation
            )
            if server is not None
            else []
        )
        record.failure = failure_dict(Diagnosis("tier_exceeded", over_tier), steps, None)
        return "\n".join([over_tier, *render_steps(steps)])

    def _confirm(
        self,
        record: TestRecord,
        entry: BaselineEntry | None,
        tolerances: dict[str, Tolerance],
        comparisons: list[Comparison],
        remeasure: Callable[[], bool],
    ) -> list[Comparison]:
        """Suspect verdicts (noise.Decision.suspect): up to --vllm-confirm-sessions fresh servers, stopping early once
        nothing is suspect any more, then the verdict on all sessions (the failures that remain). Only the last look
        fails a near-limit family, so the suite's level holds (an earlier look may only clear it)."""
        suspects = [c for c in comparisons if c.confirmable]
        first = ", ".join(f"{c.metric} {c.change_pct:+.1f}% ({c.status})" for c in suspects if c.change_pct is not None)

        def rerun(sessions: int) -> list[Comparison] | None:
            if not remeasure():
                return None
            return self._compare(entry, record.quiet()[0], tolerances)  # a busy first session gives way

        comparisons, sessions = confirm_on_fresh_sessions(comparisons, rerun, self.settings.vllm_confirm_sessions)
        note_coalesced(record)  # the fresh sessions' loads counted too
        record.comparisons = [c.to_dict() for c in comparisons]
        failures = gate_failures(comparisons, self.settings.vllm_strict)
        if sessions == 1:
            record.notes.append(f"{CONFIRM_NOTE} {first}: no fresh server could start; decided on the first session")
            return failures
        outcome = "fails" if failures else "passes"
        record.notes.append(
            f"{CONFIRM_NOTE} {first}; re-measured on {sessions - 1} fresh server{'s' if sessions > 2 else ''}, "
            f"decided on all {sessions} sessions ({len(record.loads)} loads): {outcome}"
        )
        return failures

    def entries(self, records: list[TestRecord], rootdir: Path | str) -> list[BaselineEntry]:
        """Entries for the tests that ran, passed and measured something, for --vllm-update-baseline."""
        commit = git_commit(rootdir)
        entries = []
        for record in records:
            samples = record.quiet()[0].metric_samples()  # a busy runner's loads are not recorded where quiet exist
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
        self.steps = history_steps(self.store.written)
        return len(entries)


def busy_note(left_out: int, record: TestRecord) -> str:
    """The record's note on loads left out of its verdicts because other processes took the runner's CPU."""
    shares = [load["others_cpu_share"] for load in record.loads if busy_load(load)]
    return (
        f"busy runner: {left_out} of {len(record.loads)} loads left out of the verdicts (other processes took "
        f"{min(shares):.0%}-{max(shares):.0%} of the CPU during them, over {BUSY_SHARE:.0%})"
    )


def note_coalesced(record: TestRecord) -> None:
    """The record's note (one, kept current) on loads whose token chunks reached the client in bursts
    (metrics.coalesced_load): their TTFT and TPOT timed the reader, so no verdict or baseline reads them."""
    record.notes[:] = [note for note in record.notes if not note.startswith(COALESCED_NOTE)]
    coalesced = sum(map(coalesced_load, record.loads))
    if coalesced:
        record.notes.append(
            f"{COALESCED_NOTE} in {coalesced} of {len(record.loads)} loads over {COALESCED_SHARE:.0%} of the token "
            "intervals read 0 ms (the client read the stream in bursts): their TTFT and TPOT time the reader, not "
            "the server, and are left out of the verdicts and the baseline; their throughput and memory count"
        )


def history_steps(entries: Iterable[BaselineEntry]) -> list[str]:
    """Per written entry and noise-judged metric, the step its series of session medians shows (changepoint.py):
    `test_x: output_throughput: step at commit abc123: -12% (p 0.002 over 9 sessions)`."""
    lines = []
    for entry in entries:
        for name in NOISY_GATED:
            values, commits = entry.series(name)
            step = find_step(values, commits)
            if step is not None:
                lines.append(f"{entry.test_id}: {step.text(name)}")
    return lines


class GatedSession(Protocol):
    """What evaluate_record reads of the plugin session (plugin/session.py PluginSession)."""

    @property
    def gate(self) -> Gate: ...
    @property
    def tier(self) -> Tier: ...


def evaluate_record(
    state: GatedSession,
    record: TestRecord,
    marker: dict[str, Tolerance],
    server: Server | None = None,
    remeasure: Callable[[], bool] | None = None,
) -> str | None:
    """The gate of the session for one record (the hook's entry point)."""
    return state.gate.evaluate(record, marker, tier_is_auto=state.tier.auto, server=server, remeasure=remeasure)


def plan_suite(gate: Gate, items: Iterable[Any]) -> None:
    """At the end of collection: the tests that use vllm_load are the suite's families."""
    gate.plan(sum("vllm_load" in getattr(item, "fixturenames", ()) for item in items))


def suite_lines(gate: Gate, records: Sequence[TestRecord]) -> list[str]:
    """The summary's lines on the suite's error control and on confirmations; none when nothing was noise-judged."""
    judged = families = 0
    for record in records:
        count = sum(1 for c in record.comparisons if c.get("metric") in NOISY_GATED and c.get("status") in JUDGED)
        judged += count
        families += bool(count)
    if not judged:
        return []
    lines = [f"gate: {gate.suite.summary(judged, families)}"]
    confirmed = [note for record in records for note in record.notes if note.startswith(CONFIRM_NOTE)]
    if confirmed:
        cleared = sum(note.endswith("passes") for note in confirmed)
        failed = sum(note.endswith("fails") for note in confirmed)
        lines.append(
            f"gate: {len(confirmed)} suspect test{'' if len(confirmed) == 1 else 's'} re-measured on fresh servers: "
            f"{cleared} cleared, {failed} failed"
            + (f", {len(confirmed) - cleared - failed} could not restart" if len(confirmed) > cleared + failed else "")
        )
    for record in records:
        warned = [c for c in record.comparisons if c.get("status") == "warned"]
        if warned:
            moves = ", ".join(
                f"{c['metric']} {c['change_pct']:+.1f}%" for c in warned if c.get("change_pct") is not None
            )
            lines.append(f"gate: {record.test_id}: {moves}, {provisional_text(len(warned[0]['baseline_history']))}")
    return lines
