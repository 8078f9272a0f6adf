"""Memory timeline plots (--vllm-plots DIR): one PNG per vLLM server, startup and every load on one time axis.

matplotlib is an optional extra (`pip install 'pytest-vllm-mem[plots]'`) and is imported only when a plot is drawn.
Figures are drawn on matplotlib's Agg canvas directly (Figure + FigureCanvasAgg), never through pyplot: no global
backend switch in the test process, no GUI window, safe from a non-main thread.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import (
    STARTUP_PHASES,
    StartupMemory,
    record_stamp,
    startup_milestone,
    strip_ansi,
    strip_log_prefix,
)
from pytest_vllm_mem.units import GIB

if TYPE_CHECKING:
    from pytest_vllm_mem.baseline.results import TestRecord

FIGURE_INCHES = (10.0, 4.5)
DPI = 100  # 1000 x 450 px: readable in a GitHub markdown summary without zooming
MATPLOTLIB_MISSING = (
    "--vllm-plots needs matplotlib, an optional extra: pip install 'pytest-vllm-mem[plots]' (or pip install matplotlib)"
)

STARTUP_COLOR = "#cfe2f3"  # light blue
LOAD_COLORS = ("#d9ead3", "#fce5cd")  # light green, light orange, alternating so adjacent loads stay apart
CURVE_COLOR = "#1f4e79"
TIER_COLOR = "#c00000"
PHASE_COLOR = "#555555"
# A tier this many times above the peak would squash the curve into the bottom of the plot: note it instead.
TIER_OFF_SCALE_RATIO = 8.0
PHASE_MIN_GAP_S = 0.6  # log stamps have 1 s resolution: closer steps are the same second


class Timeline(Protocol):
    """What a plot reads of a server's memory sampler (memory.MemorySampler)."""

    @property
    def samples(self) -> list[tuple[float, int]]: ...
    @property
    def markers(self) -> list[tuple[str, float]]: ...


class PlottedServer(Protocol):
    """What a plot reads of a server (launch.server.VLLMServer): its configs, pid, sampler, startup figures, log."""

    @property
    def config(self) -> VLLMConfig: ...
    @property
    def launched(self) -> VLLMConfig: ...
    @property
    def pid(self) -> int: ...
    @property
    def memory(self) -> StartupMemory | None: ...
    @property
    def sampler(self) -> Timeline: ...
    def log_text(self) -> str: ...


class NamedServer(Protocol):
    @property
    def pid(self) -> int: ...
    @property
    def config(self) -> VLLMConfig: ...


@dataclass(frozen=True)
class Window:
    """A shaded span of the timeline, in seconds since launch."""

    label: str
    start: float
    end: float
    color: str


def phase_windows(markers: list[tuple[str, float]], origin: float, last: float) -> list[Window]:
    """Startup (launch -> healthy) and each load (load N -> the next "load end"); open ones end at `last`."""
    windows: list[Window] = []
    times = {label: t for label, t in reversed(markers)}  # first occurrence wins
    if "launch" in times:
        healthy = times.get("healthy")
        end = healthy if healthy is not None else last
        label = f"startup {end - times['launch']:.0f} s" if healthy is not None else "startup (never healthy)"
        windows.append(Window(label, times["launch"] - origin, end - origin, STARTUP_COLOR))
    loads = 0
    for index, (label, t) in enumerate(markers):
        if not re.fullmatch(r"load \d+", label):
            continue
        end_t = next((t2 for label2, t2 in markers[index + 1 :] if label2 == "load end"), None)
        color = LOAD_COLORS[loads % len(LOAD_COLORS)]
        loads += 1
        shown = label if end_t is not None else f"{label} (unfinished)"
        windows.append(Window(shown, t - origin, (end_t if end_t is not None else last) - origin, color))
    return windows


# -- where vLLM's startup steps happened, from its log --------------------------------------------------------------

