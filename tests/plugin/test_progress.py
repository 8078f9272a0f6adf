"""Live progress without servers: phases and figures from real logs, the incremental log tail, the startup and load
watches, the renderer (status line vs plain lines, rate limits, -q/-v) and the pytest adapter past output capture."""

from __future__ import annotations

import ast
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_vllm_mem import progress
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import parse_startup_memory
from pytest_vllm_mem.launch import watch as startup_watch
from pytest_vllm_mem.launch.server import StartupOutcome
from pytest_vllm_mem.launch.watch import LogTail, StartupReader, figures_of, watch_startup
from pytest_vllm_mem.plugin.terminal import Renderer, choose_mode
from pytest_vllm_mem.progress import (
    Event,
    Figures,
    LoadEnded,
    LoadStopped,
    LoadTick,
    Observer,
    PhaseSeen,
    StartupBegan,
    StartupEnded,
    StartupTick,
    observing,
    watch_load,
)
from pytest_vllm_mem.settings import UsageError

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"
STARTED = LOGS / "cpu-0.32-started.log"
# GPU lines as vLLM 0.3x prints them (shared/DESIGN.md), in startup order.
GPU_LINES = [
    "(EngineCore pid=7) INFO 11-30 04:58:51 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: x",
    "(Worker pid=9) INFO 11-30 04:58:57 [gpu_model_runner.py:1] Starting to load model meta-llama/Llama-2-7b-hf...",
    "(Worker pid=9) INFO 11-30 04:59:03 [gpu_model_runner.py:2] Model loading took 12.55 GiB memory and 5.123456 "
    "seconds",
    "(Worker pid=9) INFO 11-30 04:59:09 [gpu_worker.py:3] Available KV cache memory: 6.42 GiB",
    "(EngineCore pid=7) INFO 11-30 04:59:09 [kv_cache_utils.py:4] GPU KV cache size: 13,136 tokens, Maximum "
    "concurrency for 4,096 tokens per request: 3.21x",
    "(Worker pid=9) INFO 11-30 04:59:21 [gpu_model_runner.py:5] Graph capturing finished in 12 secs, took 0.53 GiB",
    "(EngineCore pid=7) INFO 11-30 04:59:22 [core.py:6] init engine (profile, create kv cache, warmup model) took "
    "19.65 s",
    "(APIServer pid=5) INFO 11-30 04:59:23 [launcher.py:7] Starting vLLM server on http://0.0.0.0:8000",
]


def test_reader_sees_the_phases_of_a_real_cpu_startup_in_order() -> None:
    reader = StartupReader()
    phases = [phase for line in STARTED.read_text().splitlines() if (phase := reader.feed(line))]
    assert phases == [
        "initializing the engine",
        "loading the weights",
        "profiling memory (compile and dummy forward pass)",
        "allocating the KV cache",
        "starting the API server",
        "serving",
    ]
    # The figures the reader shows are those the results JSON keeps (diagnose's parse of the same log).
    memory = parse_startup_memory(STARTED.read_text())
    assert (
        reader.figures.kv_cache_gib == memory.kv_cache_gib and reader.figures.kv_cache_tokens == memory.kv_cache_tokens
    )
    assert reader.figures.engine_init_s == memory.engine_init_s
    assert reader.figures == figures_of(memory)


def test_reader_reads_gpu_figures_and_attaches_them_to_the_phase_they_came_with() -> None:
    reader = StartupReader()
    seen = []
    for line in GPU_LINES:
        phase = reader.feed(line)
        if phase:
            seen.append((phase, reader.take_new_figures()))
    assert seen[2] == ("profiling memory (compile and dummy forward pass)", ("weights 12.55 GiB in 5.1s",))
    assert seen[3] == ("allocating the KV cache", ("KV cache 6.42 GiB",))
    assert seen[4] == ("warming up", ("KV cache 6.42 GiB, 13,136 tokens", "graphs 0.53 GiB in 12.0s"))
    assert seen[-1][0] == "serving"
    assert reader.figures.describe() == [
        "weights 12.55 GiB in 5.1s",
        "KV cache 6.42 GiB, 13,136 tokens",
        "graphs 0.53 GiB in 12.0s",
        "engine init 19.6s",
    ]


