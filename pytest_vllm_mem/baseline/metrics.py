"""The metrics catalogue and tolerances: what a test measures, how to read it from a record, which way is better.

Every figure the plugin compares or reports is defined here once. A gated metric has a default tolerance and fails
a test that gets worse beyond it; a report-only figure (no tolerance) is shown next to its baseline, in the upgrade
report above all, but never fails a test: its effect on what users feel is gated through the metrics it feeds (on a
fixed memory budget, weights or graph memory that grow shrink the KV cache, and `kv_cache_tokens` is gated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pytest_vllm_mem.baseline.summary import SAMPLES_KEY
from pytest_vllm_mem.units import (
    GIB,
    UnitError,
    format_quantity,
    is_finite_number,
    parse_duration_ms,
    parse_size,
    split_amount,
)

Scope = Literal["server", "load"]


class ToleranceError(ValueError):
    """A tolerance written by the user (CLI, ini, marker) cannot be understood; the plugin shows it as a usage error."""


@dataclass(frozen=True)
class Tolerance:
    """How much worse than the baseline a metric may get: a fraction of the baseline, an amount in the metric's unit,
    or both (then the looser of the two applies). The same band, mirrored, decides what counts as an improvement
    beyond tolerance (a stale baseline, which fails only in strict mode)."""

    relative: float | None = None
    absolute: float | None = None
    unit: str = ""  # the metric's unit, only to show `absolute` ("256 MiB", "50 ms")

    def __post_init__(self) -> None:
        if self.relative is None and self.absolute is None:
            raise ToleranceError("A Tolerance needs a relative part (0.05 for 5%), an absolute part, or both.")
        for part in (self.relative, self.absolute):
            if part is not None and not (math.isfinite(part) and part >= 0):
                raise ToleranceError(f"Tolerance parts must be finite and not negative, got {part!r}.")

    def limit(self, baseline: float) -> float:
        """The largest change, in the metric's unit, that stays within tolerance of this baseline."""
        limits = []
        if self.relative is not None:
            limits.append(self.relative * abs(baseline))
        if self.absolute is not None:
            limits.append(self.absolute)
        # A hair of slack so "exactly 5% worse" passes despite float rounding (0.05 * 1000 = 50.000000000000004).
        return max(limits) * (1 + 1e-9) + 1e-12

    def allows(self, baseline: float, now: float, higher_is_better: bool) -> bool:
        """True when `now` is worse than `baseline` by no more than the tolerance (or better)."""
        worse_by = (baseline - now) if higher_is_better else (now - baseline)
        return worse_by <= self.limit(baseline)

    def improves_beyond(self, baseline: float, now: float, higher_is_better: bool) -> bool:
        """True when `now` is better than `baseline` by more than the tolerance."""
        better_by = (now - baseline) if higher_is_better else (baseline - now)
        return better_by > self.limit(baseline)

    def __str__(self) -> str:
        parts = []
        if self.relative is not None:
            parts.append(f"{self.relative * 100:g}%")
        if self.absolute is not None:
            parts.append(format_quantity(self.absolute, self.unit, trim=True))
        return " or ".join(parts)


class Measured(Protocol):
    """What a metric reads: a test record's startup outcome, vLLM's logged memory figures and its loads (as dicts,
    the form TestRecord keeps and the results JSON stores)."""

    @property
    def startup(self) -> Mapping[str, Any]: ...

    @property
    def memory(self) -> Mapping[str, Any]: ...

    @property
    def loads(self) -> Sequence[Mapping[str, Any]]: ...

    @property
    def restarts(self) -> Sequence[Mapping[str, Any]]:
        """The fresh servers the gate's confirmation started for this test, each `{"startup": ..., "memory": ...}`
        as the record keeps its own: their server figures are samples too."""
        ...