# vLLM prints how long steps took, not when they started; but every log line carries a wall-clock stamp
# (`INFO 11-30 04:58:57 [file.py:1] ...`, local time, 1 s resolution), which places the line itself. Which line is
# which step is diagnosis' reading (startup_milestone): the plot names the step each milestone ends.
LOG_EVENTS: dict[str, str] = {  # startup phase that begins at the line -> the plot's label of that line
    "loading the weights": "weights loading",
    "profiling memory (compile and dummy forward pass)": "weights loaded",
    "allocating the KV cache": "KV cache sized",
    "warming up": "graphs captured",
    "starting the API server": "engine ready",
}


def log_event_times(log_text: str, launch_wall: float) -> dict[str, float]:
    """Seconds since launch of each startup step in LOG_EVENTS (first occurrence), from the log lines' time stamps.

    Stamps have 1 s resolution: a step is placed mid-second (+-0.5 s). `launch_wall` is the launch as a Unix time;
    stamps are local time without a year, so the year is the launch's. Steps that land before the launch or more than
    a day after it (a log from another run, a clock change) are dropped rather than drawn in the wrong place.
    """
    year = time.localtime(launch_wall).tm_year
    events: dict[str, float] = {}
    for line in log_text.splitlines():
        index = startup_milestone(strip_log_prefix(strip_ansi(line)))
        name = LOG_EVENTS.get(STARTUP_PHASES[index]) if index is not None else None
        if name is None or name in events:
            continue
        stamp = record_stamp(line)
        if stamp is None:
            continue
        month, day, hour, minute, second = (int(part) for part in re.split(r"[-: ]+", stamp))
        try:
            wall = time.mktime((year, month, day, hour, minute, second, 0, 0, -1)) + 0.5
        except (OverflowError, ValueError):
            continue
        offset = wall - launch_wall
        if -1.0 <= offset <= 86_400:
            events[name] = max(offset, 0.0)
    return events


def startup_breakdown(memory: StartupMemory | None) -> dict[str, float]:
    """What vLLM's startup log said it spent, in GiB, labelled for the side panel; empty when it printed nothing."""
    if memory is None:
        return {}
    weights_s, graphs_s = memory.weights_load_s, memory.graph_capture_s
    rows: dict[str, float] = {}
    for label, value in (
        (f"weights ({weights_s:.0f} s)" if weights_s is not None else "weights", memory.weights_gib),
        ("KV cache", memory.kv_cache_gib),
        (f"CUDA graphs ({graphs_s:.0f} s)" if graphs_s is not None else "CUDA graphs", memory.graph_capture_gib),
        ("non-KV total", memory.non_kv_gib),
        ("requested", memory.requested_gib),
    ):
        if value is not None:
            rows[label] = float(value)
    return rows


# -- drawing ----------------------------------------------------------------------------------------------------------


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(MATPLOTLIB_MISSING) from error
    return Figure, FigureCanvasAgg


def tier_text(tier_label: str | None, tier_bytes: int) -> str:
    """`24gb tier (24.0 GB)`: the tier as named and in decimal GB, as cards are sold."""
    name = f"{tier_label} tier" if tier_label else "tier"
    return f"{name} ({tier_bytes / 1e9:.1f} GB)"


@dataclass(frozen=True)
class _Timeline:
    """Everything a panel draws, in seconds since launch and GiB."""

    xs: list[float]
    ys: list[float]
    windows: list[Window]
    phases: dict[str, float]
    top: float
    tier_gib: float | None
    tier_on_scale: bool
    tier_text: str

    def peak_within(self, lo: float, hi: float) -> tuple[float, float] | None:
        inside = [(y, x) for x, y in zip(self.xs, self.ys) if lo <= x <= hi]
        if not inside:
            return None
        y, x = max(inside)
        return x, y