def test_a_phase_never_goes_back() -> None:
    reader = StartupReader()
    assert reader.feed(GPU_LINES[3]) == "allocating the KV cache"
    assert reader.feed(GPU_LINES[1]) is None  # a second rank loading late does not move the phase back
    assert reader.phase == "allocating the KV cache"


def test_the_first_figure_stays_and_figures_outside_the_progress_are_left_out() -> None:
    reader = StartupReader()
    cpu_kv = next(line for line in STARTED.read_text().splitlines() if "GiB for KV cache" in line)
    assert reader.feed(cpu_kv) == "allocating the KV cache"
    assert reader.take_new_figures() == ("KV cache 0.21 GiB",)  # the node total (10.46 GiB) is not a progress figure
    other_rank = cpu_kv.replace("(0.21/10.46)", "(0.25/10.46)")
    assert reader.feed(other_rank) is None and reader.take_new_figures() == ()
    assert reader.figures == Figures(kv_cache_gib=0.21)


def test_progress_reads_the_log_through_diagnoses_public_names_only() -> None:
    tree = ast.parse(Path(startup_watch.__file__).read_text())
    imported = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "pytest_vllm_mem.diagnosis.diagnose"
        for alias in node.names
    ]
    assert "startup_milestone" in imported and "line_figures" in imported
    assert [name for name in imported if name.startswith("_")] == []


