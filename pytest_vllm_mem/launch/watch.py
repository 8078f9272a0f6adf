"""A starting server's log read as it grows: the startup phases and figures vLLM logs (diagnose's
startup_milestone and line_figures), emitted as progress events while an observer is active.

Next to server.py, which reads the same log; the events and the observer are the core's (progress.py)."""

from __future__ import annotations

import time
from dataclasses import fields, replace
from pathlib import Path
from typing import IO, Any, Protocol

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import (
    PRE_STARTUP_PHASE,
    STARTUP_PHASES,
    StartupMemory,
    line_figures,
    startup_milestone,
    strip_log_prefix,
)
from pytest_vllm_mem.progress import (
    Figures,
    Observer,
    PhaseSeen,
    StartupBegan,
    StartupEnded,
    StartupTick,
    active_observer,
    config_label,
    send,
)

_FIGURE_NAMES = frozenset(f.name for f in fields(Figures))


def figures_of(memory: StartupMemory) -> Figures:
    """The figures of the parse the results keep (fields named alike)."""
    return Figures(**{name: getattr(memory, name) for name in _FIGURE_NAMES})


class Outcome(Protocol):
    """What a watch reports of how a startup ended (server.StartupOutcome)."""

    @property
    def ok(self) -> bool: ...
    @property
    def kind(self) -> str: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def peak_memory_bytes(self) -> int: ...


class StartingServer(Protocol):
    """What a startup watch reads of the server it watches."""

    @property
    def config(self) -> VLLMConfig: ...
    @property
    def log_path(self) -> Path: ...
    @property
    def started_at(self) -> float: ...
    def peak_between(self, since: float) -> int: ...


# ---- the log tail ------------------------------------------------------------------------------------

_MAX_LINE = 64 * 1024  # a partial line longer than this (a tqdm bar without newline) is dropped, not grown forever


class LogTail:
    """Reads a growing log file from where it stopped; yields its complete lines (`\\n` or tqdm's `\\r`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._partial = b""

    def new_lines(self) -> list[str]:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 (kept open across polls, closed by close())
            except OSError:
                return []
        chunk = self._file.read()
        if not chunk:
            return []
        data = self._partial + chunk
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        self._partial = data[cut + 1 :] if len(data) - cut - 1 <= _MAX_LINE else b""
        if cut < 0:
            return []
        return data[:cut].decode("utf-8", "replace").splitlines()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StartupReader:
    """Phases and figures from log lines, in the order vLLM reaches them (a phase never goes back)."""

    def __init__(self) -> None:
        self.phase_index = -1
        self.figures = Figures()
        self._unsaid: list[str] = []

    @property
    def phase(self) -> str:
        return STARTUP_PHASES[self.phase_index] if self.phase_index >= 0 else PRE_STARTUP_PHASE

    def feed(self, raw: str) -> str | None:
        """The phase this line starts, if it starts one (a later milestone may skip ones this vLLM does not log)."""
        text = strip_log_prefix(raw)
        if not text:
            return None
        self._figures(text)
        index = startup_milestone(text, self.phase_index)
        if index is None:
            return None
        self.phase_index = index
        return STARTUP_PHASES[index]

    def take_new_figures(self) -> tuple[str, ...]:
        said, self._unsaid = tuple(self._unsaid), []
        return said

    def _figures(self, text: str) -> None:
        """Keep the figures this line states that the log has not stated before (the first one wins, as in the
        results' parse)."""
        values: dict[str, Any] = {  # int for kv_cache_tokens, float for the rest
            name: value
            for name, value in line_figures(text).items()
            if name in _FIGURE_NAMES and getattr(self.figures, name) is None
        }
        if values:
            before = set(self.figures.describe())
            self.figures = replace(self.figures, **values)
            self._unsaid += [part for part in self.figures.describe() if part not in before]


class Watch(Protocol):
    def poll(self) -> None: ...

    def finish(self, outcome: Outcome | None, memory: StartupMemory | None = None) -> None: ...


class _NoWatch:
    def poll(self) -> None:
        pass

    def finish(self, outcome: Outcome | None, memory: StartupMemory | None = None) -> None:
        pass


class StartupWatch:
    """One server startup under an observer: `poll()` from the health-poll loop, `finish()` once at the end."""

    def __init__(self, observer: Observer, server: StartingServer) -> None:
        self.observer = observer
        self.server = server
        self.tail = LogTail(server.log_path)
        self.reader = StartupReader()
        self._peak = 0
        self._peak_since = server.started_at
        self._next_tick = server.started_at + observer.tick_s
        observer.startups += 1
        send(observer, StartupBegan(observer.test_id, config_label(server.config), str(server.log_path), time.time()))

    def _read(self) -> None:
        lines = self.tail.new_lines()
        if not lines:
            return
        elapsed = time.monotonic() - self.server.started_at
        for line in lines:
            phase = self.reader.feed(line)
            if phase is not None:
                send(self.observer, PhaseSeen(self.observer.test_id, phase, elapsed, self.reader.take_new_figures()))

    def _running_peak(self) -> int:
        now = time.monotonic()  # taken before the read: a sample appended after it is timed after `now`
        self._peak = max(self._peak, self.server.peak_between(self._peak_since))
        self._peak_since = now
        return self._peak

    def poll(self) -> None:
        self._read()
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self.observer.tick_s
            obs = self.observer
            send(
                obs,
                StartupTick(
                    obs.test_id,
                    self.reader.phase,
                    now - self.server.started_at,
                    self._running_peak(),
                    obs.tier_bytes,
                    obs.tier_name,
                ),
            )

    def finish(self, outcome: Outcome | None, memory: StartupMemory | None = None) -> None:
        """`outcome` None: interrupted (Ctrl-C, a CI cancel). Figures from `memory`, the parse the results keep."""
        self._read()
        self.tail.close()
        obs = self.observer
        figures = figures_of(memory) if memory is not None else self.reader.figures
        if outcome is None:
            ended = StartupEnded(
                obs.test_id,
                False,
                "interrupted",
                time.monotonic() - self.server.started_at,
                self._running_peak(),
                obs.tier_bytes,
                obs.tier_name,
                self.reader.phase,
                figures,
            )
        else:
            ended = StartupEnded(
                obs.test_id,
                outcome.ok,
                outcome.kind,
                outcome.duration_s,
                outcome.peak_memory_bytes,
                obs.tier_bytes,
                obs.tier_name,
                self.reader.phase,
                figures,
            )
        send(obs, ended)


def watch_startup(server: StartingServer) -> Watch:
    """A watch on `server`'s startup when an observer is active, else one that does nothing."""
    observer = active_observer()
    return StartupWatch(observer, server) if observer is not None else _NoWatch()