def plot_timeline(
    samples: list[tuple[float, int]],
    markers: list[tuple[str, float]],
    *,
    path: Path,
    title: str,
    tier_bytes: int | None,
    tier_label: str | None,
    phases: dict[str, float] | None = None,
    breakdown: dict[str, float] | None = None,
    y_label: str = "memory used by the server (GiB)",
) -> Path:
    """Draw memory over time to `path` (PNG, 1000x450 px) and return `path`.

    `samples` are (monotonic seconds, bytes) and `markers` (label, monotonic seconds) as MemorySampler keeps them;
    the x axis is seconds since the "launch" marker (else the first sample). A server that became healthy and then
    served gets two panels on one time axis, startup and serving, so a one-second load is not a sliver beside a
    forty-second startup. `phases` are labelled instants in seconds since launch (dotted lines); `breakdown` GiB
    figures listed beside the plot. Empty samples give a figure that says so. Raises ImportError (with the install
    command) when matplotlib is missing.
    """
    Figure, FigureCanvasAgg = _import_matplotlib()
    path = Path(path)
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=10.5, x=0.01, ha="left")

    launch = next((t for label, t in markers if label == "launch"), None)
    origin = launch if launch is not None else (samples[0][0] if samples else 0.0)
    last = max([samples[-1][0] if samples else origin, *(t for _, t in markers)])
    healthy = next((t - origin for label, t in markers if label == "healthy"), None)
    end = max(last - origin, 1.0)
    split = bool(samples) and healthy is not None and samples[-1][0] - origin - healthy > 0.5
    panels, side = _panels(figure, split, y_label)
    if not samples:
        _say_no_samples(panels[0], end)
    else:
        timeline = _timeline(samples, markers, origin, last, tier_bytes, tier_label, phases or {})
        if split and healthy is not None:  # split implies healthy; said again for the type checker
            _draw_panel(panels[0], timeline, 0.0, healthy, startup_panel=True)
            _draw_panel(panels[1], timeline, healthy, end * 1.005, startup_panel=False)
            _break_marks(panels[0], panels[1])
        else:
            _draw_panel(panels[0], timeline, 0.0, end * 1.01, startup_panel=None)
        _mark_peak(panels, timeline)
        if timeline.tier_gib is not None and not timeline.tier_on_scale:
            _note_tier_off_scale(side, timeline, timeline.tier_gib)
    _draw_side_panel(side, breakdown or {}, samples, phases or {})
    return _save_png(figure, path)


def _panels(figure: Any, split: bool, y_label: str) -> tuple[list[Any], Any]:
    """The plot's panels (startup and serving side by side when `split`, else one) and the side column."""
    grid = figure.add_gridspec(1, 3 if split else 2, width_ratios=(1.2, 1.3, 0.8) if split else (2.5, 0.8), wspace=0.0)
    panels = [figure.add_subplot(grid[0, 0])]
    if split:
        panels.append(figure.add_subplot(grid[0, 1], sharey=panels[0]))
    side = figure.add_subplot(grid[0, -1])
    side.axis("off")
    panels[0].set_ylabel(y_label, fontsize=10)
    for axes in panels:
        axes.tick_params(labelsize=9)
        axes.grid(True, color="#e6e6e6", linewidth=0.8)
        axes.set_axisbelow(True)
    figure.supxlabel("seconds since launch", fontsize=10, x=0.4)
    return panels, side


def _say_no_samples(axes: Any, end: float) -> None:
    axes.text(
        0.5,
        0.5,
        "no samples: the memory sampler recorded nothing for this server",
        transform=axes.transAxes,
        ha="center",
        va="center",
        fontsize=11,
        color="#7f7f7f",
    )
    axes.set_xlim(0, end)
    axes.set_ylim(0, 1)
    axes.set_yticks([])