@dataclass(frozen=True)
class Metric:
    """One figure: its unit, direction, default tolerance (None: reported, never gated) and where it lives.

    `scope` "server": one value per server startup (the record's own and each of its `restarts`), at `path` in the
    record ("startup" or "memory" first);
    "load": one value per completed load, at `path` in the load's dict. `scale` converts the stored unit (vLLM logs
    GiB) to the metric's unit. `kv_sized`: the figure holds or counts the KV cache, whose size vLLM derives from the
    device memory it sees (see compare.Replan)."""

    name: str
    unit: str  # "bytes", "tokens", "tok/s", "req/s", "ms", "s", "x"
    higher_is_better: bool
    default_tolerance: Tolerance | None
    description: str
    scope: Scope
    path: tuple[str, ...]
    scale: float = 1.0
    kv_sized: bool = False
    opt_in: bool = False  # report-only unless a tolerance is set for it (ttft_p99)
    # A server figure read only from a record whose value at `when[0]` is `when[1]` (a missing value reads as None):
    # startup time kept apart by the compile cache's state, so a cold start is never compared with a warm baseline.
    when: tuple[tuple[str, ...], str | None] | None = None
    tolerance_from: str | None = None  # takes the tolerance set for this metric unless one is set for it
    # A peak, which one startup or load can raise by a transient that a fresh start does not repeat: on the CPU
    # backend a startup's resident peak read +124 MiB (+5.2%) and +0.35 GiB over the same config's other sessions,
    # once each in 28 (benchmarks/data/gate_noise_ci_2026-12-02_*.json), while the rest stayed within 2 MiB. A
    # regression within reach of its tolerance is re-measured on fresh servers (noise.NoiseJudge) before it fails.
    transient: bool = False
    # Timed from when the stream's token chunks reached the client: not read from a load whose delivery coalesced.
    streamed: bool = False

    @property
    def gated(self) -> bool:
        return self.default_tolerance is not None

    def read(self, record: Measured) -> list[float]:
        """This metric's samples in `record`: none or one for a server figure, one per completed load otherwise.
        Missing, zero and non-finite values are skipped: vLLM did not print the figure, or the load measured nothing."""
        if self.scope == "server":
            servers = [(record.startup, record.memory), *_restart_sections(record)]
            sources: list[Any] = [_section(*server, self.path[0]) for server in servers if self._applies(*server)]
            path = self.path[1:]
        else:
            sources = [load for load in record.loads if load.get("completed")]
            if self.streamed:
                sources = [load for load in sources if not coalesced_load(load)]
            path = self.path
        values = []
        for source in sources:
            value = _walk(source, path)
            if is_finite_number(value) and value:
                scaled = float(value) * self.scale
                # Whole bytes: vLLM's GiB figures have two decimals, and "17813376860.16" bytes reads badly in a diff.
                values.append(float(round(scaled)) if self.unit == "bytes" else scaled)
        return values

    def _applies(self, startup: Mapping[str, Any], memory: Mapping[str, Any]) -> bool:
        """Whether a server's figure is this metric's (`when`: e.g. only cold starts for startup_time_cold)."""
        return self.when is None or _walk(_section(startup, memory, self.when[0][0]), self.when[0][1:]) == self.when[1]


def _restart_sections(record: Measured) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    return [(restart.get("startup") or {}, restart.get("memory") or {}) for restart in record.restarts]