def test_log_tail_yields_complete_lines_only_across_reads(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    tail = LogTail(path)
    assert tail.new_lines() == []  # not created yet
    with open(path, "wb", buffering=0) as log:
        log.write(b"first line\nsecond ha")
        assert tail.new_lines() == ["first line"]
        assert tail.new_lines() == []
        log.write(b"lf\nLoading shards:  50%\rLoading shards: 100%\r")
        assert tail.new_lines() == ["second half", "Loading shards:  50%", "Loading shards: 100%"]
    tail.close()


@dataclass
class FakeSampler:
    samples: list[tuple[float, int]] = field(default_factory=list)

    def peak_between(self, t0: float, t1: float | None = None) -> int:
        return max((b for t, b in self.samples if t >= t0 and (t1 is None or t <= t1)), default=0)


@dataclass
class FakeServer:
    log_path: Path
    started_at: float
    sampler: FakeSampler
    config: VLLMConfig = field(default_factory=lambda: VLLMConfig("/models/tiny", gpu_memory_utilization=0.1))
    loads_run: int = 1

    def peak_between(self, since: float) -> int:
        return self.sampler.peak_between(since)


def test_startup_watch_emits_phases_ticks_and_the_outcome(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    sampler = FakeSampler()
    server = FakeServer(log, time.monotonic(), sampler)
    events: list[Event] = []
    observer = Observer(events.append, "t.py::test[A]", 24 * 10**9, "24gb", tick_s=0.0)
    assert isinstance(watch_startup(server), startup_watch._NoWatch)  # no observer: nothing
    with observing(observer):
        watch = watch_startup(server)
    with open(log, "a") as out:
        for index, line in enumerate(GPU_LINES):
            out.write(line + "\n")
            out.flush()
            sampler.samples.append((time.monotonic(), (index + 1) * 2**30))
            watch.poll()
    outcome = StartupOutcome(True, "started", 19.7, 9 * 2**30)
    watch.finish(outcome, parse_startup_memory("\n".join(GPU_LINES)))
    began, *middle, ended = events
    assert isinstance(began, StartupBegan) and began.config == "tiny gpu-memory-utilization=0.1"
    phases = [event.phase for event in middle if isinstance(event, PhaseSeen)]
    assert phases[0] == "initializing the engine" and phases[-1] == "serving" and len(phases) == 7
    ticks = [event for event in middle if isinstance(event, StartupTick)]
    assert ticks and ticks[-1].peak_bytes == 8 * 2**30  # the running peak, read incrementally
    assert isinstance(ended, StartupEnded) and ended.ok and ended.duration_s == 19.7
    assert ended.peak_bytes == 9 * 2**30 and ended.figures.kv_cache_tokens == 13136
    assert observer.startups == 1


def test_interrupted_startup_ends_its_progress(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(GPU_LINES[0] + "\n")
    events: list[Event] = []
    with observing(Observer(events.append, "t", tick_s=60)):
        watch = watch_startup(FakeServer(log, time.monotonic(), FakeSampler()))
    watch.finish(None)
    assert isinstance(events[-1], StartupEnded) and events[-1].kind == "interrupted"
    assert events[-1].phase == "initializing the engine"


def test_load_watch_reads_counters_on_its_own_thread() -> None:
    counts = [0, 0, 0]
    threads: set[str] = set()

    def read() -> tuple[int, int, int]:
        threads.add(threading.current_thread().name)
        return counts[0], counts[1], counts[2]

    events: list[Event] = []
    sampler = FakeSampler([(time.monotonic() + 0.01, 3 * 2**30)])
    server = FakeServer(Path("x"), time.monotonic(), sampler, loads_run=2)
    with observing(Observer(events.append, "t", peak_between=server.peak_between, load_number=lambda: 2, tick_s=0.02)):
        watch = watch_load(read, 10)
    for done in range(1, 11):
        counts[:] = [done, 0, done * 16]
        time.sleep(0.03)
    watch.close()
    ticks = [event for event in events if isinstance(event, LoadTick)]
    assert isinstance(events[-1], LoadStopped)
    assert ticks[-1].done == 10 and ticks[-1].total == 10 and ticks[-1].number == 2
    assert ticks[-1].tok_per_s > 0 and ticks[-1].peak_bytes == 3 * 2**30
    assert threads == {"vllm-mem-load-progress"}  # never the load's own thread
    assert isinstance(watch_load(read, 10), progress._NoLoadWatch)  # no observer: no thread


def test_run_load_offers_its_counters_only_under_an_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_vllm_mem.load import client as load

    seen: list[int] = []

    class Spy:
        def __init__(self, counts: progress.Counts, total: int) -> None:
            seen.append(total)
            self.counts = counts

        def close(self) -> None:
            seen.append(self.counts()[1])  # the refused connections are counted by then

    monkeypatch.setattr(load, "watch_load", Spy)
    result = load.run_load("http://127.0.0.1:9", "m", num_prompts=3, concurrency=1, max_tokens=1)
    assert result.failed == 3 and seen == [3, 3]


# ---- rendering ------------------------------------------------------------------------------------------------


class Screen:
    def __init__(self, width: int = 60) -> None:
        self.width = width
        self.lines: list[str] = []
        self.statuses: list[str] = []
        self.clears = 0

    def line(self, text: str) -> None:
        self.lines.append(text)

    def status(self, text: str) -> None:
        self.statuses.append(text)

    def clear_status(self) -> None:
        self.clears += 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


FIGS = Figures(kv_cache_gib=1.0, kv_cache_tokens=524288)


def startup(render: Renderer, clock: Clock) -> None:
    render(StartupBegan("t[A]", "tiny max-model-len=1024", "/logs/1.log", 0.0))
    for second in range(0, 30):
        clock.now += 1
        render(StartupTick("t[A]", "loading the weights", second, 2**30, 24 * 10**9, "24gb"))
        if second in (3, 4):
            render(PhaseSeen("t[A]", f"phase {second}", second, ()))
    render(StartupEnded("t[A]", True, "started", 30.0, 2**31, 24 * 10**9, "24gb", "serving", FIGS))


def test_plain_lines_at_phase_changes_and_at_most_every_few_seconds() -> None:
    screen, clock = Screen(), Clock()
    startup(Renderer(screen, "plain", 0, plain_every_s=5.0, clock=clock), clock)
    assert screen.statuses == []
    assert screen.lines[0] == "[vllm-mem] t[A]: starting tiny max-model-len=1024"
    assert "[vllm-mem]   +3.0s phase 3" in screen.lines and "[vllm-mem]   +4.0s phase 4" in screen.lines
    heartbeats = [line for line in screen.lines if "still loading the weights" in line]
    assert 4 <= len(heartbeats) <= 6  # 30 ticks a second apart: one line per 5 s of silence
    assert heartbeats[0].endswith("peak 1.00 GiB of the 24gb tier (4%)")
    assert screen.lines[-1] == (
        "[vllm-mem]   ready in 30.0s: KV cache 1.00 GiB, 524,288 tokens; peak 2.00 GiB of the 24gb tier (9%)"
    )


def test_status_line_updates_at_a_modest_rate_and_fits_the_terminal() -> None:
    screen, clock = Screen(width=50), Clock()
    render = Renderer(screen, "line", 0, status_every_s=2.0, clock=clock)
    startup(render, clock)
    assert 15 <= len(screen.statuses) <= 18  # 30 s of ticks at one per 2 s, plus the two phases at once
    assert all(len(status) <= 49 for status in screen.statuses)
    assert [line for line in screen.lines if "phase" in line] == []  # phases go to the status line
    assert len(screen.lines) == 2 and screen.clears >= 1  # header and outcome stay; the status is cleared


def test_quiet_shows_outcomes_only_and_very_quiet_nothing() -> None:
    for verbosity, expected in ((-1, 2), (-2, 0)):
        screen, clock = Screen(), Clock()
        render = Renderer(screen, "plain", verbosity, clock=clock)
        startup(render, clock)
        render(LoadTick("t[A]", 1, 5, 0, 10, 100.0, 2**30, 1.0))
        render(LoadEnded("t[A]", 1, 10, 0, 10, 2.0, 320.0, 2**30, True))
        assert len(screen.lines) == expected and screen.statuses == []
    assert screen.lines == [] and render.verbosity == -2


def test_quiet_outcome_lines_name_the_test() -> None:
    screen, clock = Screen(), Clock()
    render = Renderer(screen, "line", -1, clock=clock)
    startup(render, clock)
    assert screen.lines == [
        "[vllm-mem] t[A]: ready in 30.0s: KV cache 1.00 GiB, 524,288 tokens; peak 2.00 GiB of the 24gb tier (9%)"
    ]


def test_verbose_shows_every_phase_line_and_the_wall_clock_on_a_terminal_too() -> None:
    screen, clock = Screen(), Clock()
    render = Renderer(screen, "line", 1, clock=clock)
    wall = time.mktime((2026, 12, 1, 9, 12, 3, 0, 0, -1)) + 0.42
    render(StartupBegan("t[A]", "tiny", "/logs/1.log", wall))
    render(PhaseSeen("t[A]", "loading the weights", 4.25, ()))
    assert screen.lines == [
        "[vllm-mem] t[A]: starting tiny (at 09:12:03.4, log /logs/1.log)",
        "[vllm-mem]   +4.2s loading the weights",
    ]


def test_failed_startup_says_kind_and_phase() -> None:
    screen = Screen()
    Renderer(screen, "plain")(
        StartupEnded("t", False, "host_memory", 12.3, 2**30, None, "", "allocating the KV cache", Figures())
    )
    assert screen.lines == [
        "[vllm-mem]   failed [host_memory] after 12.3s while allocating the KV cache; peak 1.00 GiB"
    ]


def test_load_lines_in_plain_mode() -> None:
    screen, clock = Screen(), Clock()
    render = Renderer(screen, "plain", 0, plain_every_s=5.0, clock=clock)
    for second in range(12):
        clock.now += 1
        render(LoadTick("t", 1, second * 4, 0, 48, 150.0, 2**30, second))
    render(LoadStopped("t"))
    render(LoadEnded("t", 1, 48, 0, 48, 12.5, 153.04, 2**30, True))
    assert screen.lines == [
        "[vllm-mem]   load 1: 0/48 done, 0 failed, 150 tok/s, peak 1.00 GiB",
        "[vllm-mem]   load 1: 20/48 done, 0 failed, 150 tok/s, peak 1.00 GiB",
        "[vllm-mem]   load 1: 40/48 done, 0 failed, 150 tok/s, peak 1.00 GiB",
        "[vllm-mem]   load 1 done: 48/48 in 12.5s, 0 failed, 153.0 output tok/s, peak 1.00 GiB",
    ]


def test_a_broken_terminal_never_fails_the_run(tmp_path: Path) -> None:
    def broken(event: object) -> None:
        raise BrokenPipeError("gone")

    log = tmp_path / "l.log"
    log.write_text(GPU_LINES[0] + "\n")
    with observing(Observer(broken, "t", tick_s=0)):
        watch = watch_startup(FakeServer(log, time.monotonic(), FakeSampler()))
    watch.poll()
    watch.finish(None)


def test_modes() -> None:
    assert choose_mode("auto", True, worker=False) == "line"
    assert choose_mode("auto", False, worker=False) == "plain"
    assert choose_mode("line", False, worker=False) == "line"
    assert choose_mode("plain", True, worker=False) == "plain"
    assert choose_mode("off", True, worker=False) is None
    assert choose_mode("auto", True, worker=True) is None  # xdist workers: the terminal is the controller's
    with pytest.raises(UsageError, match="--vllm-progress='loud' is not a progress mode"):
        choose_mode("loud", True, worker=False)


# ---- the pytest adapter, in a real inner session (a fake launch: no vLLM) -------------------------------------

INNER_CONFTEST = """
import time
from pathlib import Path
from pytest_vllm_mem.launch import watch as progress
from pytest_vllm_mem.plugin import fixtures
from pytest_vllm_mem.diagnosis.diagnose import parse_startup_memory
from pytest_vllm_mem.launch.server import StartupOutcome
from pytest_vllm_mem.launch.pool import Session
from pytest_vllm_mem.tiers import Tier

LOG = Path("fake.log")
LINES = %r

class Sampler:
    def peak_between(self, t0, t1=None):
        return 2**30

class Server:
    pid = 4242
    def __init__(self, config):
        self.config = config
        self.log_path = LOG
        self.started_at = time.monotonic()
        self.sampler = Sampler()
        self.loads_run = 0
    def peak_between(self, since):
        return self.sampler.peak_between(since)

SERVERS = {}

def fake_start(self, config):
    if config in SERVERS:
        return SERVERS[config]
    LOG.write_text("")
    server = Server(config)
    watch = progress.watch_startup(server)
    with LOG.open("a") as log:
        for line in LINES:
            log.write(line + "\\n"); log.flush()
            watch.poll()
    watch.finish(StartupOutcome(True, "started", 1.5, 2**30), parse_startup_memory("\\n".join(LINES)))
    SERVERS[config] = server
    return server

Session.start = fake_start
Session.tier = property(lambda self: Tier("24gb", 24 * 10**9))
fixtures.record_for = lambda request, server: None  # the records need a real server; progress does not
"""

INNER_TEST = """
import pytest
from pytest_vllm_mem import VLLMConfig

@pytest.mark.parametrize("vllm_config", [VLLMConfig("tiny", max_model_len=512)], ids=["A"])
def test_first(vllm_server):
    print("the test's own output stays captured")

@pytest.mark.parametrize("vllm_config", [VLLMConfig("tiny", max_model_len=512)], ids=["again"])
def test_second(vllm_server):
    pass
"""


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(INNER_CONFTEST % (GPU_LINES,))
    pytester.makepyfile(test_inner=INNER_TEST)
    return pytester


def test_progress_reaches_the_terminal_past_capture_in_plain_lines(inner: pytest.Pytester) -> None:
    result = inner.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    lines = [line for line in out.splitlines() if line.startswith("[vllm-mem]")]
    assert lines[0] == "[vllm-mem] test_inner.py::test_first[A]: starting tiny max-model-len=512"
    assert any("+" in line and "initializing the engine" in line for line in lines)
    assert any("ready in 1.5s: weights 12.55 GiB in 5.1s; KV cache 6.42 GiB, 13,136 tokens" in line for line in lines)
    assert lines[-1].startswith(
        "[vllm-mem] test_inner.py::test_second[again]: reusing the server for tiny max-model-len=512 (pid 4242"
    )
    assert "the test's own output stays captured" not in out


def test_quiet_and_off(inner: pytest.Pytester) -> None:
    quiet = inner.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    lines = [line for line in quiet.stdout.lines if line.startswith("[vllm-mem]")]
    assert len(lines) == 1 and lines[0].startswith("[vllm-mem] test_inner.py::test_first[A]: ready in 1.5s")
    off = inner.runpytest_subprocess("-p", "no:cacheprovider", "--vllm-progress=off")
    off.assert_outcomes(passed=2)
    assert "[vllm-mem]" not in off.stdout.str()


def test_a_bad_progress_mode_is_a_usage_error(inner: pytest.Pytester) -> None:
    result = inner.runpytest_subprocess("-p", "no:cacheprovider", "--vllm-progress=loud")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "is not a progress mode: use auto" in result.stderr.str()
    assert "Traceback" not in result.stderr.str()
