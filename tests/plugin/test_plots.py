"""plots.py: the memory timeline PNG (size, content cases), the per-server file name, the vLLM log step times."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from pytest_vllm_mem.baseline.results import TestRecord
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import StartupMemory
from pytest_vllm_mem.plugin import plots
from pytest_vllm_mem.plugin.plots import (
    log_event_times,
    phase_windows,
    plot_filename,
    plot_record,
    plot_timeline,
    startup_breakdown,
    tier_text,
)

GIB = 2**30
T0 = 1000.0  # a monotonic launch time


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def startup_and_loads() -> tuple[list[tuple[float, int]], list[tuple[str, float]]]:
    """40 s startup rising to 6 GiB, two 3-second loads that add up to 1 GiB, one sample every 0.1 s."""
    samples = []
    for i in range(500):
        t = i * 0.1
        used = min(t / 40, 1.0) * 6 * GIB
        if 41 <= t <= 44 or 45 <= t <= 48:
            used += GIB * 0.5
        samples.append((T0 + t, int(used)))
    markers = [
        ("launch", T0),
        ("healthy", T0 + 40.5),
        ("load 1", T0 + 41),
        ("load end", T0 + 44),
        ("load 2", T0 + 45),
        ("load end", T0 + 48),
    ]
    return samples, markers


@pytest.fixture
def drawn_texts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every string the plot draws with Axes.text or Axes.annotate."""
    from matplotlib.axes import Axes

    texts: list[str] = []
    text, annotate = Axes.text, Axes.annotate

    def recorded_text(self: Axes, x: float, y: float, s: str, *a: Any, **k: Any) -> Any:
        texts.append(s)
        return text(self, x, y, s, *a, **k)

    def recorded_annotate(self: Axes, s: str, *a: Any, **k: Any) -> Any:
        texts.append(s)
        return annotate(self, s, *a, **k)

    monkeypatch.setattr(Axes, "text", recorded_text)
    monkeypatch.setattr(Axes, "annotate", recorded_annotate)
    return texts


def test_plot_timeline_writes_a_1000x450_png(tmp_path: Path) -> None:
    samples, markers = startup_and_loads()
    path = plot_timeline(
        samples,
        markers,
        path=tmp_path / "sub" / "t.png",
        title="tiny gmu=0.5",
        tier_bytes=8 * 10**9,
        tier_label="8gb",
        phases={"weights loaded": 12.5},
        breakdown={"weights": 1.5, "KV cache": 3.2},
    )
    assert path == tmp_path / "sub" / "t.png"
    assert png_size(path) == (1000, 450)
    assert not list(path.parent.glob(".*.tmp")), "the temporary file was replaced into place"


@pytest.mark.parametrize(
    "samples, markers",
    [
        ([], []),  # the sampler recorded nothing
        ([], [("launch", T0), ("healthy", T0 + 3)]),
        ([(T0 + 1, GIB)], []),  # one sample, no markers
        ([(T0, GIB), (T0 + 1, 2 * GIB)], [("launch", T0), ("load 1", T0 + 0.5)]),  # load never ended
        ([(T0, 0), (T0 + 1, 0)], [("launch", T0), ("healthy", T0 + 0.2)]),  # all zero: y range must not collapse
    ],
    ids=["empty", "markers-only", "one-sample", "unfinished-load", "all-zero"],
)
def test_plot_timeline_degenerate_inputs_still_plot(
    tmp_path: Path, samples: list[tuple[float, int]], markers: list[tuple[str, float]]
) -> None:
    path = plot_timeline(samples, markers, path=tmp_path / "t.png", title="t", tier_bytes=None, tier_label=None)
    assert png_size(path) == (1000, 450)


def test_empty_samples_say_so(tmp_path: Path, drawn_texts: list[str]) -> None:
    plot_timeline([], [], path=tmp_path / "t.png", title="t", tier_bytes=None, tier_label=None)
    assert any("no samples" in text for text in drawn_texts)


def test_plot_timeline_labels_tier_and_peak(tmp_path: Path, drawn_texts: list[str]) -> None:
    texts = drawn_texts
    samples, markers = startup_and_loads()
    plot_timeline(samples, markers, path=tmp_path / "t.png", title="t", tier_bytes=8 * 10**9, tier_label="8gb")
    assert "8gb tier (8.0 GB) = 7.45 GiB" in texts
    peak = next(text for text in texts if text.startswith("peak"))
    assert peak.startswith("peak 6.50 GiB = 87% of the tier") and "(load 1)" in peak
    assert "load 1" in texts and "load 2" in texts


