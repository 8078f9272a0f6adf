"""Live progress of server startups and loads, as events: plain values, a Sink Protocol, the active Observer.

The core emits events; it names nothing of the server or the load. `launch/watch.py` reads a starting server's log
and emits the startup phases; `watch_load(counts, total)` here starts a thread that reads a load's counters at its own
rate (the load client itself does nothing per request for progress). Both emit only while an `Observer` is active in
the calling context (`with observing(observer): ...`, a ContextVar), so the server pool, the session and the tuner need
no new parameters, and a run without an observer pays one ContextVar lookup per startup and per load.

The terminal rendering (one updating status line, or plain lines in CI logs) is the pytest adapter's:
plugin/terminal.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

from pytest_vllm_mem.config import VLLMConfig

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
class PlacementWait:
    """A server waits for room on a cluster (its placement group is not placed: other servers hold the devices)."""

    test_id: str
    config: str
    waited_s: float


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


Event = (
    StartupBegan
    | PhaseSeen
    | StartupTick
    | StartupEnded
    | ServerReused
    | NotStarted
    | PlacementWait
    | LoadTick
    | LoadStopped
    | LoadEnded
)


class Sink(Protocol):
    """Where events go: a renderer (plugin/terminal.py), a list in a test, anything that takes one event."""

    def __call__(self, event: Event, /) -> None: ...


# ---- the active observer --------------------------------------------------------------------------------------


@dataclass
class Observer:
    """Where events go while a test starts a server or runs a load, and what they are about."""

    emit: Sink
    test_id: str = ""
    tier_bytes: int | None = None
    tier_name: str = ""
    # The running peak of the server a load runs against (its sampler's peak_between), and which of its loads runs
    # now; None / 0 when the observer watches no load.
    peak_between: Callable[[float], int] | None = None
    load_number: Callable[[], int] = lambda: 0
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


def active_observer() -> Observer | None:
    """The observer of the calling context, None when nothing is shown (launch/watch.py watches startups with it)."""
    return _ACTIVE.get()


def config_label(config: VLLMConfig) -> str:
    """The model's name and the config's distinguishing flags: `tiny gpu-memory-utilization=0.1 max-model-len=1024`."""
    return f"{Path(config.model).name} {config.short_id()}"


def send(observer: Observer, event: Event) -> None:
    try:
        observer.emit(event)
    except (OSError, ValueError):  # progress must never fail a startup or a load (a broken pipe, a closed file)
        return


# ---- loads ----------------------------------------------------------------------------------------------------

Counts = Callable[[], "tuple[int, int, int]"]  # (completed, failed, output tokens of completed requests)


class LoadWatch:
    """A thread that reads a load's counters every `tick_s` and emits them; the load itself is never called back."""

    WINDOW_S = 5.0  # tok/s over the last few seconds: requests complete in bursts

    def __init__(self, observer: Observer, counts: Counts, total: int) -> None:
        self.observer = observer
        self.counts = counts
        self.total = total
        self.number = observer.load_number()
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
        peak_between = self.observer.peak_between
        if peak_between is not None:
            self._peak = max(self._peak, peak_between(self._peak_since))
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
