"""Baselines: the metrics catalog, tolerances, the JSON store in the user's repo, and the comparison gate.

The store is one reviewable JSON file, `{"schema": 1, "baselines": {test_id: {env_str: entry}}}`, written with sorted
keys and a trailing newline so diffs stay small. Entries are keyed by environment (memory tier, device, vLLM version)
because numbers from an H100 say nothing about an L4. A file that cannot be read is reported, never overwritten.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import stat
import statistics
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock

from pytest_vllm_mem.units import (
    UnitError,
    format_quantity,
    parse_duration_ms,
    parse_size,
    split_amount,
)

SCHEMA_VERSION = 1
STATUSES = ("ok", "regressed", "improved", "new")


class ToleranceError(ValueError):
    """A tolerance written by the user (CLI, ini, marker) cannot be understood; the plugin shows it as a usage error."""


class BaselineError(Exception):
    """The baseline file cannot be read or written; the message names the file and the problem."""


# --------------------------------------------------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    """How much worse than the baseline a metric may get: a fraction of the baseline, an amount in the metric's unit,
    or both (then the looser of the two applies). The same band, mirrored, decides what counts as an improvement
    beyond tolerance (a stale baseline, which fails only in strict mode)."""

    relative: float | None = None
    absolute: float | None = None
    unit: str = ""  # the metric's unit, only to show `absolute` ("256 MiB", "50 ms")

    def __post_init__(self) -> None:
        if self.relative is None and self.absolute is None:
            raise ToleranceError("A Tolerance needs a relative part (0.05 for 5%), an absolute part, or both.")
        for part in (self.relative, self.absolute):
            if part is not None and not (math.isfinite(part) and part >= 0):
                raise ToleranceError(f"Tolerance parts must be finite and not negative, got {part!r}.")

    def limit(self, baseline: float) -> float:
        """The largest change, in the metric's unit, that stays within tolerance of this baseline."""
        limits = []
        if self.relative is not None:
            limits.append(self.relative * abs(baseline))
        if self.absolute is not None:
            limits.append(self.absolute)
        # A hair of slack so "exactly 5% worse" passes despite float rounding (0.05 * 1000 = 50.000000000000004).
        return max(limits) * (1 + 1e-9) + 1e-12

    def allows(self, baseline: float, now: float, higher_is_better: bool) -> bool:
        """True when `now` is worse than `baseline` by no more than the tolerance (or better)."""
        worse_by = (baseline - now) if higher_is_better else (now - baseline)
        return worse_by <= self.limit(baseline)

    def improves_beyond(self, baseline: float, now: float, higher_is_better: bool) -> bool:
        """True when `now` is better than `baseline` by more than the tolerance."""
        better_by = (now - baseline) if higher_is_better else (baseline - now)
        return better_by > self.limit(baseline)

    def __str__(self) -> str:
        parts = []
        if self.relative is not None:
            parts.append(f"{self.relative * 100:g}%")
        if self.absolute is not None:
            parts.append(format_quantity(self.absolute, self.unit, trim=True))
        return " or ".join(parts)


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str  # "bytes", "tokens", "tok/s", "req/s", "ms"
    higher_is_better: bool
    default_tolerance: Tolerance
    description: str = ""


def _metric(name: str, unit: str, higher_is_better: bool, relative: float, description: str) -> Metric:
    return Metric(name, unit, higher_is_better, Tolerance(relative=relative, unit=unit), description)


# Defaults: memory is nearly deterministic for a fixed config, so 5% catches a real change; KV cache tokens follow
# memory; throughput on shared CI machines wobbles ~5%, hence 10%; latency percentiles are the noisiest, hence 20%.
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        _metric("startup_peak_memory", "bytes", False, 0.05, "peak device memory while the server started"),
        _metric("load_peak_memory", "bytes", False, 0.05, "peak device memory while serving the load"),
        _metric("kv_cache_tokens", "tokens", True, 0.05, "KV cache size in tokens reported at startup"),
        _metric("output_throughput", "tok/s", True, 0.10, "generated tokens per second over the load"),
        _metric("request_throughput", "req/s", True, 0.10, "completed requests per second over the load"),
        _metric("ttft_p50", "ms", False, 0.20, "median time to first token"),
        _metric("ttft_p99", "ms", False, 0.20, "99th percentile time to first token"),
        _metric("tpot_p50", "ms", False, 0.20, "median time per output token after the first"),
    )
}

