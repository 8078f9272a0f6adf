"""Read a vLLM server log: the memory figures it printed at startup, and why a start (or a run) failed.

Pure text parsing: every function takes the log text it needs and does no I/O. The patterns match stable
fragments of vLLM's own messages (0.10.x through 0.3x) rather than whole lines, so small wording changes
between versions do not break them; numbers are read from the message, never assumed.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

FAILURE_KINDS = (
    "cuda_oom",
    "kv_cache_insufficient",
    "insufficient_free_memory",
    "weights_too_large",
    "host_memory",
    "bad_flag",
    "timeout",
    "crash",
)

MAX_ROOT_CAUSE_LINES = 5

# --- prefixes -------------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# "(EngineCore pid=1) ", "(VllmWorker rank=0 pid=123) ", "(Worker_TP1 pid=9) ", "(RayWorkerWrapper pid=5, ip=..) "
_PROCESS_PREFIX = re.compile(r"^\s*\([^()]*\bpid=\d+[^()]*\)\s?")
# "INFO 11-30 04:55:40 [core.py:1510] " (vLLM's own formatter; "[file:line]" since 0.8)
_LEVEL_PREFIX = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
    r"(?:\s+\[[^\]]*\])?\s?"
)
# uvicorn's "INFO:     Started server process [10552]"
_UVICORN_PREFIX = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")
_QUIET_LEVELS = frozenset({"DEBUG", "INFO", "WARNING", "WARN"})
_C10_WARNING = re.compile(r"^\[W\d{4} ")  # torch's C++ warnings: "[W1130 04:55:33.27 utils.cpp:68] Warning: ..."


def strip_ansi(text: str) -> str:
    """Remove terminal color codes (vLLM 0.10 colored the process prefix even when writing to a file)."""
    return _ANSI.sub("", text)


def _split_prefix(line: str) -> tuple[str | None, str]:
    """(log level or None, message) of one raw log line."""
    text = _PROCESS_PREFIX.sub("", strip_ansi(line), count=1)
    match = _LEVEL_PREFIX.match(text) or _UVICORN_PREFIX.match(text)
    if match:
        return match.group("level"), text[match.end():].rstrip()
    return None, text.rstrip()


def strip_log_prefix(line: str) -> str:
    """`(EngineCore pid=1) ERROR 11-30 04:55:40 [core.py:1510] msg` -> `msg` (indentation of the message kept)."""
    return _split_prefix(line)[1]


@dataclass(frozen=True)
class _Line:
    index: int
    level: str | None
    text: str

    @property
    def may_be_error(self) -> bool:
        # INFO/WARNING lines echo flags and hints ("non-default args: {...}", "to avoid OOM"): never a cause.
        return self.level not in _QUIET_LEVELS and not _C10_WARNING.match(self.text)



def _lines(log_text: str) -> list[_Line]:
    return [_Line(i, *_split_prefix(raw)) for i, raw in enumerate(log_text.splitlines())]


# --- startup figures ------------------------------------------------------------------------------------------

_NUM = r"-?\d+(?:\.\d+)?"
_INT = r"\d[\d,]*"


@dataclass(frozen=True)
class StartupMemory:
    """What vLLM printed about its memory while starting; a field is None when the installed vLLM did not print it."""

    vllm_version: str | None = None
    weights_gib: float | None = None
    weights_load_s: float | None = None
    kv_cache_gib: float | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens: int | None = None
    graph_capture_gib: float | None = None
    graph_capture_s: float | None = None
    engine_init_s: float | None = None
    non_kv_gib: float | None = None
    requested_gib: float | None = None
    device_total_gib: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_ENGINE_VERSION = re.compile(r"Initializing a V1 LLM engine \(v(\d+\.\d+[^)\s]*)\)")
# The 0.3x banner ("... version 0.32.0") and 0.10's "vLLM API server version 0.10.2".
_BANNER_VERSION = re.compile(r"\bversion\s+v?(\d+\.\d+(?:\.\d+)?[\w.+\-]*)")
_WEIGHTS = re.compile(rf"Model loading took\s+({_NUM})\s*GiB(?:\s+memory)?\s+and\s+({_NUM})\s*s")
_WEIGHTS_OLD = re.compile(rf"Loading model weights took\s+({_NUM})\s*GB")  # V0 engine wording
_KV_GIB = re.compile(rf"Available KV cache memory:\s*({_NUM})\s*GiB")
_CPU_KV = re.compile(rf"(?:Auto|Explicitly) set \(({_NUM})/({_NUM})\) GiB for KV cache")
_CPU_REQUESTED = re.compile(rf"with ({_NUM}) GiB requested memory for the worker")
_CPU_NON_KV = re.compile(rf"({_NUM}) GiB memory was consumed by non-kv usages")
_KV_TOKENS = re.compile(rf"KV cache size:\s*({_INT})\s*tokens")
_CONCURRENCY = re.compile(rf"Maximum concurrency for\s*({_INT})\s*tokens per request:\s*({_NUM})x")
_GRAPHS = re.compile(rf"Graph capturing finished in\s*({_NUM})\s*secs?,\s*took\s*({_NUM})\s*GiB")
_ENGINE_INIT = re.compile(rf"init engine \(profile, create kv cache, warmup model\) took\s*({_NUM})\s*s")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _first(lines: Iterable[_Line], pattern: re.Pattern[str]) -> re.Match[str] | None:
    for line in lines:
        match = pattern.search(line.text)
        if match:
            return match
    return None


def parse_startup_memory(log_text: str) -> StartupMemory:
    """The startup memory figures in a vLLM log (first occurrence of each; tensor-parallel ranks print alike)."""
    lines = _lines(log_text)
    values: dict[str, object] = {}

    def grab(pattern: re.Pattern[str], *names_and_casts: tuple[str, type]) -> bool:
        match = _first(lines, pattern)
        if not match:
            return False
        for group, (name, cast) in enumerate(names_and_casts, start=1):
            values[name] = _int(match.group(group)) if cast is int else cast(match.group(group))
        return True

    grab(_ENGINE_VERSION, ("vllm_version", str)) or grab(_BANNER_VERSION, ("vllm_version", str))
    grab(_WEIGHTS, ("weights_gib", float), ("weights_load_s", float)) or grab(_WEIGHTS_OLD, ("weights_gib", float))
    # GPU prints the pool in GiB; the CPU worker prints "(kv/node total) GiB for KV cache" instead.
    grab(_KV_GIB, ("kv_cache_gib", float)) or grab(_CPU_KV, ("kv_cache_gib", float), ("device_total_gib", float))
    grab(_CPU_REQUESTED, ("requested_gib", float))
    grab(_CPU_NON_KV, ("non_kv_gib", float))
    grab(_KV_TOKENS, ("kv_cache_tokens", int))
    grab(_CONCURRENCY, ("max_concurrency_tokens", int), ("max_concurrency", float))
    grab(_GRAPHS, ("graph_capture_s", float), ("graph_capture_gib", float))
    grab(_ENGINE_INIT, ("engine_init_s", float))
    return StartupMemory(**values)  # type: ignore[arg-type]


# --- failures -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """Why a vLLM server failed: `kind` is one of FAILURE_KINDS, `figures` the numbers read from the error."""

    kind: str
    summary: str
    root_cause: tuple[str, ...] = ()
    figures: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "summary": self.summary, "root_cause": list(self.root_cause),
                "figures": dict(self.figures)}


# Stable fragments of each failure. Checked on error lines only (see _Line.may_be_error).
_BAD_FLAG = re.compile(r"\berror: (?:unrecognized arguments:|argument -)|\d+ validation errors? for \w+")
_FREE_MEMORY = re.compile(
    r"Free memory on device.*on startup is less than (?:desired GPU memory utilization|the engine's budget)"
)
_WEIGHTS_OOM = re.compile(r"Failed to load model - not enough GPU memory")
_KV_INSUFFICIENT = re.compile(
    r"No available memory for the cache blocks|KV cache is needed, which is larger than the available KV cache memory"
)
_DEVICE_OOM = re.compile(r"\b(?:CUDA|HIP|XPU|NPU) out of memory|OutOfMemoryError|CUDA error: out of memory")
_HOST_OOM = re.compile(
    r"on kv cache\s*allocation is less than requested memory for kv|Cannot allocate memory|std::bad_alloc"
    r"|DefaultCPUAllocator: can't allocate memory|(?<![A-Za-z])MemoryError\b"
)
_MEMORY_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("insufficient_free_memory", _FREE_MEMORY),
    ("weights_too_large", _WEIGHTS_OOM),
    ("kv_cache_insufficient", _KV_INSUFFICIENT),
    ("cuda_oom", _DEVICE_OOM),
    ("host_memory", _HOST_OOM),
)

# Lines that only point elsewhere ("see root cause above"): never the root cause themselves.
_GENERIC = re.compile(
    r"Engine core initialization failed|EngineCore failed to start|WorkerProc hit an exception|WorkerProc failed"
    r"|EngineDeadError|See stack trace \(above\)|died unexpectedly|output_handler failed|^Traceback \(most recent"
    r"|During handling of the above exception|The above exception was the direct cause|Exception in worker"
)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::|$)")
# Lines that say nothing about progress or cause: progress bars, traceback frames, Python warnings, leak reports.
_NOISE = re.compile(
    r"\d+%\||it/s\]|s/it\]|^\s|^Traceback \(most recent|^\S+:\d+: \w*Warning:|^nanobind:|^- (?:leaked|\.\.\.)"
    r"|^See https://nanobind"
)


def _core_message(text: str) -> str:
    """The message of `SomeError: message`, for spotting a re-raise that quotes an earlier error."""
    stripped = text.strip()
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
    return round(float(value) * _UNIT_IN_GIB[unit], 4)


_SIZE = r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
_TOTAL_CAPACITY = re.compile(rf"total capacity of {_SIZE}")
_FREE_NOW = re.compile(rf"of which {_SIZE} is free")
_PROCESS_USES = re.compile(rf"this process has {_SIZE} memory in use")


def _oom_figures(text: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, pattern in (("tried_allocate_gib", _TRIED), ("device_total_gib", _TOTAL_CAPACITY),
                          ("free_gib", _FREE_NOW), ("process_used_gib", _PROCESS_USES)):
        match = pattern.search(text)
        if match:
            figures[name] = _gib(match.group(1), match.group(2))
    return figures


def _format_size(gib: float) -> str:
    return f"{gib * 1024:.2f} MiB" if abs(gib) < 1 else f"{gib:.2f} GiB"


# Startup milestones in the order vLLM reaches them: the last one seen tells how far a start got.
_MILESTONES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Initializing a V1 LLM engine|Initializing an LLM engine"), "initializing the engine"),
    (re.compile(r"Starting to load model"), "loading the weights"),
    (re.compile(r"Model loading took|Loading weights took|Loading model weights took"),
     "profiling memory (compile and dummy forward pass)"),
    # The pool is sized ("Available KV cache memory", "KV cache size") before the tensors are allocated.
    (re.compile(r"Available KV cache memory|GiB for KV cache|KV cache size:"), "allocating the KV cache"),
    (re.compile(r"Capturing CUDA graph"), "capturing CUDA graphs"),  # tqdm bar: 0.10 "graph shapes", 0.3x "graphs ("
    (re.compile(r"Graph capturing finished"), "warming up"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\)"), "starting the API server"),
    (re.compile(r"Application startup complete|Starting vLLM (?:API )?server on"), "serving"),
)


def _stage_before(lines: Sequence[_Line], end: int) -> str:
    stage = "starting the API server process"
    for line in lines[:end]:
        for pattern, name in _MILESTONES:
            if pattern.search(line.text):
                stage = name
    return stage


def _loaded_before(lines: Sequence[_Line], end: int) -> bool:
    # "Model loading took" comes after weights are loaded and post-processed ("Loading weights took" comes before
    # the post-processing, which can still run out of memory).
    return any(_WEIGHTS.search(l.text) or _WEIGHTS_OLD.search(l.text) for l in lines[:end])


def _oom_phase(stage: str) -> str:
    return {
        "profiling memory (compile and dummy forward pass)": "while profiling",
        "allocating the KV cache": "while allocating the KV cache",
        "capturing CUDA graphs": "while capturing CUDA graphs",
        "warming up": "while warming up",
        "starting the API server": "right after startup",
        "serving": "while serving requests",
    }.get(stage, "during startup")


def _related(lines: Sequence[_Line], pattern: re.Pattern[str]) -> list[str]:
    return [l.text for l in lines if l.may_be_error and pattern.search(l.text)]


def _device_oom(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    texts = _related(lines, _DEVICE_OOM) + _related(lines, _WEIGHTS_OOM)
    figures = _oom_figures(" ".join(texts))
    tried = ""
    if "tried_allocate_gib" in figures:
        tried = f" (tried to allocate {_format_size(figures['tried_allocate_gib'])})"
    if not _loaded_before(lines, hit.index):
        used = figures.get("process_used_gib")
        total = figures.get("device_total_gib")
        detail = f": {used:.2f} of {total:.2f} GiB in use" if used is not None and total is not None else tried
        return Diagnosis("weights_too_large", f"the model weights do not fit in device memory{detail}",
                         _dedupe(_related(lines, _WEIGHTS_OOM) + _related(lines, _DEVICE_OOM)), figures)
    phase = _oom_phase(_stage_before(lines, hit.index))
    return Diagnosis("cuda_oom", f"vLLM ran out of device memory {phase}{tried}",
                     _dedupe(_related(lines, _DEVICE_OOM)), figures)


_KV_NEEDED = re.compile(
    rf"max seq len \(({_INT})\),\s*\(?({_NUM}) GiB KV cache is needed, which is larger than the available KV cache"
    rf" memory \(({_NUM}) GiB\)"
)
_KV_ESTIMATE = re.compile(rf"estimated maximum model length is ({_INT})", re.IGNORECASE)


def _kv_insufficient(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    related = _related(lines, _KV_INSUFFICIENT)
    joined = " ".join(related)
    figures: dict[str, float] = {}
    needed = _KV_NEEDED.search(joined)
    if needed:
        figures["max_model_len"] = float(_int(needed.group(1)))
        figures["needed_gib"] = float(needed.group(2))
        figures["available_gib"] = float(needed.group(3))
    estimate = _KV_ESTIMATE.search(joined)
    if estimate:
        figures["estimated_max_model_len"] = float(_int(estimate.group(1)))
    if "No available memory for the cache blocks" in joined:
        kv = _first(lines, _KV_GIB)
        if kv:
            figures["available_gib"] = float(kv.group(1))
        shown = f" ({figures['available_gib']:.2f} GiB)" if "available_gib" in figures else ""
        summary = f"no memory was left for the KV cache{shown} after weights, activations and graphs"
    elif needed:
        summary = (f"the KV cache ({figures['available_gib']:.2f} GiB) cannot hold one "
                   f"{int(figures['max_model_len']):,}-token sequence (needs {figures['needed_gib']:.2f} GiB)")
        if estimate:
            summary += f"; vLLM estimates a maximum model length of {int(figures['estimated_max_model_len']):,}"
    else:
        summary = "the KV cache cannot hold one sequence of max_model_len tokens"
    return Diagnosis("kv_cache_insufficient", summary, _dedupe(related), figures)


_FREE_FIGURES = re.compile(
    rf"Free memory on device\s*(\S*)\s*\(({_NUM})/({_NUM}) GiB\) on startup is less than"
    rf"[^(]*\(({_NUM}), ({_NUM}) GiB\)"
)


def _free_memory(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    related = _related(lines, _FREE_MEMORY)
    match = _FREE_FIGURES.search(" ".join(related))
    figures: dict[str, float] = {}
    summary = "less device memory was free at startup than gpu_memory_utilization asks for"
    if match:
        device = match.group(1) or "the device"
        figures = {"free_gib": float(match.group(2)), "device_total_gib": float(match.group(3)),
                   "gpu_memory_utilization": float(match.group(4)), "requested_gib": float(match.group(5))}
        summary = (f"only {figures['free_gib']:.2f} of {figures['device_total_gib']:.2f} GiB were free on {device} at "
                   f"startup, but gpu_memory_utilization {match.group(4)} asks for {figures['requested_gib']:.2f} GiB")
    return Diagnosis("insufficient_free_memory", summary, _dedupe(related), figures)


_CPU_AUTO_SHORT = re.compile(
    rf"Available memory on node (\d+) \(({_NUM})/({_NUM}) GiB\) on kv cache\s*allocation is less than requested"
    rf" memory for kv \(({_NUM})/({_NUM}) GiB\)"
)
_CPU_EXPLICIT_SHORT = re.compile(
    rf"Available memory on node (\d+) \(({_NUM})/({_NUM}) GiB\) on kv cache\s*allocation is less than requested"
    rf" memory for kv \(({_NUM}) GiB\)"
)


def _host_memory(lines: Sequence[_Line], hit: _Line) -> Diagnosis:
    related = _related(lines, _HOST_OOM)
    joined = " ".join(related)
    auto = _CPU_AUTO_SHORT.search(joined)
    explicit = _CPU_EXPLICIT_SHORT.search(joined)
    figures: dict[str, float] = {}
    if auto:
        available, total, kv, requested = (float(auto.group(i)) for i in range(2, 6))
        figures = {"available_gib": available, "device_total_gib": total, "kv_requested_gib": kv,
                   "requested_gib": requested, "non_kv_gib": round(requested - kv, 2)}
        if kv <= 0:
            summary = (f"the worker's share of host memory ({requested:.2f} of {total:.2f} GiB, set by "
                       f"gpu_memory_utilization) is used up before the KV cache: {requested - kv:.2f} GiB already "
                       f"in use, {kv:.2f} GiB left for the KV cache")
        else:
            summary = (f"node {auto.group(1)} has {available:.2f} of {total:.2f} GiB available, less than the "
                       f"{kv:.2f} GiB the KV cache asks for")
    elif explicit:
        available, total, kv = (float(explicit.group(i)) for i in range(2, 5))
        figures = {"available_gib": available, "device_total_gib": total, "kv_requested_gib": kv}
        summary = (f"node {explicit.group(1)} has {available:.2f} of {total:.2f} GiB available, less than the "
                   f"{kv:.2f} GiB KV cache set explicitly")
    else:
        summary = "the host ran out of memory (RAM, not device memory)"
    return Diagnosis("host_memory", summary, _dedupe(related), figures)


_MEMORY_BUILDERS = {
    "insufficient_free_memory": _free_memory,
    "weights_too_large": _device_oom,
    "cuda_oom": _device_oom,
    "kv_cache_insufficient": _kv_insufficient,
    "host_memory": _host_memory,
}


def _memory_diagnosis(lines: Sequence[_Line]) -> Diagnosis | None:
    """The earliest memory error in the log: later lines only re-raise it across processes."""
    for line in lines:
        if not line.may_be_error:
            continue
        for kind, pattern in _MEMORY_PATTERNS:
            if pattern.search(line.text):
                return _MEMORY_BUILDERS[kind](lines, line)
    return None


_UNRECOGNIZED = re.compile(r"error: unrecognized arguments:\s*(.*)")
_BAD_ARGUMENT = re.compile(r"error: argument ((?:--?[\w.\-]+/?)+):\s*(.*)")
_VALIDATION = re.compile(r"\d+ validation errors? for (\w+)")


def _bad_flag(lines: Sequence[_Line]) -> Diagnosis | None:
    for position, line in enumerate(lines):
        if not line.may_be_error or not _BAD_FLAG.search(line.text):
            continue
        text = line.text.strip()
        unrecognized = _UNRECOGNIZED.search(text)
        argument = _BAD_ARGUMENT.search(text)
        if unrecognized:
            flags = [token for token in unrecognized.group(1).split() if token.startswith("-")]
            summary = f"the installed vLLM does not accept {', '.join(flags) or unrecognized.group(1)}"
            return Diagnosis("bad_flag", summary, (text,))
        if argument:
            name = argument.group(1).split("/")[0]
            summary = f"the installed vLLM rejected the value of {name}: {argument.group(2)}"
            return Diagnosis("bad_flag", summary, (text,))
        # pydantic: "1 validation error for CacheConfig" / "gpu_memory_utilization" / "  Input should be ... [type=..,
        # input_value=1.5, ...]"; a model-level check has no field line: "  Value error, User-specified ...".
        detail = [l.text.strip() for l in lines[position + 1:position + 3] if l.text.strip()]
        validation = _VALIDATION.search(text)
        field_name = detail[0] if detail and re.fullmatch(r"[\w.]+", detail[0]) else None
        message = next((d for d in detail if d != field_name), "")
        value = re.search(r"input_value=([^,\]]+)", message)
        message = re.sub(r"\s*\[type=.*$", "", message).strip()
        if field_name:
            setting = f"{field_name}={value.group(1)}" if value else field_name
        else:
            setting = f"the {validation.group(1)}" if validation else "a setting"
        return Diagnosis("bad_flag", f"the installed vLLM rejected {setting}: {message or text}",
                         _dedupe([text, *detail], limit=3))
    return None


def rejected_flags(diagnosis: Diagnosis) -> tuple[str, ...]:
    """The flags a bad_flag diagnosis names: ('--swap-space',) or ('gpu_memory_utilization',) for a value error."""
    if diagnosis.kind != "bad_flag":
        return ()
    for position, text in enumerate(diagnosis.root_cause):
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
    return ()


def _meaningful(lines: Sequence[_Line]) -> list[str]:
    return [l.text.strip() for l in lines if l.text.strip() and not _NOISE.search(l.text)]


def _error_lines(lines: Sequence[_Line]) -> list[str]:
    """Exception lines (`OSError: ...`), else ERROR-level messages, minus the generic 'see above' ones."""
    exceptions = [l.text.strip() for l in lines
                  if l.may_be_error and _EXCEPTION_LINE.match(l.text.strip()) and not _GENERIC.search(l.text)]
    if exceptions:
        return exceptions
    return [l.text.strip() for l in lines
            if l.level in ("ERROR", "CRITICAL") and l.text.strip() and not l.text[:1].isspace()
            and not _GENERIC.search(l.text)]


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify_failure(log_text: str, returncode: int | None) -> Diagnosis:
    """Why a vLLM server exited (or was stopped) before it became healthy.

    A rejected flag wins (nothing else ran); then the earliest memory error; otherwise `crash` quoting the
    earliest specific error lines, never the generic "Engine core initialization failed. See root cause above".
    """
    lines = _lines(log_text)
    diagnosis = _bad_flag(lines) or _memory_diagnosis(lines)
    if diagnosis is not None:
        if returncode is not None:
            diagnosis.figures.setdefault("returncode", float(returncode))
        return diagnosis
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
    if errors:
        summary += f": {errors[0][:200]}"
        return Diagnosis("crash", summary, errors, figures)
    return Diagnosis("crash", summary, tuple(_meaningful(lines)[-MAX_ROOT_CAUSE_LINES:]), figures)


def find_memory_error(log_text: str) -> Diagnosis | None:
    """A memory error in the log of a running (or just died) server, else None. Used during load."""
    return _memory_diagnosis(_lines(log_text))


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
