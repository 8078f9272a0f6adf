"""The pytest adapter's rendering of progress events: one updating status line on a terminal, or plain lines at
phase changes and at most every `plain_every_s` (CI logs), by verbosity (-q: outcomes only, -qq: nothing, -v: every
phase line and the wall clock). `PytestTerminal` writes past pytest's output capture, as the tuner's progress does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pytest_vllm_mem.diagnosis.diagnose import STARTUP_PHASES
from pytest_vllm_mem.progress import (
    Event,
    LoadEnded,
    LoadStopped,
    LoadTick,
    NotStarted,
    PhaseSeen,
    PlacementWait,
    ServerReused,
    StartupBegan,
    StartupEnded,
    StartupTick,
)
from pytest_vllm_mem.settings import UsageError
from pytest_vllm_mem.units import format_bytes

MODES = ("auto", "line", "plain", "off")
Mode = Literal["line", "plain"]
PREFIX = "[vllm-mem]"
READY = STARTUP_PHASES[-1]  # "serving": "Application startup complete"


# ---- rendering ------------------------------------------------------------------------------------------------


class Terminal(Protocol):
    width: int

    def line(self, text: str) -> None:
        """Write a permanent line (clearing the status line first)."""

    def status(self, text: str) -> None:
        """Replace the one status line."""

    def clear_status(self) -> None: ...


def _elapsed(seconds: float) -> str:
    return f"+{seconds:.1f}s"


def _peak(peak: int, tier_bytes: int | None, tier_name: str) -> str:
    text = f"peak {format_bytes(peak)}"
    if tier_bytes:
        # "auto" is the device's own size: say how much that is
        size = f", {format_bytes(tier_bytes)}" if tier_name.startswith("auto") or not tier_name else ""
        text += f" of the {tier_name.split()[0] if tier_name else 'device'} tier{size} ({100 * peak / tier_bytes:.0f}%)"
    return text


@dataclass
class Renderer:
    """Events to text. `mode` "line": one updating status line plus a few permanent lines; "plain": lines only, at
    phase changes and at most every `plain_every_s`. `verbosity` as pytest's (-q -1, -v 1)."""

    terminal: Terminal
    mode: Mode = "plain"
    verbosity: int = 0
    plain_every_s: float = 5.0
    status_every_s: float = 0.5
    clock: Callable[[], float] = time.monotonic
    _last_plain: float = field(default=-1e18, init=False)
    _last_status: float = field(default=-1e18, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __call__(self, event: Event) -> None:
        if self.verbosity <= -2:
            return
        with self._lock:  # load ticks come from their own thread
            self._render(event)

    def _line(self, text: str) -> None:
        self.terminal.line(f"{PREFIX} {text}")
        self._last_plain = self.clock()

    def _status(self, text: str) -> None:
        now = self.clock()
        if self.mode == "line":
            if now - self._last_status >= self.status_every_s:
                self._last_status = now
                self.terminal.status(f"{PREFIX} {text}"[: max(self.terminal.width - 1, 20)])
        elif now - self._last_plain >= self.plain_every_s:
            self._line(text)

    def _render(self, event: Event) -> None:
        quiet = self.verbosity < 0
        verbose = self.verbosity > 0
        if isinstance(event, StartupBegan):
            if not quiet:
                extra = ""
                if verbose:
                    tenths = int(event.wall_time % 1 * 10)
                    clock = f"{time.strftime('%H:%M:%S', time.localtime(event.wall_time))}.{tenths}"
                    extra = f" (at {clock}, log {event.log_path})"
                self._line(f"{event.test_id}: starting {event.config}{extra}")
        elif isinstance(event, PhaseSeen):
            figures = f" ({'; '.join(event.new_figures)})" if event.new_figures else ""
            text = f"  {_elapsed(event.elapsed_s)} {event.phase}{figures}"
            if not quiet and (self.mode == "plain" or verbose):
                self._line(text)
            elif not quiet:
                self._last_status = -1e18  # a new phase shows at once
                self._status(text.strip())
        elif isinstance(event, StartupTick):
            if quiet:
                return
            peak = _peak(event.peak_bytes, event.tier_bytes, event.tier_name)
            if self.mode == "plain":
                self._status(f"  {_elapsed(event.elapsed_s)} still {event.phase}, {peak}")
            else:
                self._status(f"{event.test_id} {_elapsed(event.elapsed_s)} {event.phase}, {peak}")
        elif isinstance(event, StartupEnded):
            self.terminal.clear_status()
            peak = _peak(event.peak_bytes, event.tier_bytes, event.tier_name)
            figures = "; ".join(event.figures.describe())
            who = f"{event.test_id}: " if quiet else "  "
            if event.ok:
                self._line(f"{who}ready in {event.duration_s:.1f}s" + (f": {figures}" if figures else "") + f"; {peak}")
            else:
                self._line(
                    f"{who}{'interrupted' if event.kind == 'interrupted' else f'failed [{event.kind}]'} "
                    f"after {event.duration_s:.1f}s while {event.phase}; {peak}"
                )
        elif isinstance(event, ServerReused):
            if not quiet:
                self._line(
                    f"{event.test_id}: reusing the server for {event.config} (pid {event.pid}, up {event.up_s:.0f}s)"
                )
        elif isinstance(event, NotStarted):
            if not quiet:
                self._line(f"{event.test_id}: not started [{event.kind}]: {event.summary[:160]}")
        elif isinstance(event, PlacementWait):
            if not quiet:  # a status: the wait ends with the startup's own lines
                where = "  " if self.mode == "plain" else f"{event.test_id} "
                self._status(f"{where}waiting {event.waited_s:.0f}s for room on the cluster (other servers hold it)")
        elif isinstance(event, LoadTick):
            if quiet:
                return
            text = (
                f"load {event.number}: {event.done}/{event.total} done, {event.failed} failed, "
                f"{event.tok_per_s:.0f} tok/s, peak {format_bytes(event.peak_bytes)}"
            )
            self._status(("  " if self.mode == "plain" else f"{event.test_id} ") + text)
        elif isinstance(event, LoadStopped):
            self.terminal.clear_status()
        elif isinstance(event, LoadEnded):
            self.terminal.clear_status()
            who = f"{event.test_id}: " if quiet else "  "
            self._line(
                f"{who}load {event.number} {'done' if event.ok else 'FAILED'}: {event.completed}/{event.total} "
                f"in {event.duration_s:.1f}s, {event.failed} failed, {event.output_throughput:.1f} output "
                f"tok/s, peak {format_bytes(event.peak_bytes)}"
            )


# ---- the pytest adapter's terminal ----------------------------------------------------------------------------


class _Reporter(Protocol):
    """The parts of pytest's TerminalReporter used here."""

    def write_line(self, line: str, **markup: bool) -> None: ...

    def rewrite(self, line: str, **markup: bool) -> None: ...

    def ensure_newline(self) -> None: ...

    def flush(self) -> None: ...


class _Capture(Protocol):
    def global_and_fixture_disabled(self) -> Any: ...


class PytestTerminal:
    """Writes through pytest's terminal reporter with output capture suspended (the tuner's progress does the same).

    Called from the main thread during a startup and from a load's progress thread during a load; in both cases the
    main thread is inside the plugin (waiting for health, or in the load), not in test code."""

    def __init__(self, reporter: _Reporter, capture: _Capture | None, width: int) -> None:
        self.reporter = reporter
        self.capture = capture
        self.width = width
        self._status_shown = False

    @contextmanager
    def _uncaptured(self) -> Iterator[None]:
        if self.capture is None:
            yield
            return
        with self.capture.global_and_fixture_disabled():
            yield

    def _clear(self) -> None:
        if self._status_shown:
            self.reporter.rewrite("", erase=True)
            self.reporter.rewrite("")
            self._status_shown = False

    def line(self, text: str) -> None:
        with self._uncaptured():
            self._clear()
            self.reporter.write_line(text)
            self.reporter.flush()

    def status(self, text: str) -> None:
        with self._uncaptured():
            if not self._status_shown:
                self.reporter.ensure_newline()  # off pytest's "file.py ..." line; pytest starts a new one after
                self._status_shown = True
            self.reporter.rewrite(text, erase=True)
            self.reporter.flush()

    def clear_status(self) -> None:
        if self._status_shown:
            with self._uncaptured():
                self._clear()
                self.reporter.flush()


def choose_mode(setting: str, isatty: bool, *, worker: bool) -> Mode | None:
    """The rendering for `--vllm-progress` (auto|line|plain|off); None: off. xdist workers: off (their terminal
    belongs to the controller; the records and the summary still carry every figure)."""
    if setting not in MODES:
        raise UsageError(
            f"--vllm-progress={setting!r} is not a progress mode: use auto (an updating line on a "
            "terminal, plain lines otherwise, e.g. in CI logs), line, plain, or off."
        )
    if setting == "off" or worker:
        return None
    if setting == "auto":
        return "line" if isatty else "plain"
    return setting  # type: ignore[return-value]


def pytest_renderer(config: Any, setting: str) -> Renderer | None:
    """The renderer for a pytest session (`config`: pytest.Config), or None when progress is off: --vllm-progress=off,
    an xdist worker, no terminal reporter (-p no:terminal). Built at first use: pytest's terminal reporter is
    registered after this plugin's pytest_configure has run."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return None
    mode = choose_mode(setting, bool(reporter.isatty()), worker=hasattr(config, "workerinput"))
    if mode is None:
        return None
    terminal = PytestTerminal(
        reporter, config.pluginmanager.get_plugin("capturemanager"), config.get_terminal_writer().fullwidth
    )
    return Renderer(terminal, mode, int(config.get_verbosity()))