_UNIT_SUFFIXES = {"tokens": ("tokens", "token", "tok"), "tok/s": ("tok/s",), "req/s": ("req/s",)}
_ABSOLUTE_EXAMPLES = {
    "bytes": "a size such as '256MiB', '1GiB', '2GB' (GB = 10^9 bytes, GiB = 2^30) or plain bytes",
    "ms": "a duration such as '50ms', '1.5s' or plain milliseconds",
    "tokens": "a token count such as '1000'",
    "tok/s": "tokens per second such as '50'",
    "req/s": "requests per second such as '2'",
}


def _tolerance_error(text: str, metric: Metric, problem: str = "is not understood") -> ToleranceError:
    examples = _ABSOLUTE_EXAMPLES.get(metric.unit, f"a number in {metric.unit}")
    return ToleranceError(
        f"Tolerance {text!r} for {metric.name} {problem}. Accepted: a percentage of the baseline such as '10%', "
        f"or an absolute amount in the metric's unit ({metric.unit}): {examples}. A bare number is an absolute "
        "amount, not a fraction: write '15%', not '0.15', for a relative tolerance."
    )


def parse_tolerance(text: str, metric: Metric) -> Tolerance:
    """`"15%"` -> relative 0.15; anything else is absolute in the metric's unit: `"256MiB"`, `"2GB"` -> bytes,
    `"50ms"`, `"1.5s"` -> ms, `"100"` -> 100 of the unit. A bare fraction for a bytes or tokens metric (`"0.15"`)
    is refused as a likely mistaken percentage."""
    raw = str(text).strip()
    if raw.endswith("%"):
        amount = split_amount(raw[:-1])
        if amount is None or amount[1]:
            raise _tolerance_error(text, metric)
        return Tolerance(relative=amount[0] / 100, unit=metric.unit)
    amount = split_amount(raw)
    if amount is None:
        raise _tolerance_error(text, metric)
    number, suffix = amount
    if not suffix and metric.unit in ("bytes", "tokens") and not number.is_integer():
        raise _tolerance_error(text, metric, f"would mean {number:g} {metric.unit}, a fraction of one")
    try:
        if metric.unit == "bytes":
            absolute = float(parse_size(raw))
        elif metric.unit == "ms":
            absolute = parse_duration_ms(raw)
        elif not suffix or suffix in _UNIT_SUFFIXES.get(metric.unit, (metric.unit.lower(),)):
            absolute = number
        else:
            raise _tolerance_error(text, metric, f"has a unit ({suffix}) that does not fit {metric.unit}")
    except UnitError:
        raise _tolerance_error(text, metric, f"has a unit ({suffix}) that does not fit {metric.unit}") from None
    return Tolerance(absolute=absolute, unit=metric.unit)


def _unknown_metric(name: str, where: str) -> ToleranceError:
    known = ", ".join(METRICS)
    return ToleranceError(f"{where}unknown metric {name!r}. Known metrics: {known}.")


def parse_tolerance_spec(text: str, *, source: str | None = None) -> dict[str, Tolerance]:
    """`"output_throughput=15%,load_peak_memory=256MiB"` -> per-metric tolerances. `source` (e.g. the option name)
    prefixes error messages so users know which setting to fix."""
    where = f"In {source} {text!r}: " if source else f"In tolerance spec {text!r}: "
    result: dict[str, Tolerance] = {}
    for part in str(text).split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ToleranceError(
                f"{where}{part.strip()!r} is not METRIC=TOLERANCE. Write comma-separated pairs such as "
                "'output_throughput=15%,load_peak_memory=256MiB'."
            )
        if name not in METRICS:
            raise _unknown_metric(name, where)
        if name in result:
            raise ToleranceError(f"{where}{name} is given twice; give each metric once.")
        try:
            result[name] = parse_tolerance(value, METRICS[name])
        except ToleranceError as error:
            raise ToleranceError(f"{where}{error}") from None
    return result