def _section(startup: Mapping[str, Any], memory: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    return startup if name == "startup" else memory


def _walk(data: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def _gated(
    name: str,
    unit: str,
    higher: bool,
    relative: float,
    description: str,
    scope: Scope,
    path: tuple[str, ...],
    **extra: Any,
) -> Metric:
    return Metric(name, unit, higher, Tolerance(relative=relative, unit=unit), description, scope, path, **extra)


def _figure(name: str, unit: str, higher: bool, description: str, path: tuple[str, ...], **extra: Any) -> Metric:
    return Metric(name, unit, higher, None, description, "server", path, **extra)


def _startup_time(name: str, cache: str | None, description: str) -> Metric:
    return _figure(
        name,
        "s",
        False,
        f"seconds from launch until the server answered, {description}",
        ("startup", "duration_s"),
        opt_in=True,
        when=(("memory", "compile_cache"), cache),
        tolerance_from="startup_time" if cache else None,
    )


# In the order reports show them: the memory plan, the peaks, serving figures, then context.
# Defaults: memory is nearly deterministic for a fixed config, so 5% catches a real change; KV cache tokens follow
# memory; throughput on shared CI machines wobbles ~5%, hence 10%; latency percentiles are the noisiest, hence 20%.
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        _figure(
            "weights_memory",
            "bytes",
            False,
            "memory the weights took (vLLM's 'Model loading took')",
            ("memory", "weights_gib"),
            scale=GIB,
        ),
        # The pool in GiB is what vLLM sized; the token line is derived from it (max_concurrency x max_model_len on
        # hybrid models, vllm#40691, #51041, #54840), so it is reported and gated only when asked (opt-in).
        _gated(
            "kv_cache_memory",
            "bytes",
            True,
            0.05,
            "memory of the KV cache pool vLLM planned",
            "server",
            ("memory", "kv_cache_gib"),
            scale=GIB,
            kv_sized=True,
        ),
        _figure(
            "kv_cache_tokens",
            "tokens",
            True,
            "KV cache size in tokens reported at startup (derived by vLLM from the pool)",
            ("memory", "kv_cache_tokens"),
            kv_sized=True,
            opt_in=True,
        ),
        # The pool's blocks (V1 reports them on /metrics only). Their size is the release's and the backend's choice
        # (hybrid models raise it to one state page), so a change of block size moves the count with the same GiB:
        # reported, and gated only when asked, as the token line.
        _figure(
            "kv_cache_blocks",
            "blocks",
            True,
            "KV cache blocks vLLM allocated (its /metrics cache_config_info, or V0's '# GPU blocks' line)",
            ("memory", "kv_cache_blocks"),
            kv_sized=True,
            opt_in=True,
        ),
        _figure(
            "max_concurrency",
            "x",
            True,
            "requests of max_model_len tokens the KV cache holds at once",
            ("memory", "max_concurrency"),
            kv_sized=True,
        ),
        _figure(
            "graph_memory",
            "bytes",
            False,
            "memory of the captured CUDA graphs",
            ("memory", "graph_capture_gib"),
            scale=GIB,
        ),
        _gated(
            "startup_peak_memory",
            "bytes",
            False,
            0.05,
            "peak device memory while the server started",
            "server",
            ("startup", "peak_memory_bytes"),
            kv_sized=True,
            transient=True,
        ),
        _gated(
            "load_peak_memory",
            "bytes",
            False,
            0.05,
            "peak device memory while serving the load",
            "load",
            ("peak_memory_bytes",),
            kv_sized=True,
            transient=True,
        ),
        _gated(
            "output_throughput",
            "tok/s",
            True,
            0.10,
            "generated tokens per second over the load",
            "load",
            ("output_throughput",),
        ),
        _gated(
            "request_throughput",
            "req/s",
            True,
            0.10,
            "completed requests per second over the load",
            "load",
            ("request_throughput",),
        ),
        _gated("ttft_p50", "ms", False, 0.20, "median time to first token", "load", ("ttft_ms", "p50"), streamed=True),
        # Reported, gated only with a tolerance set for it: of a few dozen requests the p99 is the slowest one, and it
        # moved +177% to +300% between healthy runs (issue 15).
        Metric(
            "ttft_p99",
            "ms",
            False,
            None,
            "99th percentile time to first token",
            "load",
            ("ttft_ms", "p99"),
            opt_in=True,
            streamed=True,
        ),
        _gated(
            "tpot_p50",
            "ms",
            False,
            0.20,
            "median time per output token after the first",
            "load",
            ("tpot_ms", "p50"),
            streamed=True,
        ),
        # CPU backend only (not measured on GPUs): the server's work per token. A neighbour that takes cores slows
        # the wall clock but also takes the server's CPU time; a slower kernel or more Python per step raises it.
        _gated(
            "cpu_per_token",
            "ms",
            False,
            0.10,
            "server CPU time per generated token (CPU backend)",
            "load",
            ("cpu_ms_per_token",),
        ),
        # Reported, gated with a tolerance set for it: the first startup of a day (cold caches) took 20-35% longer
        # than the later ones on the CI runner (41.8 and 52.5 s vs 33.5-44.2 s, benchmarks/data/gate_noise_ci_*.json).
        # One metric per compile cache state the server's log states (diagnose._compile_figures), as vLLM's
        # `vllm bench startup` times cold and warm startups apart: a cold start is never compared with a warm one.
        _startup_time("startup_time", None, "when its log did not say whether the compile cache answered"),
        _startup_time("startup_time_warm", "warm", "with its compiled graphs loaded from vLLM's compile cache"),
        _startup_time("startup_time_cold", "cold", "with vLLM compiling the model (its compile cache missed)"),
        _figure(
            "startup_free_memory",
            "bytes",
            True,
            "device memory free when the server started (GPU log); less than the baseline's: another tenant",
            ("memory", "startup_free_gib"),
            scale=GIB,
        ),
        _figure(
            "requested_memory",
            "bytes",
            False,
            "memory vLLM reserved: utilization x device memory (CPU log)",
            ("memory", "requested_gib"),
            scale=GIB,
        ),
        _figure(
            "device_memory",
            "bytes",
            True,
            "memory vLLM sized its reservation from (CPU: the NUMA node)",
            ("memory", "device_total_gib"),
            scale=GIB,
        ),
    )
}
GATED: tuple[str, ...] = tuple(name for name, metric in METRICS.items() if metric.gated)