def _note_tier_off_scale(side: Any, timeline: _Timeline, tier_gib: float) -> None:
    """A tier far above the peak is named in the side column instead of squashing the curve."""
    side.text(
        0.0,
        0.02,
        f"{timeline.tier_text}\n= {tier_gib:.2f} GiB, far above this\n"
        f"scale: the peak is {_share(max(timeline.ys), tier_gib)} of it",
        transform=side.transAxes,
        ha="left",
        va="bottom",
        fontsize=9,
        color=TIER_COLOR,
    )


def _save_png(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Tests sharing a server rewrite the same file: write aside, then replace, so a reader never sees half a PNG.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    figure.savefig(tmp, dpi=DPI, format="png")
    os.replace(tmp, path)
    return path


def _share(part: float, whole: float) -> str:
    """`87%`, or `0.8%` where a whole percent would round a small share to 0 or 1."""
    return f"{part / whole:.0%}" if part / whole >= 0.1 else f"{part / whole:.1%}"


def _timeline(
    samples: list[tuple[float, int]],
    markers: list[tuple[str, float]],
    origin: float,
    last: float,
    tier_bytes: int | None,
    tier_label: str | None,
    phases: dict[str, float],
) -> _Timeline:
    xs = [t - origin for t, _ in samples]
    ys = [b / GIB for _, b in samples]
    peak = max(ys)
    tier_gib = tier_bytes / GIB if tier_bytes else None
    tier_on_scale = tier_gib is not None and tier_gib <= max(peak, 1e-9) * TIER_OFF_SCALE_RATIO
    top = max(peak, tier_gib if tier_gib is not None and tier_on_scale else 0.0) * 1.25 or 1.0
    return _Timeline(
        xs,
        ys,
        phase_windows(markers, origin, last),
        phases,
        top,
        tier_gib,
        tier_on_scale,
        tier_text(tier_label, tier_bytes) if tier_bytes else "",
    )


def _draw_panel(axes: Any, timeline: _Timeline, lo: float, hi: float, *, startup_panel: bool | None) -> None:
    """One panel over [lo, hi] s. startup_panel: True/False in the split layout (startup / serving), None alone."""
    axes.set_xlim(lo, hi)
    axes.set_ylim(0, timeline.top)
    for window in timeline.windows:
        axes.axvspan(window.start, window.end, color=window.color, linewidth=0, zorder=0)
    axes.plot(timeline.xs, timeline.ys, color=CURVE_COLOR, linewidth=1.6, zorder=3)
    axes.fill_between(timeline.xs, timeline.ys, color=CURVE_COLOR, alpha=0.08, linewidth=0, zorder=2)

    width = hi - lo
    px_per_s = axes.bbox.width / width  # before layout, close enough to keep labels apart
    free_from = -float("inf")  # x (px) where the previous label ends: a label that would overprint it is skipped
    for window in timeline.windows:
        middle = (max(window.start, lo) + min(window.end, hi)) / 2
        if not lo <= middle <= hi or (startup_panel is not None and window.color == STARTUP_COLOR):
            continue  # in the split layout the panel title names the startup
        narrow = min(window.end, hi) - max(window.start, lo) < width * 0.15
        half = (8.0 if narrow else len(window.label) * 3.3) + 2  # px: a rotated label is one line high
        if (middle - lo) * px_per_s - half < free_from:
            continue
        free_from = (middle - lo) * px_per_s + half
        axes.text(
            middle,
            timeline.top * 0.975,
            window.label,
            ha="center",
            va="top",
            rotation=90 if narrow else 0,
            fontsize=9,
            color="#333333",
            zorder=5,
        )

    if startup_panel is not False:
        _draw_phases(axes, timeline, lo, hi)

    if timeline.tier_gib is not None and timeline.tier_on_scale:
        axes.axhline(timeline.tier_gib, color=TIER_COLOR, linestyle="--", linewidth=1.5, zorder=4)
        if startup_panel is not False:
            axes.text(
                lo + width * 0.015,
                timeline.tier_gib,
                f"{timeline.tier_text} = {timeline.tier_gib:.2f} GiB",
                color=TIER_COLOR,
                fontsize=9.5,
                ha="left",
                va="bottom",
                zorder=6,
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
            )

    peak = timeline.peak_within(lo, hi)
    if startup_panel is True:
        title = f"startup: healthy after {hi:.0f} s"
    elif startup_panel is False:
        loads = sum(1 for w in timeline.windows if w.color != STARTUP_COLOR)
        title = f"serving: {loads} load{'s' if loads != 1 else ''}" if loads else "serving: no load yet"
    else:
        title = ""
    if peak and startup_panel is not None:
        title += f", peak {peak[1]:.2f} GiB"
    axes.set_title(title, fontsize=10, loc="left")


def phase_groups(phases: dict[str, float], min_gap: float) -> list[tuple[float, list[str]]]:
    """Steps in time order, those closer than `min_gap` s (the same log second) grouped under one number."""
    groups: list[tuple[float, list[str]]] = []
    for name, x in sorted(phases.items(), key=lambda item: item[1]):
        if groups and x - groups[-1][0] < min_gap:
            groups[-1][1].append(name)
        else:
            groups.append((x, [name]))
    for _, names in groups:
        if "weights loading" in names and any(name.startswith("weights loaded") for name in names):
            names.remove("weights loading")  # loading took under a second: one event
    return groups


def _draw_phases(axes: Any, timeline: _Timeline, lo: float, hi: float) -> None:
    """A dotted line per step with a numbered badge at the top; the side panel says what each number is.

    Full labels on the lines would cross the curve and each other (steps cluster within seconds on a GPU).
    Badges that would touch the previous one step down a row.
    """
    previous_x, row = -float("inf"), 0
    for number, (x, _) in enumerate(phase_groups(timeline.phases, PHASE_MIN_GAP_S), start=1):
        if not lo <= x <= hi:
            continue
        row = row + 1 if x - previous_x < (hi - lo) * 0.045 and row < 2 else 0
        previous_x = x
        axes.axvline(x, color=PHASE_COLOR, linestyle=":", linewidth=1.2, zorder=1)
        axes.text(
            x,
            timeline.top * (0.965 - 0.075 * row),
            str(number),
            ha="center",
            va="top",
            fontsize=8.5,
            color="white",
            fontweight="bold",
            zorder=6,
            bbox={"boxstyle": "circle,pad=0.2", "facecolor": PHASE_COLOR, "edgecolor": "none"},
        )


def _mark_peak(panels: list[Any], timeline: _Timeline) -> None:
    """A red dot on the highest sample and a note with its value, share of the tier, time and phase."""
    peak_y = max(timeline.ys)
    peak_x = timeline.xs[timeline.ys.index(peak_y)]
    axes = next((a for a in reversed(panels) if a.get_xlim()[0] <= peak_x <= a.get_xlim()[1]), panels[0])
    where = next(
        (w.label.split(" (")[0] for w in timeline.windows if w.start <= peak_x <= w.end and w.color != STARTUP_COLOR),
        None,
    )
    if where is None and any(w.start <= peak_x <= w.end for w in timeline.windows if w.color == STARTUP_COLOR):
        where = "startup"
    share = f" = {_share(peak_y, timeline.tier_gib)} of the tier" if timeline.tier_gib else ""
    text = f"peak {peak_y:.2f} GiB{share}\nat {peak_x:.1f} s" + (f" ({where})" if where else "")
    axes.plot([peak_x], [peak_y], marker="o", markersize=6, color=TIER_COLOR, zorder=7)
    dx, dy, ha, va = _clear_spot(axes, timeline, peak_x, peak_y, text)
    axes.annotate(
        text,
        xy=(peak_x, peak_y),
        xytext=(dx, dy),
        textcoords="offset points",
        ha=ha,
        va=va,
        fontsize=9.5,
        zorder=8,
        bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": TIER_COLOR},
        arrowprops={"arrowstyle": "-", "color": TIER_COLOR, "linewidth": 1.0},
    )


# Where the peak note may go, nearest first: (dx, dy) in points from the peak, and the text alignment there.
_NOTE_SPOTS = tuple(
    (dx, dy, "right" if dx < 0 else "left", "bottom" if dy > 0 else "top" if dy < 0 else "center")
    for dy in (26, -26, 0, 60, -60, -110)
    for dx in (-14, 14, -40, 40)
)


def _clear_spot(axes: Any, timeline: _Timeline, x: float, y: float, text: str) -> tuple[float, float, str, str]:
    """The note's place near the peak: the nearest spot whose box covers the fewest curve points, stays inside the
    panel and clear of the labels along the top."""
    lines = text.split("\n")
    width = max(len(line) for line in lines) * 9.5 * 0.56 + 10  # points: ~0.56 em a character, plus padding
    height = len(lines) * 9.5 * 1.25 + 8
    to_points = 72.0 / DPI
    transform = axes.transData
    ((px, py),) = transform.transform([(x, y)]) * to_points
    lo, hi = axes.get_xlim()
    (left, bottom), (right, top) = transform.transform([(lo, 0), (hi, timeline.top * 0.86)]) * to_points
    step = max(1, len(timeline.xs) // 2000)
    curve = transform.transform(list(zip(timeline.xs[::step], timeline.ys[::step]))) * to_points
    best: tuple[float, tuple[float, float, str, str]] | None = None
    for rank, (dx, dy, ha, va) in enumerate(_NOTE_SPOTS):
        x0 = px + dx - (width if ha == "right" else 0)
        y0 = py + dy - {"top": height, "center": height / 2, "bottom": 0}[va]
        x1, y1 = x0 + width, y0 + height
        covered = sum(1 for cx, cy in curve if x0 - 4 <= cx <= x1 + 4 and y0 - 4 <= cy <= y1 + 4)
        outside = max(0.0, left - x0) + max(0.0, x1 - right) + max(0.0, bottom - y0) + max(0.0, y1 - top)
        cost = covered * 10 + outside * 50 + rank  # rank: nearer spots win ties
        if best is None or cost < best[0]:
            best = (cost, (dx, dy, ha, va))
    return best[1] if best is not None else _NOTE_SPOTS[0]


def _break_marks(left: Any, right: Any) -> None:
    """The usual broken-axis marks: the two panels are one time axis with a cut between them."""
    left.spines["right"].set_visible(False)
    right.spines["left"].set_visible(False)
    right.tick_params(left=False, labelleft=False)
    style = {
        "marker": [(-1, -1), (1, 1)],
        "markersize": 10,
        "linestyle": "none",
        "color": "#333333",
        "mec": "#333333",
        "mew": 1,
        "clip_on": False,
    }
    left.plot([1, 1], [0, 1], transform=left.transAxes, **style)
    right.plot([0, 0], [0, 1], transform=right.transAxes, **style)


SIDE_PANEL_CHARS = 36  # monospace 8 pt in the side column (~250 px)


def _wrap(text: str, width: int, indent: int) -> list[str]:
    """Break a side-panel line at spaces, continuation lines indented under the text."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = " " * indent + word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]


def _draw_side_panel(
    side: Any, breakdown: dict[str, float], samples: list[tuple[float, int]], phases: dict[str, float]
) -> None:
    lines: list[str] = []
    if breakdown:
        width = max(len(label) for label in breakdown)
        lines.append("vLLM startup log (GiB)")
        lines += [f"{label.ljust(width)} {value:6.2f}" for label, value in breakdown.items()]
        lines.append("")
    groups = phase_groups(phases, PHASE_MIN_GAP_S)
    if groups:
        lines.append("startup steps (vLLM log, ±1 s)")
        for number, (x, names) in enumerate(groups, start=1):
            lines += _wrap(f"{number} {x:4.0f} s  {' + '.join(names)}", SIDE_PANEL_CHARS, indent=10)
        lines.append("")
    if len(samples) > 1:
        period = (samples[-1][0] - samples[0][0]) / (len(samples) - 1)
        lines.append(f"{len(samples):,} samples, every {period * 1000:.0f} ms")
    side.text(
        0.0,
        0.98,
        "\n".join(lines),
        transform=side.transAxes,
        ha="left",
        va="top",
        fontsize=8,
        family="monospace",
        linespacing=1.4,
    )


# -- one PNG per server -----------------------------------------------------------------------------------------------

_SLUG = re.compile(r"[^A-Za-z0-9_.=-]+")


def plot_filename(server: NamedServer) -> str:
    """`12345-tiny-gpu-memory-utilization=0.1_max-model-len=1024.png`: pid + what ran, so tests sharing a server
    share (and refresh) one file and two servers never collide."""
    config = server.config
    slug = _SLUG.sub("_", f"{Path(str(config.model)).name}-{config.short_id()}").strip("_")[:90]
    return f"{server.pid}-{slug}.png"


def _with_duration(event: str, memory: StartupMemory | None) -> str:
    """`engine ready (init 8.4 s)`: the step's own duration from the log, where vLLM printed one."""
    if memory is None:
        return event
    seconds, wording = {
        "weights loaded": (memory.weights_load_s, ""),
        "graphs captured": (memory.graph_capture_s, ""),
        "engine ready": (memory.engine_init_s, "init "),
    }.get(event, (None, ""))
    return f"{event} ({wording}{seconds:.1f} s)" if seconds is not None else event


def plot_record(record: TestRecord, server: PlottedServer | None, plots_dir: Path) -> Path:
    """Draw the timeline of `server`, the one behind `record` (a running server, or the stopped one of a failed
    startup), into `plots_dir`; returns the path.

    Raises ImportError with the install command when matplotlib is missing, ValueError when there is no server.
    """
    _import_matplotlib()  # fail before any work, with the clear message
    if server is None:
        raise ValueError(
            f"plot_record: the record of {record.test_id} has no server timeline to plot (pass the VLLMServer it used)."
        )
    samples = server.sampler.samples
    markers = server.sampler.markers
    launch = next((t for label, t in markers if label == "launch"), None)  # the plot's time zero
    phases: dict[str, float] = {}
    if launch is not None:
        launch_wall = launch + (time.time() - time.monotonic())
        phases = log_event_times(server.log_text(), launch_wall)
        healthy = next((t for label, t in markers if label == "healthy"), None)
        if healthy is not None:  # a stamp after healthy is from a later line (or a clock change): not startup
            phases = {name: x for name, x in phases.items() if x <= healthy - launch + 1.0}
        phases = {_with_duration(name, server.memory): x for name, x in phases.items()}
    config = server.config
    launched = server.launched
    # Tier emulation and overrides change flags: show only what differs from what the test asked for.
    changed = [flag for flag in launched.short_id().split(" ") if flag not in config.short_id().split(" ")]
    ran = f"   (ran with {' '.join(changed)})" if changed else ""
    title = f"memory timeline: {Path(str(config.model)).name}  {config.short_id()}{ran}"
    if len(title) > 120:
        title = title[:117] + "..."
    title += f"\nvLLM server pid {server.pid} on {record.device} ({record.backend})"
    if record.failure:
        title += f"   -   failed: {record.failure.get('kind')}"
    y_label = "GiB (RSS of the server processes)" if record.backend == "cpu" else "GiB of GPU memory (server processes)"
    return plot_timeline(
        samples,
        markers,
        path=Path(plots_dir) / plot_filename(server),
        title=title,
        tier_bytes=record.tier_bytes or None,
        tier_label=record.tier or None,
        phases=phases,
        breakdown=startup_breakdown(server.memory),
        y_label=y_label,
    )