def parse_tolerance_mapping(
    mapping: Mapping[str, str | Tolerance], *, source: str | None = None
) -> dict[str, Tolerance]:
    """Marker form: `{"output_throughput": "15%"}`. Values are strings (parsed like the CLI) or Tolerance objects;
    plain numbers are refused because 0.15 could mean 15% or an absolute 0.15."""
    where = f"In {source}: " if source else ""
    result: dict[str, Tolerance] = {}
    for name, value in mapping.items():
        if name not in METRICS:
            raise _unknown_metric(name, where)
        if isinstance(value, Tolerance):
            result[name] = value
        elif isinstance(value, str):
            try:
                result[name] = parse_tolerance(value, METRICS[name])
            except ToleranceError as error:
                raise ToleranceError(f"{where}{error}") from None
        else:
            raise ToleranceError(
                f"{where}tolerance for {name} is {value!r}; pass a string: a percentage such as '15%', or an "
                f"absolute amount in {METRICS[name].unit} ({_ABSOLUTE_EXAMPLES[METRICS[name].unit]})."
            )
    return result


def resolve_tolerances(
    cli: Mapping[str, Tolerance], ini: Mapping[str, Tolerance], marker: Mapping[str, Tolerance]
) -> dict[str, Tolerance]:
    """Per metric, the most specific setting wins: marker > command line > ini > the metric's default."""
    resolved = {name: metric.default_tolerance for name, metric in METRICS.items()}
    for layer in (ini, cli, marker):
        resolved.update(layer)
    return resolved


# ------------------------------------------------------------------------------------------------------------ entries


@dataclass(frozen=True)
class EnvKey:
    """Which environment a baseline belongs to. `|` separates the parts in the file, so it is replaced in values."""

    tier: str
    device: str
    vllm_version: str

    def __post_init__(self) -> None:
        for name in ("tier", "device", "vllm_version"):
            object.__setattr__(self, name, " ".join(str(getattr(self, name)).replace("|", "/").split()))

    def as_str(self) -> str:
        return f"{self.tier}|{self.device}|vllm {self.vllm_version}"

    @classmethod
    def from_str(cls, text: str) -> "EnvKey":
        tier, sep1, rest = text.partition("|")
        device, sep2, version = rest.rpartition("|")
        if not (sep1 and sep2) or not version.startswith("vllm "):
            raise ValueError(f"environment key {text!r} is not 'TIER|DEVICE|vllm VERSION'")
        return cls(tier, device, version[len("vllm "):])