def test_tier_far_above_the_peak_is_noted_not_drawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[float] = []
    from matplotlib.axes import Axes

    original = Axes.axhline

    def recorded(self: Axes, y: float = 0, *a: Any, **k: Any) -> Any:
        lines.append(y)
        return original(self, y, *a, **k)

    monkeypatch.setattr(Axes, "axhline", recorded)
    samples = [(T0 + i, GIB) for i in range(10)]
    plot_timeline(
        samples, [("launch", T0)], path=tmp_path / "t.png", title="t", tier_bytes=141 * 10**9, tier_label="141gb"
    )
    assert lines == []


def test_tier_text() -> None:
    assert tier_text("24gb", 24 * 10**9) == "24gb tier (24.0 GB)"


def test_phase_windows_pair_each_load_with_the_next_load_end() -> None:
    markers = [("launch", 10.0), ("healthy", 40.0), ("load 1", 41.0), ("load end", 43.0), ("load 2", 50.0)]
    windows = phase_windows(markers, origin=10.0, last=60.0)
    assert [(w.label, w.start, w.end) for w in windows] == [
        ("startup 30 s", 0.0, 30.0),
        ("load 1", 31.0, 33.0),
        ("load 2 (unfinished)", 40.0, 50.0),
    ]
    assert windows[1].color != windows[2].color
    assert phase_windows([("launch", 0.0)], 0.0, 5.0)[0].label == "startup (never healthy)"


def test_log_event_times_come_from_the_line_stamps() -> None:
    launch_wall = time.mktime((2025, 11, 30, 4, 58, 40, 0, 0, -1))
    log = "\n".join(
        [
            "(APIServer pid=1) INFO 11-30 04:58:46 [api_utils.py:286] non-default args: {}",
            "(Worker pid=3) INFO 11-30 04:58:57 [cpu_model_runner.py:68] Starting to load model tiny...",
            "\x1b[1;36m(Worker pid=3)\x1b[0;0m INFO 11-30 04:58:58 [default_loader.py:501] Loading weights took 0.00 s",
            "(Worker pid=3) INFO 11-30 04:59:03 [cpu_worker.py:260] Explicitly set (1.0/10.46) GiB for KV cache on node 0.",
            "(EngineCore pid=2) INFO 11-30 04:59:05 [core.py:402] init engine (profile, create kv cache, warmup model) "
            "took 6.96 s",
            "(EngineCore pid=2) INFO 11-30 04:59:06 [core.py:402] init engine (profile, create kv cache, warmup model) "
            "took 1.00 s",  # a second occurrence: the first one counts
            "init engine (profile, create kv cache, warmup model) took 6.96 s",  # no stamp: ignored
        ]
    )
    assert log_event_times(log, launch_wall) == {
        "weights loading": 17.5,
        "weights loaded": 18.5,
        "KV cache sized": 23.5,
        "engine ready": 25.5,
    }


def test_log_event_times_drop_stamps_from_before_the_launch() -> None:
    launch_wall = time.mktime((2025, 11, 30, 5, 0, 0, 0, 0, -1))
    log = "(Worker pid=3) INFO 11-30 04:58:57 [cpu_model_runner.py:68] Starting to load model tiny..."
    assert log_event_times(log, launch_wall) == {}


def test_startup_breakdown_lists_what_vllm_printed() -> None:
    memory = StartupMemory(
        weights_gib=12.55,
        weights_load_s=5.1,
        kv_cache_gib=6.42,
        graph_capture_gib=0.53,
        graph_capture_s=12.0,
        requested_gib=20.1,
    )
    assert startup_breakdown(memory) == {
        "weights (5 s)": 12.55,
        "KV cache": 6.42,
        "CUDA graphs (12 s)": 0.53,
        "requested": 20.1,
    }
    assert startup_breakdown(StartupMemory(kv_cache_gib=0.04, non_kv_gib=0.71)) == {
        "KV cache": 0.04,
        "non-KV total": 0.71,
    }
    assert startup_breakdown(None) == {}


# -- plot_record ------------------------------------------------------------------------------------------------------


@dataclass
class FakeTimeline:
    samples: list[tuple[float, int]]
    markers: list[tuple[str, float]]


@dataclass
class FakeServer:
    """What plots.plot_record reads of a server (plots.PlottedServer)."""

    config: VLLMConfig
    launched: VLLMConfig
    pid: int
    sampler: FakeTimeline
    memory: StartupMemory | None = None
    log: str = ""
    started_at: float = T0

    def log_text(self) -> str:
        return self.log


