"""The baseline store: one reviewable JSON file in the user's repository, its entries and their environment keys.

The file is `{"schema": 1, "baselines": {test_id: {env_str: entry}}}`, written with sorted keys and a trailing newline
so diffs stay small. Entries are keyed by environment (memory tier, device, vLLM version) because numbers from an H100
say nothing about an L4, and per vLLM version because the upgrade itself is what the gate must see. The file keeps,
per test, tier and device, at most `KEEP_VERSIONS` vLLM versions (the newest ones, and always the one just written),
so it does not grow with every upgrade. A file that cannot be read is reported, never overwritten.

An entry may keep `history`: per metric, the medians of up to `KEEP_HISTORY` earlier recorded sessions, oldest first.
Refreshing an entry (same test, environment and server config) moves its medians there, so the file shows how much
whole sessions scatter on this runner, which a session's own repeats cannot (noise.py weighs it). The field is
optional: files without it load as before (schema 1), and a plugin that does not know it ignores it.

An entry may also keep `sessions`: up to `KEEP_SESSIONS` earlier sessions, oldest first, each with the commit and
time it was recorded from and its medians (`{"commit": ..., "recorded_at": ..., "medians": {metric: value}}`), the
series over which changepoint.find_step looks for a step. Optional in the same way.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import stat
import statistics
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock
from packaging.version import InvalidVersion, Version

from pytest_vllm_mem.units import is_finite_number

SCHEMA_VERSION = 1
# Per test, tier and device: the running release, the one the last upgrade came from, and one more to roll back to.
KEEP_VERSIONS = 3
# Earlier sessions' medians kept per metric: enough to estimate their spread, few enough that an old runner or an old
# code state ages out within a week of daily refreshes.
KEEP_HISTORY = 5
# Earlier sessions kept with their commits for the change-point search: a month of daily refreshes, a few KiB per
# test, enough that a step shows with several sessions on each side of it.
KEEP_SESSIONS = 30


class BaselineError(Exception):
    """The baseline file cannot be read or written; the message names the file and the problem."""


def vllm_version_order(text: str) -> Version | None:
    """The release order of a vLLM version ("0.27.1" < "0.32.0" < "0.33.0rc1"... by PEP 440); None when the text is
    not a version ("unknown"): such entries are only ever matched exactly."""
    try:
        return Version(text)
    except InvalidVersion:
        return None


@dataclass(frozen=True)
class EnvKey:
    """Which environment a baseline belongs to. `|` separates the parts in the file, so it is replaced in values.

    What decides the figures of a fixed config: the memory tier (vLLM plans inside `utilization x tier`), the device
    model, and the vLLM release. The device's memory size is left out on purpose: on a tiered run the tier fixes the
    plan, and on an untiered (`auto`) run it changes between machines and runs on the CPU backend (8.8-14 GiB seen
    on one VM kind), so it would split one environment into many. Its effect is handled at comparison time instead
    (compare.replan)."""

    tier: str
    device: str
    vllm_version: str

    def __post_init__(self) -> None:
        for name in ("tier", "device", "vllm_version"):
            object.__setattr__(self, name, " ".join(str(getattr(self, name)).replace("|", "/").split()))

    def as_str(self) -> str:
        return f"{self.tier}|{self.device}|vllm {self.vllm_version}"

    @property
    def machine(self) -> tuple[str, str]:
        """(tier, device): the part of the key an upgrade keeps."""
        return self.tier, self.device

    @classmethod
    def from_str(cls, text: str) -> EnvKey:
        tier, sep1, rest = text.partition("|")
        device, sep2, version = rest.rpartition("|")
        if not (sep1 and sep2) or not version.startswith("vllm "):
            raise ValueError(f"environment key {text!r} is not 'TIER|DEVICE|vllm VERSION'")
        return cls(tier, device, version[len("vllm ") :])


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
    history: dict[str, list[float]] = field(default_factory=dict)  # earlier sessions' medians, oldest first
    sessions: list[dict[str, Any]] = field(default_factory=list)  # earlier sessions with commits, oldest first

    def series(self, metric: str) -> tuple[list[float], list[str | None]]:
        """(medians, commits) of `metric` over the kept sessions and this entry's own, oldest first."""
        values: list[float] = []
        commits: list[str | None] = []
        for session in [*self.sessions, {"commit": self.commit, "medians": self.metrics}]:
            value = session.get("medians", {}).get(metric)
            if value is not None:
                values.append(float(value))
                commits.append(session.get("commit"))
        return values, commits

    def continuing(
        self, previous: BaselineEntry | None, *, keep: int = KEEP_HISTORY, metrics: Container[str] | None = None
    ) -> BaselineEntry:
        """This entry with the history of `previous` (the entry it replaces) plus `previous`'s own medians, the
        newest `keep` per metric; for the metric names in `metrics` only (None: all). Without a previous entry, as
        it is. A previous entry of another server config measured something else: no history is carried from it,
        nor any when `keep` is 0."""
        if previous is None:
            return self
        if previous.config != self.config or keep <= 0:
            return replace(self, history={}, sessions=[])
        history: dict[str, list[float]] = {}
        for name in sorted(set(previous.history) | set(previous.metrics)):
            if metrics is not None and name not in metrics:
                continue
            values = [*previous.history.get(name, [])]
            if name in previous.metrics:
                values.append(previous.metrics[name])
            if values[-keep:]:
                history[name] = values[-keep:]
        medians = {name: v for name, v in previous.metrics.items() if metrics is None or name in metrics}
        own = {"commit": previous.commit, "recorded_at": previous.recorded_at, "medians": medians}
        sessions = [*previous.sessions, own][-KEEP_SESSIONS:] if medians else list(previous.sessions)
        return replace(self, history=history, sessions=sessions)

    @classmethod
    def from_samples(
        cls,
        test_id: str,
        env: EnvKey,
        samples: Mapping[str, Sequence[float]],
        *,
        config: str,
        commit: str | None = None,
        host: str | None = None,
        recorded_at: str | None = None,
    ) -> BaselineEntry:
        """Medians and spreads from each metric's samples (one per load, or one per server for startup figures);
        NaN and infinities are skipped. `runs` is the largest number of samples (the test's `repeat`)."""
        spread = {name: [float(v) for v in values if math.isfinite(v)] for name, values in sorted(samples.items())}
        spread = {name: values for name, values in spread.items() if values}
        if not spread:
            raise ValueError(f"no measured values to build a baseline for {test_id}")
        return cls(
            test_id=test_id,
            env=env,
            metrics={name: median(values) for name, values in spread.items()},
            spread=spread,
            runs=max(len(values) for values in spread.values()),
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
            # Only when there is one: an entry without history keeps the bytes of the first schema-1 files.
            **(
                {"history": {name: list(values) for name, values in sorted(self.history.items())}}
                if self.history
                else {}
            ),
            **({"sessions": [dict(session) for session in self.sessions]} if self.sessions else {}),
        }

    @classmethod
    def from_dict(cls, test_id: str, env: EnvKey, data: Mapping[str, Any]) -> BaselineEntry:
        """Raises ValueError naming the field that is wrong; the store adds the file and the entry."""
        if not isinstance(data, Mapping):
            raise ValueError(f"expected an object, found {type(data).__name__}")
        metrics = _number_map(data.get("metrics"), "metrics")
        spread_raw = data.get("spread", {})
        if not isinstance(spread_raw, Mapping) or not all(
            isinstance(v, list) and all(is_finite_number(x) for x in v) for v in spread_raw.values()
        ):
            raise ValueError("'spread' must map metric names to lists of numbers")
        history_raw = data.get("history", {})
        if not isinstance(history_raw, Mapping) or not all(
            isinstance(v, list) and all(is_finite_number(x) for x in v) for v in history_raw.values()
        ):
            raise ValueError("'history' must map metric names to lists of finite numbers (earlier sessions' medians)")
        sessions = data.get("sessions", [])
        if not isinstance(sessions, list) or not all(_is_session(x) for x in sessions):
            raise ValueError(
                '\'sessions\' must be a list of {"commit": string or null, "recorded_at": string, "medians": '
                "{metric: finite number}} (earlier sessions, oldest first)"
            )
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
            spread={name: [float(x) for x in values] for name, values in spread_raw.items()},
            runs=runs,
            config=data["config"],
            recorded_at=data["recorded_at"],
            commit=commit,
            host=data["host"],
            history={str(name): [float(x) for x in values] for name, values in history_raw.items()},
            sessions=[
                {
                    "commit": x.get("commit"),
                    "recorded_at": x.get("recorded_at", ""),
                    "medians": {str(k): float(v) for k, v in x["medians"].items()},
                }
                for x in sessions
            ],
        )