def utc_now_iso() -> str:
    """`2026-11-30T05:00:12Z`: seconds are precise enough and keep the file readable."""
    return datetime.now(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def median(values: Iterable[float]) -> float:
    items = [float(v) for v in values]
    if not items:
        raise ValueError("median of no values: at least one run must have measured the metric")
    return statistics.median(items)


def spread_range(values: Sequence[float]) -> tuple[float, float]:
    """(min, max) of what the repeated runs saw."""
    if not values:
        raise ValueError("spread of no values")
    return min(values), max(values)


@dataclass
class BaselineEntry:
    test_id: str
    env: EnvKey
    metrics: dict[str, float]  # medians over the runs
    spread: dict[str, list[float]] = field(default_factory=dict)  # every run's value, in run order
    runs: int = 1
    config: str = ""  # the server command line
    recorded_at: str = field(default_factory=utc_now_iso)
    commit: str | None = None
    host: str = field(default_factory=socket.gethostname)

    @classmethod
    def from_runs(
        cls,
        test_id: str,
        env: EnvKey,
        runs: Sequence[Mapping[str, float]],
        *,
        config: str,
        commit: str | None = None,
        host: str | None = None,
        recorded_at: str | None = None,
    ) -> "BaselineEntry":
        """Medians and spreads from repeated runs; a run that did not measure a metric (or got NaN) is skipped."""
        if not runs:
            raise ValueError(f"no runs to build a baseline for {test_id}")
        spread: dict[str, list[float]] = {}
        for run in runs:
            for name, value in run.items():
                if value is not None and math.isfinite(value):
                    spread.setdefault(name, []).append(value)
        return cls(
            test_id=test_id,
            env=env,
            metrics={name: median(values) for name, values in sorted(spread.items())},
            spread=dict(sorted(spread.items())),
            runs=len(runs),
            config=config,
            recorded_at=recorded_at or utc_now_iso(),
            commit=commit,
            host=host or socket.gethostname(),
        )

    def provenance(self) -> str:
        runs = f"{self.runs} run" + ("" if self.runs == 1 else "s")
        return (
            f"baseline recorded {self.recorded_at} on host {self.host}, commit {self.commit or 'unknown'}, "
            f"{runs}, vLLM {self.env.vllm_version}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored under `baselines[test_id][env_str]` (test id and env are the keys, not repeated)."""
        return {
            "metrics": dict(self.metrics),
            "spread": {name: list(values) for name, values in self.spread.items()},
            "runs": self.runs,
            "config": self.config,
            "recorded_at": self.recorded_at,
            "commit": self.commit,
            "host": self.host,
        }

    @classmethod
    def from_dict(cls, test_id: str, env: EnvKey, data: Mapping[str, Any]) -> "BaselineEntry":
        """Raises ValueError naming the field that is wrong; the store adds the file and the entry."""
        if not isinstance(data, Mapping):
            raise ValueError(f"expected an object, found {type(data).__name__}")
        metrics = _number_map(data.get("metrics"), "metrics")
        spread_raw = data.get("spread", {})
        if not isinstance(spread_raw, Mapping) or not all(
            isinstance(v, list) and all(_is_number(x) for x in v) for v in spread_raw.values()
        ):
            raise ValueError("'spread' must map metric names to lists of numbers")
        runs = data.get("runs")
        if not isinstance(runs, int) or isinstance(runs, bool) or runs < 1:
            raise ValueError(f"'runs' must be a positive whole number, found {runs!r}")
        for key in ("config", "recorded_at", "host"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"{key!r} must be a string, found {data.get(key)!r}")
        commit = data.get("commit")
        if commit is not None and not isinstance(commit, str):
            raise ValueError(f"'commit' must be a string or null, found {commit!r}")
        return cls(
            test_id=test_id,
            env=env,
            metrics=metrics,
            spread={name: list(values) for name, values in spread_raw.items()},
            runs=runs,
            config=data["config"],
            recorded_at=data["recorded_at"],
            commit=commit,
            host=data["host"],
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number_map(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not all(_is_number(v) for v in value.values()):
        raise ValueError(f"{name!r} must map metric names to finite numbers, found {value!r}")
    return dict(value)


# -------------------------------------------------------------------------------------------------------------- store


def dumps_document(document: Mapping[str, Any]) -> str:
    """The one on-disk formatting: stable key order and a trailing newline, so rewriting equal content is a no-op."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


class BaselineStore:
    """The baseline JSON file. `load` reads and checks it; `update` merges entries in under a file lock (so xdist
    workers and parallel CI jobs do not lose each other's writes) and replaces the file atomically."""

    def __init__(self, path: Path | str, *, lock_timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.lock_path = Path(f"{self.path}.lock")
        self.lock_timeout = lock_timeout
        self._cache: dict[tuple[str, str], BaselineEntry] | None = None

    def _read_document(self) -> dict[str, Any]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"schema": SCHEMA_VERSION, "baselines": {}}
        except (OSError, UnicodeDecodeError) as error:
            raise BaselineError(f"Baseline file {self.path} cannot be read: {error}.") from None
        if not text.strip():
            return {"schema": SCHEMA_VERSION, "baselines": {}}  # an empty file holds nothing to lose
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise BaselineError(
                f"Baseline file {self.path} is not valid JSON: {error.msg} at line {error.lineno}, column "
                f"{error.colno}. It was left as it is; fix it (a merge conflict?) or move it away to start anew."
            ) from None
        self._check_layout(document)
        return document

    def _schema_error(self, problem: str) -> BaselineError:
        return BaselineError(
            f"Baseline file {self.path} does not have the expected layout: {problem}. Expected "
            f'{{"schema": {SCHEMA_VERSION}, "baselines": {{TEST_ID: {{ENV: ENTRY}}}}}}. It was left as it is; fix '
            "it or move it away to start anew."
        )

    def _check_layout(self, document: Any) -> None:
        if not isinstance(document, dict):
            raise self._schema_error(f"the top level is a {type(document).__name__}, not an object")
        schema = document.get("schema")
        if schema != SCHEMA_VERSION:
            newer = isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION
            problem = f"'schema' is {schema!r}, this plugin reads {SCHEMA_VERSION}"
            raise self._schema_error(problem + (" (written by a newer pytest-vllm-mem?)" if newer else ""))
        baselines = document.get("baselines")
        if not isinstance(baselines, dict):
            raise self._schema_error(f"'baselines' is {type(baselines).__name__}, not an object")
        for test_id, by_env in baselines.items():
            if not isinstance(by_env, dict):
                raise self._schema_error(f"baselines[{test_id!r}] is not an object")

    def _entries(self, document: Mapping[str, Any]) -> dict[tuple[str, str], BaselineEntry]:
        entries: dict[tuple[str, str], BaselineEntry] = {}
        for test_id, by_env in document["baselines"].items():
            for env_str, data in by_env.items():
                try:
                    env = EnvKey.from_str(env_str)
                    entries[(test_id, env.as_str())] = BaselineEntry.from_dict(test_id, env, data)
                except ValueError as error:
                    raise self._schema_error(f"entry {test_id!r} / {env_str!r}: {error}") from None
        return entries

    def load(self) -> dict[tuple[str, str], BaselineEntry]:
        """Every entry by (test_id, env_str). A missing file is empty; a broken one raises BaselineError."""
        self._cache = self._entries(self._read_document())
        return dict(self._cache)

    def get(self, test_id: str, env: EnvKey) -> BaselineEntry | None:
        """The entry as of the first read in this process (so a session compares against one consistent file)."""
        if self._cache is None:
            self.load()
        assert self._cache is not None
        return self._cache.get((test_id, env.as_str()))

    def update(self, entries: Iterable[BaselineEntry]) -> None:
        """Replace exactly these entries (test_id + env), keeping every other entry and its bytes as they were."""
        new = {(e.test_id, e.env.as_str()): e.to_dict() for e in entries}
        for (test_id, env_str), data in new.items():
            if not test_id:
                raise BaselineError(f"Baseline file {self.path}: refusing to store an entry with an empty test id.")
            try:
                dumps_document(data)
            except ValueError:
                raise BaselineError(
                    f"Baseline file {self.path}: the entry for {test_id} ({env_str}) has a non-finite number "
                    f"(NaN or infinity) in {data['metrics']}; it was not written."
                ) from None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with filelock.FileLock(str(self.lock_path), timeout=self.lock_timeout):
                document = self._read_document()  # re-read under the lock: another process may have written
                self._entries(document)  # refuse to rewrite a file whose entries are broken
                for (test_id, env_str), data in new.items():
                    document["baselines"].setdefault(test_id, {})[env_str] = data
                self._write_atomically(dumps_document(document).encode("utf-8"))
        except filelock.Timeout:
            raise BaselineError(
                f"Baseline file {self.path}: could not take its lock {self.lock_path} within "
                f"{self.lock_timeout:g} s. Another run may be writing baselines; if none is, delete the lock file."
            ) from None
        self._cache = None

    def _write_atomically(self, data: bytes) -> None:
        try:
            existing = self.path.stat()
        except FileNotFoundError:
            existing = None
        else:
            if self.path.read_bytes() == data:
                return  # same bytes: leave the file (and its mtime) alone
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # os.open with 0o666 lets the umask decide, like a normal file; mkstemp would force 0o600 on a repo file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            if existing is not None:
                os.chmod(tmp, stat.S_IMODE(existing.st_mode))
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def git_commit(cwd: Path | str) -> str | None:
    """The short sha of HEAD when `cwd` is in a git work tree; None (quietly) without git, a repo or a commit."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=str(cwd),
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = result.stdout.strip()
    return sha if result.returncode == 0 and sha else None


# --------------------------------------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class Comparison:
    metric: str
    baseline: float | None  # None: no baseline value ("new")
    now: float
    change_pct: float | None  # (now - baseline) / baseline * 100; None when there is no baseline or it is 0
    tolerance: Tolerance
    status: str  # "ok", "regressed", "improved" (better beyond tolerance), "new"

    @property
    def unit(self) -> str:
        metric = METRICS.get(self.metric)
        return metric.unit if metric else ""

    def message(self) -> str:
        """`output_throughput: 812.3 tok/s now vs 1,204.5 tok/s baseline (-32.6%, tolerance 10%)`."""
        now = format_quantity(self.now, self.unit)
        if self.baseline is None:
            return f"{self.metric}: {now} now, no baseline value yet"
        change = f"{self.change_pct:+.1f}%" if self.change_pct is not None else "from 0"
        return (
            f"{self.metric}: {now} now vs {format_quantity(self.baseline, self.unit)} baseline "
            f"({change}, tolerance {self.tolerance})"
        )


def compare(
    entry: BaselineEntry | None, metrics: Mapping[str, float], tolerances: Mapping[str, Tolerance]
) -> list[Comparison]:
    """One Comparison per known metric measured now (in METRICS order). Unknown metric names are stored but not
    gated (their direction is unknown); metrics in the baseline but not measured now are skipped."""
    comparisons = []
    for name, metric in METRICS.items():
        now = metrics.get(name)
        if now is None or not math.isfinite(now):
            continue
        tolerance = tolerances.get(name, metric.default_tolerance)
        baseline = entry.metrics.get(name) if entry is not None else None
        if baseline is None:
            comparisons.append(Comparison(name, None, now, None, tolerance, "new"))
            continue
        if baseline != 0:
            change_pct: float | None = (now - baseline) / abs(baseline) * 100
        else:
            change_pct = 0.0 if now == 0 else None
        if not tolerance.allows(baseline, now, metric.higher_is_better):
            status = "regressed"
        elif tolerance.improves_beyond(baseline, now, metric.higher_is_better):
            status = "improved"
        else:
            status = "ok"
        comparisons.append(Comparison(name, baseline, now, change_pct, tolerance, status))
    return comparisons


def gate_failures(comparisons: Iterable[Comparison], strict: bool) -> list[Comparison]:
    """Regressions fail; improvements beyond tolerance fail only in strict mode (the baseline is out of date)."""
    failing = {"regressed", "improved"} if strict else {"regressed"}
    return [c for c in comparisons if c.status in failing]


def format_gate_failure(
    test_id: str, failures: Sequence[Comparison], entry: BaselineEntry | None, *, hint: str | None = None
) -> str:
    """The failure text for one test: what moved, by how much, against which baseline, and where it came from.
    `hint` is the plugin's advice line (e.g. which option accepts the new numbers)."""
    count = f"{len(failures)} metric" + ("" if len(failures) == 1 else "s")
    env = f" for {entry.env.as_str()}" if entry is not None else ""
    lines = [f"{test_id}: {count} outside tolerance of the baseline{env}"]
    width = max((len(c.status) for c in failures), default=0)
    for comparison in failures:
        lines.append(f"  {comparison.status:<{width}}  {comparison.message()}")
        seen = entry.spread.get(comparison.metric) if entry is not None else None
        if seen and len(seen) > 1:
            low, high = spread_range(seen)
            unit = comparison.unit
            lines.append(
                f"  {'':<{width}}    baseline runs ranged {format_quantity(low, unit)} .. {format_quantity(high, unit)}"
            )
    if any(c.status == "improved" for c in failures):
        lines.append("improvements beyond tolerance fail in strict mode: the baseline no longer describes this code")
    if entry is not None:
        lines.append(entry.provenance())
        if entry.config:
            lines.append(f"baseline config: {entry.config}")
    if hint:
        lines.append(hint)
    return "\n".join(lines)
