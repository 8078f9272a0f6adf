"""Live progress of server startups and loads: the core emits events, a renderer writes them to a terminal.

Core side (no pytest): `watch_startup(server)` reads the server's log incrementally while `_wait_healthy` polls and
emits the startup phases vLLM logs (diagnose's startup_milestone and line_figures), with elapsed time and the running
memory peak; `watch_load(counts, total)` starts a thread that reads a load's counters at its own rate (the load client
itself does nothing per request for progress). Both emit only while an `Observer` is active in the calling context
(`with observing(observer): ...`, a ContextVar), so the server pool, the session and the tuner need no new
parameters, and a run without an observer pays one ContextVar lookup per startup and per load.

Rendering side: `Renderer` turns events into one updating status line (a terminal) or plain lines at phase changes
and at most every `plain_every_s` (CI logs), by verbosity (-q: outcomes only, -qq: nothing, -v: every phase line and
the wall clock). `PytestTerminal` writes past pytest's output capture, as the tuner's progress does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

from pytest_vllm_mem.diagnosis.diagnose import (
    PRE_STARTUP_PHASE,
    STARTUP_PHASES,
    line_figures,
    startup_milestone,
    strip_log_prefix,
)
from pytest_vllm_mem.units import format_bytes

if TYPE_CHECKING:
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.diagnosis.diagnose import StartupMemory
    from pytest_vllm_mem.launch.server import StartupOutcome, VLLMServer
    from pytest_vllm_mem.load.client import LoadResult

MODES = ("auto", "line", "plain", "off")
Mode = Literal["line", "plain"]
PREFIX = "[vllm-mem]"
READY = STARTUP_PHASES[-1]  # "serving": "Application startup complete"


# ---- events ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """What the log said so far (None: not printed yet, or not by this vLLM); fields named as StartupMemory's."""

    weights_gib: float | None = None
    weights_load_s: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    graph_capture_gib: float | None = None
    graph_capture_s: float | None = None
    engine_init_s: float | None = None

    def describe(self) -> list[str]:
        parts = []
        if self.weights_gib is not None:
            parts.append(
                f"weights {self.weights_gib:.2f} GiB"
                + (f" in {self.weights_load_s:.1f}s" if self.weights_load_s is not None else "")
            )
        if self.kv_cache_gib is not None or self.kv_cache_tokens is not None:
            kv = [f"{self.kv_cache_gib:.2f} GiB"] if self.kv_cache_gib is not None else []
            kv += [f"{self.kv_cache_tokens:,} tokens"] if self.kv_cache_tokens is not None else []
            parts.append("KV cache " + ", ".join(kv))
        if self.graph_capture_gib is not None:
            parts.append(f"graphs {self.graph_capture_gib:.2f} GiB in {self.graph_capture_s:.1f}s")
        if self.engine_init_s is not None:
            parts.append(f"engine init {self.engine_init_s:.1f}s")
        return parts

    @classmethod
    def of(cls, memory: StartupMemory) -> Figures:
        return cls(**{name: getattr(memory, name) for name in _FIGURE_NAMES})


_FIGURE_NAMES = frozenset(f.name for f in fields(Figures))


@dataclass(frozen=True)
class StartupBegan:
    test_id: str
    config: str  # model and distinguishing flags of the config the test asked for
    log_path: str
    wall_time: float  # time.time() at launch


@dataclass(frozen=True)
class PhaseSeen:
    test_id: str
    phase: str  # diagnose's milestone name: what vLLM does from this log line on
    elapsed_s: float  # since launch, when the line was read (within one health poll of its writing)
    new_figures: tuple[str, ...]  # figures first read with this line or since the previous phase


@dataclass(frozen=True)
class StartupTick:
    test_id: str
    phase: str
    elapsed_s: float
    peak_bytes: int
    tier_bytes: int | None
    tier_name: str


@dataclass(frozen=True)
class StartupEnded:
    test_id: str
    ok: bool
    kind: str  # "started", a failure kind, or "interrupted"
    duration_s: float
    peak_bytes: int
    tier_bytes: int | None
    tier_name: str
    phase: str  # the last phase seen
    figures: Figures


@dataclass(frozen=True)
class ServerReused:
    test_id: str
    config: str
    pid: int
    up_s: float


@dataclass(frozen=True)
class NotStarted:
    test_id: str
    config: str
    kind: str
    summary: str


@dataclass(frozen=True)
class LoadTick:
    test_id: str
    number: int
    done: int
    failed: int
    total: int
    tok_per_s: float  # output tokens of requests completed in the last window, per second
    peak_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class LoadStopped:
    """The load's progress thread ended (the status line is cleared; LoadEnded follows unless the load raised)."""

    test_id: str


@dataclass(frozen=True)
class LoadEnded:
    test_id: str
    number: int
    completed: int
    failed: int
    total: int
    duration_s: float
    output_throughput: float
    peak_bytes: int
    ok: bool

    @classmethod
    def of(cls, test_id: str, number: int, result: LoadResult) -> LoadEnded:
        """From the measured result: the figures the results JSON keeps."""
        return cls(
            test_id,
            number,
            result.completed,
            result.failed,
            result.num_prompts,
            result.duration_s,
            result.output_throughput,
            result.peak_memory_bytes or 0,
            result.ok,
        )