def _is_session(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("medians"), Mapping)
        and all(is_finite_number(v) for v in value["medians"].values())
        and (value.get("commit") is None or isinstance(value.get("commit"), str))
        and isinstance(value.get("recorded_at", ""), str)
    )


def _number_map(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not all(is_finite_number(v) for v in value.values()):
        raise ValueError(f"{name!r} must map metric names to finite numbers, found {value!r}")
    return {str(key): float(v) for key, v in value.items()}


def dumps_document(document: Mapping[str, Any]) -> str:
    """The one on-disk formatting: stable key order and a trailing newline, so rewriting equal content is a no-op."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"


def _newest_first(env_strs: Iterable[str]) -> list[str]:
    """Environment keys of one test, tier and device, newest vLLM first; versions that do not parse come last."""

    def order(env_str: str) -> tuple[bool, Version, str]:
        version = vllm_version_order(EnvKey.from_str(env_str).vllm_version)
        return version is not None, version or Version("0"), env_str

    return sorted(env_strs, key=order, reverse=True)


def prune_versions(by_env: dict[str, Any], written: Iterable[str], keep: int = KEEP_VERSIONS) -> list[str]:
    """Drop, per tier and device, the entries beyond the newest `keep` vLLM versions, never one just `written`.
    Returns the dropped keys (for the summary); `by_env` is changed in place."""
    written = set(written)
    machines: dict[tuple[str, str], list[str]] = {}
    for env_str in by_env:
        machines.setdefault(EnvKey.from_str(env_str).machine, []).append(env_str)
    dropped = []
    for machine, env_strs in machines.items():
        if not any(EnvKey.from_str(w).machine == machine for w in written if w in by_env):
            continue  # untouched by this update: left exactly as it was
        kept = [e for e in env_strs if e in written]
        for env_str in _newest_first(e for e in env_strs if e not in written):
            if len(kept) < keep:
                kept.append(env_str)
            else:
                dropped.append(env_str)
                del by_env[env_str]
    return dropped


class BaselineStore:
    """The baseline JSON file. `load` reads and checks it (once per session: a session compares against one
    consistent file); `update` merges entries in under a file lock (so xdist workers and parallel CI jobs do not lose
    each other's writes), prunes old vLLM versions, and replaces the file atomically."""

    def __init__(
        self,
        path: Path | str,
        *,
        lock_timeout: float = 60.0,
        keep_versions: int = KEEP_VERSIONS,
        keep_history: int = KEEP_HISTORY,
        history_metrics: Container[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.lock_path = Path(f"{self.path}.lock")
        self.lock_timeout = lock_timeout
        self.keep_versions = keep_versions
        self.keep_history = keep_history
        self.history_metrics = history_metrics  # metrics whose earlier medians are kept (None: all)
        self.dropped: list[tuple[str, str]] = []  # (test_id, env_str) pruned by the last update
        self.written: list[BaselineEntry] = []  # the entries the last update wrote, with their carried history
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
        return document  # type: ignore[no-any-return]

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
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
            raise BaselineError(
                f"Baseline file {self.path} has schema {schema}, written by a newer pytest-vllm-mem; this version "
                f"reads schema {SCHEMA_VERSION} and older. Upgrade pytest-vllm-mem (pip install -U pytest-vllm-mem) "
                "to compare against it, or point --vllm-baseline at another file; it was left as it is."
            )
        if schema != SCHEMA_VERSION:
            raise self._schema_error(f"'schema' is {schema!r}, this plugin reads {SCHEMA_VERSION}")
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

    def _cached(self) -> dict[tuple[str, str], BaselineEntry]:
        if self._cache is None:
            self.load()
        assert self._cache is not None
        return self._cache

    def all_entries(self) -> list[BaselineEntry]:
        """Every entry, as of the first read in this session."""
        return list(self._cached().values())

    def get(self, test_id: str, env: EnvKey) -> BaselineEntry | None:
        """The entry as of the first read in this session."""
        return self._cached().get((test_id, env.as_str()))

    def entries_for(self, test_id: str) -> dict[EnvKey, BaselineEntry]:
        """Every environment's entry of one test (for choosing the closest vLLM version)."""
        return {entry.env: entry for (tid, _), entry in self._cached().items() if tid == test_id}

    def update(self, entries: Iterable[BaselineEntry]) -> None:
        """Replace exactly these entries (test_id + env), keeping every other entry and its bytes as they were,
        except the versions beyond `keep_versions` of the tests, tiers and devices written to. An entry that replaces
        one of the same config takes over its history and its medians (BaselineEntry.continuing)."""
        fresh = {(e.test_id, e.env.as_str()): e for e in entries}
        new = {key: e.to_dict() for key, e in fresh.items()}
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
        self.written = []
        with self._locked_write("; the new entries are lost. Pass --vllm-baseline a path in a writable folder."):
            document = self._read_document()  # re-read under the lock: another process may have written
            current = self._entries(document)  # refuse to rewrite a file whose entries are broken
            written: dict[str, list[str]] = {}
            for (test_id, env_str), entry in fresh.items():
                previous = current.get((test_id, env_str))
                merged = entry.continuing(previous, keep=self.keep_history, metrics=self.history_metrics)
                self.written.append(merged)
                data = merged.to_dict()
                document["baselines"].setdefault(test_id, {})[env_str] = data
                written.setdefault(test_id, []).append(env_str)
            self.dropped = [
                (test_id, env_str)
                for test_id, envs in written.items()
                for env_str in prune_versions(document["baselines"][test_id], envs, self.keep_versions)
            ]
            self._write_atomically(dumps_document(document).encode("utf-8"))

    def rewrite(
        self, change: Callable[[dict[tuple[str, str], BaselineEntry]], Mapping[tuple[str, str], BaselineEntry]]
    ) -> None:
        """Replace every entry with `change(current entries)`, the current ones read under the file lock and the
        result written atomically: the whole-file counterpart of `update` (no history carried, nothing pruned), for
        the shard merge (cli/merge.py). `change` may raise to leave the file as it is."""
        with self._locked_write(". Pass a path in a writable folder."):
            entries = change(self._entries(self._read_document()))
            baselines: dict[str, dict[str, Any]] = {}
            for (test_id, env_str), entry in entries.items():
                baselines.setdefault(test_id, {})[env_str] = entry.to_dict()
            self._write_atomically(dumps_document({"schema": SCHEMA_VERSION, "baselines": baselines}).encode("utf-8"))

    @contextmanager
    def _locked_write(self, on_error: str) -> Iterator[None]:
        """The body runs under the file lock (its folder made first), to write the file with _write_atomically; the
        cache is dropped once it has. A lock not taken in `lock_timeout`, or an OSError, is a BaselineError: the
        write error's message ends with `on_error` (what was lost, what to do)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with filelock.FileLock(str(self.lock_path), timeout=self.lock_timeout):
                yield
        except filelock.Timeout:
            raise BaselineError(
                f"Baseline file {self.path}: could not take its lock {self.lock_path} within "
                f"{self.lock_timeout:g} s. Another run may be writing baselines; if none is, delete the lock file."
            ) from None
        except OSError as error:
            raise BaselineError(
                f"Baseline file {self.path} could not be written ({error.strerror or error}){on_error}"
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