def fake_server(
    pid: int = 4242, config: VLLMConfig | None = None, *, log: str = "", memory: StartupMemory | None = None
) -> FakeServer:
    samples, markers = startup_and_loads()
    config = config or VLLMConfig("org/Model-7B", gpu_memory_utilization=0.5, max_model_len=1024)
    return FakeServer(config, config, pid, FakeTimeline(samples, markers), memory, log)


RECORD = TestRecord(
    test_id="tests/test_a.py::test_x[A]",
    config="vllm serve org/Model-7B",
    launched="vllm serve org/Model-7B",
    tier="24gb",
    tier_bytes=24 * 10**9,
    device="NVIDIA L4",
    backend="cuda",
    vllm_version="0.32.0",
)


def fake_record(**changes: Any) -> TestRecord:
    return replace(RECORD, **changes)


def test_plot_record_names_the_file_by_server_and_config(tmp_path: Path) -> None:
    server = fake_server(memory=StartupMemory(weights_gib=1.0, kv_cache_gib=4.0))
    path = plot_record(fake_record(), server, tmp_path / "plots")
    assert path == tmp_path / "plots" / "4242-Model-7B-gpu-memory-utilization=0.5_max-model-len=1024.png"
    assert png_size(path) == (1000, 450)


def test_tests_sharing_a_server_share_one_file(tmp_path: Path) -> None:
    server = fake_server()
    first = plot_record(fake_record(test_id="t::a"), server, tmp_path)
    second = plot_record(fake_record(test_id="t::b"), server, tmp_path)
    other = plot_record(fake_record(), fake_server(pid=99), tmp_path)
    assert first == second != other
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({first.name, other.name})


def test_plot_record_cpu_failed_and_startup_error(tmp_path: Path) -> None:
    server = fake_server(config=VLLMConfig("tiny"))
    # A failed startup: the stopped server, its record failed.
    path = plot_record(fake_record(backend="cpu", tier_bytes=0, failure={"kind": "host_memory"}), server, tmp_path)
    assert path.name == "4242-tiny-defaults.png" and png_size(path) == (1000, 450)


def test_plot_record_places_log_steps_with_their_durations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(plots, "plot_timeline", lambda *a, **k: seen.update(k) or k["path"])
    # The log stamp is 12 s after the launch: launch (monotonic T0) is now - (monotonic now - T0) in wall time.
    launch_wall = time.time() - (time.monotonic() - T0)
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(launch_wall + 12))
    log = f"(EngineCore pid=2) INFO {stamp} [core.py:402] init engine (profile, create kv cache, warmup model) took 7 s"
    server = fake_server(log=log, memory=StartupMemory(engine_init_s=7.5))
    plot_record(fake_record(), server, tmp_path)
    ((label, x),) = seen["phases"].items()
    assert label == "engine ready (init 7.5 s)"
    assert 11.0 <= x <= 13.5


def test_plot_record_without_server_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no server timeline"):
        plot_record(fake_record(), None, tmp_path)


def test_missing_matplotlib_raises_import_error_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import of a None entry raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'pytest-vllm-mem\[plots\]'"):
        plot_record(fake_record(), fake_server(), tmp_path)
    assert not list(tmp_path.iterdir())


def test_plot_filename_is_safe_and_bounded() -> None:
    config = VLLMConfig("/models/a b/M", served_model_name="x/y", max_model_len=8)
    server = FakeServer(config, config, 7, FakeTimeline([], []))
    name = plot_filename(server)
    assert name.startswith("7-M-") and name.endswith(".png") and "/" not in name and " " not in name
    assert len(name) <= 100


def test_many_loads_label_only_what_fits(tmp_path: Path, drawn_texts: list[str]) -> None:
    texts = drawn_texts
    samples = [(T0 + i * 0.5, GIB) for i in range(7200)]  # one hour
    markers = [("launch", T0), ("healthy", T0 + 40)]
    for k in range(100):
        markers += [(f"load {k + 1}", T0 + 60 + 30 * k), ("load end", T0 + 70 + 30 * k)]
    path = plot_timeline(samples, markers, path=tmp_path / "t.png", title="t", tier_bytes=None, tier_label=None)
    assert png_size(path) == (1000, 450)
    load_labels = [text for text in texts if text.startswith("load ")]
    assert "load 1" in load_labels and 5 <= len(load_labels) < 30
