"""Comparison with a baseline: which entry a test compares with, and the pure per-metric comparison.

A test compares with the entry of its own environment (tier, device, vLLM version). Without one, it compares with
the closest recorded vLLM version on the same tier and device: the newest version not newer than the running one (the
release an upgrade came from, so a "bump vLLM" change is gated against what it replaces), else the oldest newer one
(a downgrade, or a branch still on an older vLLM). Versions order by PEP 440; one that does not parse matches only
exactly. Every comparison names the version it compares against.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pytest_vllm_mem.baseline.metrics import METRICS, Metric, Tolerance
from pytest_vllm_mem.baseline.store import BaselineEntry, EnvKey, median, spread_range, vllm_version_order
from pytest_vllm_mem.units import format_bytes, format_quantity

Status = Literal["ok", "regressed", "improved", "warned", "new", "info", "skipped"]
JUDGED = ("ok", "regressed", "improved", "warned")  # the statuses of a gated figure that was compared
AUTO_TIER = "auto"
# Device memory is logged with two decimals of GiB: a smaller difference is rounding, not another machine.
REPLAN_THRESHOLD = 0.005


# ----------------------------------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class BaselineMatch:
    """The entry a test compares with, and whether it is of the test's own environment."""

    entry: BaselineEntry
    exact: bool

    @property
    def vllm_version(self) -> str:
        return self.entry.env.vllm_version

    def to_dict(self) -> dict[str, Any]:
        entry = self.entry
        return {
            "env": entry.env.as_str(),
            "vllm_version": entry.env.vllm_version,
            "exact": self.exact,
            "recorded_at": entry.recorded_at,
            "commit": entry.commit,
            "host": entry.host,
            "runs": entry.runs,
            "config": entry.config,
        }


def select_baseline(candidates: Mapping[EnvKey, BaselineEntry], env: EnvKey) -> BaselineMatch | None:
    """The entry of `env`, else the closest vLLM version on the same tier and device (see the module docstring)."""
    own = candidates.get(env)
    if own is not None:
        return BaselineMatch(own, exact=True)
    running = vllm_version_order(env.vllm_version)
    if running is None:
        return None
    versions = []
    for key, entry in candidates.items():
        version = vllm_version_order(key.vllm_version)
        if key.machine == env.machine and version is not None:
            versions.append((version, key.as_str(), entry))
    older = [item for item in versions if item[0] <= running]
    if older:
        return BaselineMatch(max(older, key=lambda item: item[:2])[2], exact=False)
    newer = [item for item in versions if item[0] > running]
    return BaselineMatch(min(newer, key=lambda item: item[:2])[2], exact=False) if newer else None


# -------------------------------------------------------------------------------------------------------- judging


@dataclass(frozen=True)
class Sample:
    """A metric's value on one side of a comparison: the median, and every run's value it was taken from; for the
    baseline also the medians of earlier recorded sessions (the entry's history, oldest first)."""

    median: float
    values: tuple[float, ...]
    history: tuple[float, ...] = ()
    sessions: int = 1  # servers the values came from (2 after a confirmation on a fresh start)

    @classmethod
    def of(cls, values: Sequence[float]) -> Sample:
        return cls(median(values), tuple(values))


@dataclass(frozen=True)
class Verdict:
    status: Literal["ok", "regressed", "improved", "warned"]  # warned: worse, reported but not failed
    detail: str = ""  # the statistics behind the decision, shown in the message ("-18% +- 6%, 4 runs vs 5")
    confirm: bool = False  # suspect (noise.Decision.suspect): re-measure on fresh servers before deciding


Judge = Callable[[Metric, Sample, Sample, Tolerance], Verdict]


def tolerance_judge(metric: Metric, baseline: Sample, now: Sample, tolerance: Tolerance) -> Verdict:
    """The fixed band: the medians may differ by the tolerance; worse beyond it regresses, better beyond it improves."""
    if not tolerance.allows(baseline.median, now.median, metric.higher_is_better):
        return Verdict("regressed")
    if tolerance.improves_beyond(baseline.median, now.median, metric.higher_is_better):
        return Verdict("improved")
    return Verdict("ok")