# A load during which other processes took more than this share of the host's CPU (LoadResult.others_cpu_share) ran
# on a busy runner: on the 2-core CI runner such loads read 20-45% lower throughput and 40-50% more CPU per token
# (memory/host_cpu.py). A quiet runner's own background (kernel, the plugin's watchdog) stays under 5%.
BUSY_SHARE = 0.15


def busy_load(load: Mapping[str, Any]) -> bool:
    """True when the load ran while other processes took more than BUSY_SHARE of the host's CPU."""
    share = load.get("others_cpu_share")
    return isinstance(share, (int, float)) and share > BUSY_SHARE


def quiet_loads(loads: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The loads the gate judges: those a busy runner ran (busy_load) left out where quiet ones exist, else all."""
    return [load for load in loads if not busy_load(load)] or list(loads)


# The streamed latencies (TTFT, TPOT) are timed when each token chunk reached the client (load/client.py). When the
# client, or the API server feeding it, falls behind the engine, chunks queue up and several arrive in one read: their
# intervals read 0, TTFT grows by the wait and TPOT shrinks, and the figures time the reader, not the server. In the
# collected CPU sessions (benchmarks/data/gate_noise_ci_2026-12-02_*.json, 84 loads) the 19 loads with more than half
# their intervals at 0 held every extreme latency: TPOT 0.00-0.34x and TTFT up to 5.2x their config's median; the
# others stayed within 0.54-1.58x. Such a load's throughput and memory still count; its streamed latencies do not.
COALESCED_SHARE = 0.5


def coalesced_share(load: Mapping[str, Any]) -> float | None:
    """The share of the load's token intervals that read 0 (chunks that reached the client in one read); None when
    the load kept no intervals (one token per request, or a results file from before samples were kept)."""
    intervals = _walk(load, (SAMPLES_KEY, "itl"))
    if not isinstance(intervals, Sequence) or not intervals:
        return None
    return sum(1 for interval in intervals if interval == 0) / len(intervals)


def coalesced_load(load: Mapping[str, Any]) -> bool:
    """True when more than COALESCED_SHARE of the load's token intervals read 0: its TTFT and TPOT time the client."""
    share = coalesced_share(load)
    return share is not None and share > COALESCED_SHARE


def record_samples(record: Measured) -> dict[str, list[float]]:
    """Every catalogue metric measured in `record`, with its samples (catalogue order)."""
    samples = {name: metric.read(record) for name, metric in METRICS.items()}
    return {name: values for name, values in samples.items() if values}


_UNIT_SUFFIXES = {"tokens": ("tokens", "token", "tok"), "tok/s": ("tok/s",), "req/s": ("req/s",)}
_ABSOLUTE_EXAMPLES = {
    "bytes": "a size such as '256MiB', '1GiB', '2GB' (GB = 10^9 bytes, GiB = 2^30) or plain bytes",
    "ms": "a duration such as '50ms', '1.5s' or plain milliseconds",
    "tokens": "a token count such as '1000'",
    "tok/s": "tokens per second such as '50'",
    "req/s": "requests per second such as '2'",
    "s": "seconds such as '10'",
}


def _tolerance_error(text: str, metric: Metric, problem: str = "is not understood") -> ToleranceError:
    examples = _ABSOLUTE_EXAMPLES.get(metric.unit, f"a number in {metric.unit}")
    return ToleranceError(
        f"Tolerance {text!r} for {metric.name} {problem}. Accepted: a percentage of the baseline such as '10%', "
        f"or an absolute amount in the metric's unit ({metric.unit}): {examples}. A bare number is an absolute "
        "amount, not a fraction: write '15%', not '0.15', for a relative tolerance."
    )


def parse_tolerance(text: str, metric: Metric) -> Tolerance:
    """`"15%"` -> relative 0.15; anything else is absolute in the metric's unit: `"256MiB"`, `"2GB"` -> bytes,
    `"50ms"`, `"1.5s"` -> ms, `"100"` -> 100 of the unit. A bare fraction for a bytes or tokens metric (`"0.15"`)
    is refused as a likely mistaken percentage."""
    raw = str(text).strip()
    if raw.endswith("%"):
        amount = split_amount(raw[:-1])
        if amount is None or amount[1]:
            raise _tolerance_error(text, metric)
        return Tolerance(relative=amount[0] / 100, unit=metric.unit)
    amount = split_amount(raw)
    if amount is None:
        raise _tolerance_error(text, metric)
    number, suffix = amount
    if not suffix and metric.unit in ("bytes", "tokens") and not number.is_integer():
        raise _tolerance_error(text, metric, f"would mean {number:g} {metric.unit}, a fraction of one")
    try:
        if metric.unit == "bytes":
            absolute = float(parse_size(raw))
        elif metric.unit == "ms":
            absolute = parse_duration_ms(raw)
        elif not suffix or suffix in _UNIT_SUFFIXES.get(metric.unit, (metric.unit.lower(),)):
            absolute = number
        else:
            raise _tolerance_error(text, metric, f"has a unit ({suffix}) that does not fit {metric.unit}")
    except UnitError:
        raise _tolerance_error(text, metric, f"has a unit ({suffix}) that does not fit {metric.unit}") from None
    return Tolerance(absolute=absolute, unit=metric.unit)


def _unknown_metric(name: str, where: str) -> ToleranceError:
    known = ", ".join(name for name, metric in METRICS.items() if metric.gated or metric.opt_in)
    if name in METRICS:
        return ToleranceError(
            f"{where}{name} is a report-only figure: it is shown next to its baseline but never "
            f"gated, so it takes no tolerance. Gated metrics: {known}."
        )
    return ToleranceError(f"{where}unknown metric {name!r}. Known metrics: {known}.")


def _gated_metric(name: str, where: str) -> Metric:
    metric = METRICS.get(name)
    if metric is None or (metric.default_tolerance is None and not metric.opt_in):
        raise _unknown_metric(name, where)
    return metric


def parse_tolerance_spec(text: str, *, source: str | None = None) -> dict[str, Tolerance]:
    """`"output_throughput=15%,load_peak_memory=256MiB"` -> per-metric tolerances. `source` (e.g. the option name)
    prefixes error messages so users know which setting to fix."""
    where = f"In {source} {text!r}: " if source else f"In tolerance spec {text!r}: "
    result: dict[str, Tolerance] = {}
    for part in str(text).split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ToleranceError(
                f"{where}{part.strip()!r} is not METRIC=TOLERANCE. Write comma-separated pairs such as "
                "'output_throughput=15%,load_peak_memory=256MiB'."
            )
        metric = _gated_metric(name, where)
        if name in result:
            raise ToleranceError(f"{where}{name} is given twice; give each metric once.")
        try:
            result[name] = parse_tolerance(value, metric)
        except ToleranceError as error:
            raise ToleranceError(f"{where}{error}") from None
    return result


def parse_tolerance_mapping(
    mapping: Mapping[str, str | Tolerance], *, source: str | None = None
) -> dict[str, Tolerance]:
    """Marker form: `{"output_throughput": "15%"}`. Values are strings (parsed like the CLI) or Tolerance objects;
    plain numbers are refused because 0.15 could mean 15% or an absolute 0.15."""
    where = f"In {source}: " if source else ""
    result: dict[str, Tolerance] = {}
    for name, value in mapping.items():
        metric = _gated_metric(name, where)
        if isinstance(value, Tolerance):
            result[name] = value
        elif isinstance(value, str):
            try:
                result[name] = parse_tolerance(value, metric)
            except ToleranceError as error:
                raise ToleranceError(f"{where}{error}") from None
        else:
            raise ToleranceError(
                f"{where}tolerance for {name} is {value!r}; pass a string: a percentage such as '15%', or an "
                f"absolute amount in {metric.unit} ({_ABSOLUTE_EXAMPLES.get(metric.unit, 'a number')})."
            )
    return result


def resolve_tolerances(
    cli: Mapping[str, Tolerance], ini: Mapping[str, Tolerance], marker: Mapping[str, Tolerance]
) -> dict[str, Tolerance]:
    """Per metric, the most specific setting wins: marker > command line > ini > the metric's default. A tolerance
    for a metric others take theirs from (`startup_time`) applies to them too, unless the same layer sets theirs."""
    resolved = {
        name: metric.default_tolerance for name, metric in METRICS.items() if metric.default_tolerance is not None
    }
    for layer in (ini, cli, marker):
        for name, metric in METRICS.items():
            if metric.tolerance_from is not None and metric.tolerance_from in layer and name not in layer:
                resolved[name] = layer[metric.tolerance_from]
        resolved.update(layer)
    return resolved