Event = (
    StartupBegan
    | PhaseSeen
    | StartupTick
    | StartupEnded
    | ServerReused
    | NotStarted
    | LoadTick
    | LoadStopped
    | LoadEnded
)


# ---- the active observer --------------------------------------------------------------------------------------


@dataclass
class Observer:
    """Where events go while a test starts a server or runs a load, and what they are about."""

    emit: Callable[[Event], None]
    test_id: str = ""
    tier_bytes: int | None = None
    tier_name: str = ""
    server: VLLMServer | None = None  # the server a load runs against (its sampler gives the peak)
    tick_s: float = 0.5  # how often watches offer a status (the renderer decides what it shows)
    startups: int = 0  # startups watched under this observer: none means the pool reused a server


_ACTIVE: ContextVar[Observer | None] = ContextVar("pytest_vllm_mem_progress", default=None)


@contextmanager
def observing(observer: Observer | None) -> Iterator[Observer | None]:
    """Startups and loads run inside the block are shown through `observer` (None: not shown)."""
    token = _ACTIVE.set(observer)
    try:
        yield observer
    finally:
        _ACTIVE.reset(token)


def config_label(config: VLLMConfig) -> str:
    """The model's name and the config's distinguishing flags: `tiny gpu-memory-utilization=0.1 max-model-len=1024`."""
    return f"{Path(config.model).name} {config.short_id()}"


def send(observer: Observer, event: Event) -> None:
    try:
        observer.emit(event)
    except (OSError, ValueError):  # progress must never fail a startup or a load (a broken pipe, a closed file)
        return


# ---- startup: the log tail ------------------------------------------------------------------------------------

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

    def finish(self, outcome: StartupOutcome | None, memory: StartupMemory | None = None) -> None: ...


class _NoWatch:
    def poll(self) -> None:
        pass

    def finish(self, outcome: StartupOutcome | None, memory: StartupMemory | None = None) -> None:
        pass


class StartupWatch:
    """One server startup under an observer: `poll()` from the health-poll loop, `finish()` once at the end."""

    def __init__(self, observer: Observer, server: VLLMServer) -> None:
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
        self._peak = max(self._peak, self.server.sampler.peak_between(self._peak_since))
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

    def finish(self, outcome: StartupOutcome | None, memory: StartupMemory | None = None) -> None:
        """`outcome` None: interrupted (Ctrl-C, a CI cancel). Figures from `memory`, the parse the results keep."""
        self._read()
        self.tail.close()
        obs = self.observer
        figures = Figures.of(memory) if memory is not None else self.reader.figures
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


def watch_startup(server: VLLMServer) -> Watch:
    """A watch on `server`'s startup when an observer is active, else one that does nothing."""
    observer = _ACTIVE.get()
    return StartupWatch(observer, server) if observer is not None else _NoWatch()


# ---- loads ----------------------------------------------------------------------------------------------------

Counts = Callable[[], "tuple[int, int, int]"]  # (completed, failed, output tokens of completed requests)


class LoadWatch:
    """A thread that reads a load's counters every `tick_s` and emits them; the load itself is never called back."""

    WINDOW_S = 5.0  # tok/s over the last few seconds: requests complete in bursts

    def __init__(self, observer: Observer, counts: Counts, total: int) -> None:
        self.observer = observer
        self.counts = counts
        self.total = total
        server = observer.server
        self.number = server.loads_run if server is not None else 0
        self.started = time.monotonic()
        self._history: deque[tuple[float, int]] = deque([(self.started, 0)])
        self._peak = 0
        self._peak_since = self.started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-mem-load-progress", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        done, failed, tokens = self.counts()
        now = time.monotonic()
        self._history.append((now, tokens))
        while len(self._history) > 2 and now - self._history[1][0] >= self.WINDOW_S:
            self._history.popleft()
        t0, tokens0 = self._history[0]
        rate = (tokens - tokens0) / (now - t0) if now > t0 else 0.0
        server = self.observer.server
        if server is not None:
            self._peak = max(self._peak, server.sampler.peak_between(self._peak_since))
            self._peak_since = now
        obs = self.observer
        send(obs, LoadTick(obs.test_id, self.number, done, failed, self.total, rate, self._peak, now - self.started))

    def _run(self) -> None:
        while not self._stop.wait(self.observer.tick_s):
            self._tick()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        send(self.observer, LoadStopped(self.observer.test_id))


class _NoLoadWatch:
    def close(self) -> None:
        pass


def watch_load(counts: Counts, total: int) -> LoadWatch | _NoLoadWatch:
    """A progress thread over a running load when an observer is active, else nothing."""
    observer = _ACTIVE.get()
    return LoadWatch(observer, counts, total) if observer is not None else _NoLoadWatch()


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
        from pytest_vllm_mem.settings import UsageError

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