# ----------------------------------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Comparison:
    metric: str
    baseline: float | None  # None: no baseline value ("new"), or not comparable ("skipped")
    now: float
    change_pct: float | None  # (now - baseline) / baseline * 100; None when there is no baseline or it is 0
    tolerance: Tolerance | None  # None for report-only figures
    # "ok", "regressed", "improved" (better beyond tolerance), "warned" (worse than a provisional baseline can judge:
    # noise.Decision.warned), "new", "info" (not gated), "skipped"
    status: Status
    baseline_version: str | None = None  # the vLLM version of the entry compared with
    baseline_values: tuple[float, ...] = ()
    now_values: tuple[float, ...] = ()
    detail: str = ""
    recorded: float | None = None  # the recorded baseline when `baseline` was re-planned for this run's memory
    note: str = ""
    baseline_history: tuple[float, ...] = ()  # medians of earlier recorded sessions the judge was given
    confirmable: bool = False  # suspect (Verdict.confirm): re-measured on fresh servers before the gate decides

    @property
    def unit(self) -> str:
        metric = METRICS.get(self.metric)
        return metric.unit if metric else ""

    def message(self) -> str:
        """`output_throughput: 812.3 tok/s now vs 1,204.5 tok/s baseline on vLLM 0.27.1 (-32.6%, tolerance 10%)`."""
        now = format_quantity(self.now, self.unit)
        if self.status == "skipped":
            return f"{self.metric}: {now} now, not compared: {self.note}"
        if self.baseline is None:
            return f"{self.metric}: {now} now, no baseline value yet"
        on = f" on vLLM {self.baseline_version}" if self.baseline_version else ""
        replanned = ""
        if self.recorded is not None:
            replanned = f" (re-planned from {format_quantity(self.recorded, self.unit)})"
        # A detail that starts with the change and its statistics ("-18.0% +- 6.1%, 3 runs vs 3; limit ...", the
        # noise judge's) replaces the bare change; what follows its ";" comes after the tolerance.
        with_change = self.detail[:1] in ("+", "-")
        summary, _, rest = self.detail.partition(";") if with_change else ("", "", self.detail)
        parts = [summary.strip() or (f"{self.change_pct:+.1f}%" if self.change_pct is not None else "from 0")]
        if self.tolerance is not None:
            parts.append(f"tolerance {self.tolerance}")
        else:
            parts.append("reported, not gated")
        if rest.strip():
            parts.append(rest.strip())
        return (
            f"{self.metric}: {now} now vs {format_quantity(self.baseline, self.unit)} baseline{on}{replanned} "
            f"({', '.join(parts)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The form kept in the test's record and the results JSON."""
        return {
            "metric": self.metric,
            "unit": self.unit,
            "baseline": self.baseline,
            "now": self.now,
            "change_pct": self.change_pct,
            "tolerance": str(self.tolerance) if self.tolerance else None,
            "status": self.status,
            "baseline_version": self.baseline_version,
            "baseline_values": list(self.baseline_values),
            "now_values": list(self.now_values),
            "detail": self.detail,
            "recorded": self.recorded,
            "note": self.note,
            "message": self.message(),
            "baseline_history": list(self.baseline_history),
            "confirmable": self.confirmable,
        }


@dataclass(frozen=True)
class Replan:
    """An untiered run's baseline moved to this run's device memory.

    vLLM reserves `utilization x device memory` and gives the KV cache what its weights, activations and graphs
    leave of it (DESIGN.md section 1; on CPU, what the worker's RSS leaves). On an untiered run the device memory is
    whatever the machine has: on the CPU backend the NUMA node's size, which changes between machines and runs. So
    with the same config and the same vLLM, the KV pool, and the peaks that hold it, move by exactly
    `utilization x (memory now - memory then)`, and KV tokens and concurrency in proportion to the pool. Comparing
    with the baseline moved by that amount keeps those metrics gated (a non-KV growth still shrinks the pool) without
    putting the machine's memory into the environment key."""

    device_before: float
    device_now: float
    utilization: float
    kv_before: float | None
    # What vLLM logged it requested then and now, when both ran at the same utilization: the reservation moved by
    # their difference. vLLM reads the node's memory for its request and for its KV line at two moments, and a VM
    # whose memory balloons answers differently (a busy machine: the KV line said 10.84 GiB where it had said 9.46,
    # the request stayed 0.96 GiB; utilization x the difference would have planned 0.14 GiB of KV cache that vLLM
    # never reserved, a false -30%). With another utilization the request moved by the config: the old rule.
    requested_before: float | None = None
    requested_now: float | None = None

    @property
    def delta_bytes(self) -> float:
        if self.requested_before is not None and self.requested_now is not None:
            return self.requested_now - self.requested_before
        return self.utilization * (self.device_now - self.device_before)

    def value(self, metric: Metric, recorded: float) -> float | None:
        """The recorded value as this run's memory would have made it; None when it cannot be said."""
        if metric.unit == "bytes":
            return recorded + self.delta_bytes
        if not self.kv_before or self.kv_before + self.delta_bytes <= 0:
            return None
        return recorded * (self.kv_before + self.delta_bytes) / self.kv_before

    def note(self) -> str:
        return (
            f"untiered run: vLLM sized its KV cache from {format_bytes(self.device_now)} of device memory now, "
            f"{format_bytes(self.device_before)} when the baseline was recorded; memory and KV figures are "
            f"compared with the baseline re-planned for it ({'+' if self.delta_bytes >= 0 else '-'}"
            f"{format_bytes(abs(self.delta_bytes))} of KV cache at utilization {self.utilization:.3g}). "
            "Pin a tier (--vllm-gpu) to compare them as recorded"
        )


_UTILIZATION = re.compile(r"--gpu-memory-utilization[ =](\S+)")


def _utilization_flag(command: str | None) -> str | None:
    found = _UTILIZATION.search(command or "")
    return found.group(1) if found else None


def replan_for(
    entry: BaselineEntry, samples: Mapping[str, Sequence[float]], now_config: str | None = None
) -> Replan | None:
    """The re-plan for an untiered entry whose device memory differs from this run's, when both runs let vLLM size
    the KV cache from it (the CPU worker's "Auto set ... requested memory" line; not with VLLM_CPU_KVCACHE_SPACE).
    On a tiered run the tier fixes the reservation, and a GPU's memory is fixed by its name (in the key)."""
    if entry.env.tier != AUTO_TIER:
        return None
    before, requested = entry.metrics.get("device_memory"), entry.metrics.get("requested_memory")
    now_values, requested_now = samples.get("device_memory"), samples.get("requested_memory")
    if not (before and requested and now_values and requested_now):
        return None
    now = median(now_values)
    if abs(now - before) <= REPLAN_THRESHOLD * before:
        return None
    kv_before = entry.metrics.get("kv_cache_memory")
    if now_config is None or _utilization_flag(entry.config) != _utilization_flag(now_config):
        return Replan(before, now, requested / before, kv_before)
    return Replan(before, now, requested / before, kv_before, requested, median(requested_now))


def _change_pct(baseline: float, now: float) -> float | None:
    if baseline != 0:
        return (now - baseline) / abs(baseline) * 100
    return 0.0 if now == 0 else None


def compare(
    entry: BaselineEntry | None,
    samples: Mapping[str, Sequence[float]],
    tolerances: Mapping[str, Tolerance],
    *,
    judge: Judge = tolerance_judge,
    now_sessions: int = 1,
    now_config: str | None = None,
) -> list[Comparison]:
    """One Comparison per catalogue metric measured now (catalogue order), from this run's samples per metric (one
    per load, or one per server) and the entry's medians and spreads. Pure: no I/O, no settings. Gated metrics are
    decided by `judge` under their tolerance (a missing one: the metric's default); report-only figures get "info".
    Unknown metric names are ignored (their direction is unknown); metrics in the baseline but not measured now are
    skipped. `now_sessions`: the servers this run's samples came from (2 after a confirmation on a fresh start)."""
    replan = replan_for(entry, samples, now_config) if entry is not None else None
    comparisons = []
    for name, metric in METRICS.items():
        values = [v for v in samples.get(name, ()) if math.isfinite(v)]
        if values:
            now = Sample(median(values), tuple(values), sessions=now_sessions)
            comparisons.append(_compare_metric(name, metric, now, entry, tolerances, replan, judge))
    return comparisons


def _compare_metric(
    name: str,
    metric: Metric,
    now: Sample,
    entry: BaselineEntry | None,
    tolerances: Mapping[str, Tolerance],
    replan: Replan | None,
    judge: Judge,
) -> Comparison:
    """One metric's Comparison: "new" without a recorded value, "skipped" when a re-plan has nothing to scale by,
    "info" for a report-only figure, otherwise the judge's verdict."""
    version = entry.env.vllm_version if entry is not None else None
    # A report-only figure is gated when a tolerance is set for it (e.g. ttft_p99=50%).
    tolerance = tolerances.get(name, metric.default_tolerance) if metric.gated or name in tolerances else None
    recorded = entry.metrics.get(name) if entry is not None else None
    if entry is None or recorded is None:
        return Comparison(name, None, now.median, None, tolerance, "new", version, now_values=now.values)
    recorded_values = tuple(entry.spread.get(name) or [recorded])
    base = Sample(recorded, recorded_values, tuple(entry.history.get(name, ())))
    original: float | None = None
    note = ""
    if replan is not None and metric.kv_sized:
        moved = replan.value(metric, recorded)
        note = replan.note()
        if moved is None:
            return Comparison(
                name,
                None,
                now.median,
                None,
                tolerance,
                "skipped",
                version,
                recorded_values,
                now.values,
                recorded=recorded,
                note=note + "; the baseline has no KV cache memory to scale it by",
            )
        # Earlier sessions' medians were taken at their own memory: a re-planned comparison goes without them.
        base = Sample(moved, tuple(v for v in (replan.value(metric, x) for x in recorded_values) if v is not None))
        original = recorded
    change = _change_pct(base.median, now.median)
    if tolerance is None:
        return Comparison(
            name,
            base.median,
            now.median,
            change,
            None,
            "info",
            version,
            base.values,
            now.values,
            recorded=original,
            note=note,
        )
    verdict = judge(metric, base, now, tolerance)
    return Comparison(
        name,
        base.median,
        now.median,
        change,
        tolerance,
        verdict.status,
        version,
        base.values,
        now.values,
        verdict.detail,
        original,
        note,
        base.history,
        confirmable=verdict.confirm,
    )


# Free memory at startup is logged with two decimals of GiB: a smaller shortfall is rounding.
FREE_MEMORY_SLACK = 0.005


def free_memory_note(comparisons: Iterable[Comparison]) -> str | None:
    """A line when this run's server saw less free device memory at start than the baseline's did: vLLM sizes its
    pool from what it sees, so memory and KV figures may differ for that reason alone (a second instance on a card
    saw 1.27 GiB less, llm-d-fast-model-actuation#746)."""
    for c in comparisons:
        if c.metric == "startup_free_memory" and c.baseline and c.now < c.baseline * (1 - FREE_MEMORY_SLACK):
            return (
                f"this run's server saw {format_bytes(c.now)} free at start, the baseline's "
                f"{format_bytes(c.baseline)} ({format_bytes(c.baseline - c.now)} less): another process held device "
                "memory, and memory and KV figures are not comparable until it is gone"
            )
    return None


def gate_failures(comparisons: Iterable[Comparison], strict: bool) -> list[Comparison]:
    """Regressions fail; improvements beyond tolerance fail only in strict mode (the baseline is out of date)."""
    failing = {"regressed", "improved"} if strict else {"regressed"}
    return [c for c in comparisons if c.status in failing]


def format_gate_failure(
    test_id: str,
    failures: Sequence[Comparison],
    entry: BaselineEntry | None,
    *,
    running_version: str | None = None,
    hint: str | None = None,
) -> str:
    """The failure text for one test: what moved, by how much, against which baseline (and vLLM version), and where
    it came from. `running_version`: the vLLM that ran, named when it is not the baseline's. `hint` is the plugin's
    advice line (e.g. which option accepts the new numbers)."""
    count = f"{len(failures)} metric" + ("" if len(failures) == 1 else "s")
    env = f" for {entry.env.as_str()}" if entry is not None else ""
    lines = [f"{test_id}: {count} outside tolerance of the baseline{env}"]
    if entry is not None and running_version and running_version != entry.env.vllm_version:
        lines.append(
            f"compared across the vLLM upgrade {entry.env.vllm_version} -> {running_version} (no baseline "
            f"for vLLM {running_version} on this tier and device yet)"
        )
    width = max((len(c.status) for c in failures), default=0)
    for comparison in failures:
        lines.append(f"  {comparison.status:<{width}}  {comparison.message()}")
        seen = comparison.baseline_values
        if len(seen) > 1:
            low, high = spread_range(seen)
            unit = comparison.unit
            lines.append(
                f"  {'':<{width}}    baseline runs ranged {format_quantity(low, unit)} .. {format_quantity(high, unit)}"
            )
    for note in dict.fromkeys(c.note for c in failures if c.note):
        lines.append(note)
    if any(c.status == "improved" for c in failures):
        lines.append("improvements beyond tolerance fail in strict mode: the baseline no longer describes this code")
    if entry is not None:
        lines.append(entry.provenance())
        if entry.config:
            lines.append(f"baseline config: {entry.config}")
    if hint:
        lines.append(hint)
    return "\n".join(lines)
