"""The tuner: the highest (or lowest) gpu_memory_utilization that starts and survives a concurrent load on a tier.

Each trial is one fresh server (through the Session, so tier emulation and flag checks apply), one short measured
load, a peak check against the tier, and a stop. Trials are expensive (a startup can take a minute), so the search
is a bisection over a grid of `resolution` steps with a hard cap on startups.

Monotonicity is assumed and checked, not hoped for: the values that work form one interval. Above it vLLM runs out
of memory (cuda_oom, a peak over the tier, host RAM exhausted); below it the budget is too small (the KV cache
cannot hold one sequence, or on the CPU backend the worker's share is used up before the KV cache). Every failure
kind says which side of the interval it is on, so a failure on the wrong side (the high end failing for too little
memory) ends the search with that diagnosis instead of a wrong answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.kinds import FailureKind, is_failure_kind
from pytest_vllm_mem.launch.flagcheck import ParserTable, flag_problems
from pytest_vllm_mem.launch.launcher import RunningServer
from pytest_vllm_mem.launch.server import VLLMStartupError
from pytest_vllm_mem.load.client import LoadSpec
from pytest_vllm_mem.load.measure import measure_load
from pytest_vllm_mem.memory import DeviceInfo
from pytest_vllm_mem.plan.memory_plan import Plan
from pytest_vllm_mem.tiers import Emulation, Tier
from pytest_vllm_mem.units import GIB, format_bytes


class Releasable(Protocol):
    def release_all(self) -> None: ...


class TuneSession(Protocol):
    """What the tuner uses of a session (launch.pool.Session; a test's fake implements the same)."""

    @property
    def tier(self) -> Tier: ...
    @property
    def device(self) -> DeviceInfo: ...
    @property
    def parser_table(self) -> ParserTable: ...
    @property
    def pool(self) -> Releasable: ...
    @property
    def preflight(self) -> bool: ...
    def device_total_now(self, config: VLLMConfig | None = None) -> int: ...
    def launched_config(self, config: VLLMConfig) -> tuple[VLLMConfig, Emulation | None, list[str]]: ...
    def launch(self, config: VLLMConfig) -> RunningServer: ...
    def plan(self, config: VLLMConfig, launched: VLLMConfig) -> Plan | None: ...


UTILIZATION_FLAG = "gpu_memory_utilization"

# Which side of the working interval a failure lies on.
TOO_HIGH = "too_high"  # more memory than the tier (or the host) has: lower the utilization
TOO_LOW = "too_low"  # too little budget for the KV cache: raise the utilization
NOT_MEMORY = "not_memory"  # no utilization fixes it (bad flag, weights larger than the device, a crash at startup)
OK: Literal["ok"] = "ok"
# A trial's outcome: it worked, or the kind of failure it ended with.
Outcome = FailureKind | Literal["ok"]

_TOO_HIGH_KINDS: frozenset[FailureKind] = frozenset({"cuda_oom", "insufficient_free_memory", "tier_exceeded"})
# external_weights_over_budget: weights held outside vLLM (another process, IPC) exceed what the utilization grants;
# a larger utilization grants more (vLLM: "Increase GPU memory utilization or reduce GPU memory used by ...").
_TOO_LOW_KINDS: frozenset[FailureKind] = frozenset({"kv_cache_insufficient", "external_weights_over_budget"})

GOALS = ("auto", "highest", "lowest")
# GPU: the question is how much of the card a server may take before it runs out of memory under load.
GPU_RANGE = (0.5, 0.95)
# CPU: utilization sizes the KV cache from host RAM, so a higher value only reserves more RAM; what fails is a value
# too small for the worker's non-KV memory (about 0.85 GiB for the tiny model), so the question is the lowest.
CPU_RANGE = (0.05, 0.5)
DEFAULT_RESOLUTION = 0.05
DEFAULT_MAX_STARTUPS = 6


class TuneError(ValueError):
    """Tuner input that cannot be searched: one paragraph naming the input and what is accepted."""


# The short concurrent load each started server must survive: a trial's load should take seconds, not minutes.
TUNE_LOAD = LoadSpec(num_prompts=32, concurrency=8, max_tokens=16, timeout_s=300.0)


@dataclass
class Trial:
    """One startup at one utilization: `outcome` is "ok" or a failure kind, `side` where that puts the value."""

    utilization: float
    outcome: Outcome
    side: str
    summary: str = ""
    peak_memory_bytes: int | None = None  # the server's total over its devices
    kv_cache_tokens: int | None = None
    output_throughput: float | None = None
    duration_s: float = 0.0
    largest_gpu_peak_bytes: int | None = None  # the fullest GPU's peak: what a tier limits; None without per-GPU
    phase: str = "startup"  # where it failed: "startup", "load" or "peak"; "" when ok
    log_path: str | None = None
    advice: list[str] = field(default_factory=list)
    number: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def tier_peak_bytes(self) -> int | None:
        """The peak held against the tier: a tier is one GPU's memory, so the fullest GPU's (a TP=2 server spreads
        its total over two); the total on the CPU backend and for a single device."""
        return self.largest_gpu_peak_bytes if self.largest_gpu_peak_bytes is not None else self.peak_memory_bytes

    @property
    def started(self) -> bool:
        """A server was started for this trial (the plan decides some without one)."""
        return self.phase != "planned"

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "gpu_memory_utilization": self.utilization,
            "outcome": self.outcome,
            "side": self.side,
            "phase": self.phase,
            "summary": self.summary,
            "peak_memory_bytes": self.peak_memory_bytes,
            "largest_gpu_peak_bytes": self.largest_gpu_peak_bytes,
            "kv_cache_tokens": self.kv_cache_tokens,
            "output_throughput": self.output_throughput,
            "duration_s": round(self.duration_s, 2),
            "log": self.log_path,
            "advice": list(self.advice),
        }


def failure_side(kind: str, figures: dict[str, float] | None = None, *, during_load: bool = False) -> str:
    """TOO_HIGH, TOO_LOW or NOT_MEMORY for a failure kind (kinds.FAILURE_KINDS; a plan verdict is one too).

    host_memory is both: on the CPU backend a negative KV share ("requested memory for kv (-0.62/0.21 GiB)") means
    the utilization left nothing after the worker's own memory (too low); any other host-RAM failure means the
    reservation did not fit in RAM (too high). A crash during the load is taken as memory (the OOM killer's SIGKILL
    looks like one); a crash or timeout at startup happens at any utilization.
    """
    if kind == OK:
        return OK
    if kind == "host_memory":
        kv = (figures or {}).get("kv_requested_gib")
        return TOO_LOW if kv is not None and kv <= 0 else TOO_HIGH
    if kind in _TOO_LOW_KINDS:
        return TOO_LOW
    if kind in _TOO_HIGH_KINDS or (during_load and kind == "crash"):
        return TOO_HIGH
    return NOT_MEMORY


# ---------------------------------------------------------------------------------------------------------------
# The search, independent of vLLM: a trial function maps a utilization to a Trial.


def candidate_values(low: float, high: float, resolution: float) -> list[float]:
    """The grid searched: low, low + resolution, ... and high itself (the last step may be shorter)."""
    check_range(low, high, resolution)
    values = []
    step = 0
    while True:
        value = round(low + step * resolution, 6)
        if value >= high - 1e-9:
            break
        values.append(value)
        step += 1
    return [*values, round(high, 6)]


def check_range(low: float, high: float, resolution: float, max_startups: int = 1) -> None:
    for name, value in (("low", low), ("high", high)):
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise TuneError(f"{name}={value!r}: a gpu_memory_utilization must be a fraction in (0, 1], e.g. 0.9.")
    if low >= high:
        raise TuneError(
            f"low={low!r}, high={high!r}: the range is empty; low must be below high (e.g. low=0.5, high=0.95)."
        )
    if not isinstance(resolution, (int, float)) or resolution <= 0 or resolution > high - low + 1e-9:
        raise TuneError(
            f"resolution={resolution!r}: the search step must be above 0 and at most high - low "
            f"({high - low:g}), e.g. 0.05."
        )
    if not isinstance(max_startups, int) or max_startups < 1:
        raise TuneError(f"max_startups={max_startups!r}: the number of server startups must be 1 or more.")


@dataclass
class SearchResult:
    goal: str  # "highest" or "lowest"
    low: float
    high: float
    resolution: float
    max_startups: int
    trials: list[Trial]
    best: Trial | None  # the recommended trial: the highest (lowest) value that worked
    first_failing: Trial | None  # the failing neighbour of `best` on the far side, when one was tried
    converged: bool  # best and first_failing are one grid step apart (or best is the end of the range)
    verdict: str  # one paragraph: what was found, or why nothing was

    @property
    def startups(self) -> int:
        """Trials that started a server; the ones the plan decided cost none."""
        return sum(1 for trial in self.trials if trial.started)

    def to_dict(self) -> dict[str, Any]:
        return {
            "goal": self.goal,
            "low": self.low,
            "high": self.high,
            "resolution": self.resolution,
            "max_startups": self.max_startups,
            "startups": self.startups,
            "planned_trials": len(self.trials) - self.startups,
            "converged": self.converged,
            "recommended_utilization": self.best.utilization if self.best else None,
            "first_failing_utilization": self.first_failing.utilization if self.first_failing else None,
            "verdict": self.verdict,
            "trials": [trial.to_dict() for trial in self.trials],
        }


def _fmt(value: float) -> str:
    return f"{value:g}"


def search(
    run_trial: Callable[[float], Trial],
    *,
    low: float,
    high: float,
    resolution: float = DEFAULT_RESOLUTION,
    max_startups: int = DEFAULT_MAX_STARTUPS,
    goal: str = "highest",
) -> SearchResult:
    """Bisect the grid for the highest (goal="highest") or lowest (goal="lowest") value whose trial is ok.

    Written for goal="highest"; "lowest" runs the same code on the reversed grid with the two failure sides swapped.
    The far end is tried first (it is the answer when it works), then the grid is halved: `lo` is the lowest index
    that may still be the answer (known ok or untried), `hi` the lowest index known to fail past the answer.
    """
    check_range(low, high, resolution, max_startups)
    if goal not in ("highest", "lowest"):
        raise TuneError(f"goal={goal!r}: accepted goals are 'highest' and 'lowest' ('auto' is resolved by tune()).")
    values = candidate_values(low, high, resolution)
    order = values if goal == "highest" else values[::-1]
    past, short = (TOO_HIGH, TOO_LOW) if goal == "highest" else (TOO_LOW, TOO_HIGH)
    trials: list[Trial] = []
    tried: dict[int, Trial] = {}

    def attempt(index: int) -> Trial:
        trial = run_trial(order[index])
        trial.number = len(trials) + 1
        trials.append(trial)
        tried[index] = trial
        return trial

    last = len(order) - 1
    lo, lo_ok, hi = 0, False, last + 1
    stop: Trial | None = None  # a failure that ends the search (wrong side at the far end, or not about memory)
    first = attempt(last)
    if first.ok:
        lo, lo_ok = last, True
    elif first.side == past:
        hi = last
    else:
        stop = first

    def startups() -> int:  # trials the plan decided cost no startup and do not count
        return sum(1 for trial in trials if trial.started)

    while stop is None and lo <= hi - 1 and not (lo_ok and lo == hi - 1) and startups() < max_startups:
        mid = (lo + hi) // 2 if lo_ok else (lo + hi - 1) // 2
        trial = attempt(mid)
        if trial.ok:
            lo, lo_ok = mid, True
        elif trial.side == past:
            hi = mid
        elif trial.side == short:
            lo, lo_ok = mid + 1, False
        else:
            stop = trial
    best = tried[lo] if lo_ok else None
    first_failing = tried.get(hi) if hi <= last else None
    converged = best is not None and lo == hi - 1
    verdict = _verdict(goal, order, trials, best, first_failing, converged, stop, short, lo, hi, max_startups)
    return SearchResult(goal, low, high, resolution, max_startups, trials, best, first_failing, converged, verdict)


def _verdict(
    goal: str,
    order: list[float],
    trials: list[Trial],
    best: Trial | None,
    first_failing: Trial | None,
    converged: bool,
    stop: Trial | None,
    short: str,
    lo: int,
    hi: int,
    max_startups: int,
) -> str:
    word, far, flag = ("highest", "top", "--high") if goal == "highest" else ("lowest", "bottom", "--low")
    near_flag = "--low" if goal == "highest" else "--high"
    direction = "raise" if goal == "highest" else "lower"
    if stop is not None and stop is trials[0]:
        if stop.side == short:
            cause = "too little memory" if goal == "highest" else "too much memory"
            return (
                f"the {far} of the range ({_fmt(stop.utilization)}) fails with {stop.outcome}, a failure of "
                f"{cause} ({stop.summary}): every value beyond it toward {near_flag} fails the same way, so the "
                f"range points the wrong way. {'Raise --high' if goal == 'highest' else 'Lower --low'} "
                f"(or search for the {'lowest' if goal == 'highest' else 'highest'} working value instead)."
            )
        return (
            f"the first trial failed with {stop.outcome}, which no utilization fixes: {stop.summary}. "
            "Fix that first (see the log), then tune again."
        )
    if stop is not None:
        prefix = (
            f"stopped at {_fmt(stop.utilization)}: it failed with {stop.outcome}, which is not about the "
            f"memory budget ({stop.summary}). "
        )
        if best is None:
            return prefix + "No working value was found before it."
        return prefix + f"The {word} working value found before it is {_fmt(best.utilization)}."
    if best is not None:
        if first_failing is None and lo == len(order) - 1:
            return (
                f"the {far} of the range ({_fmt(best.utilization)}) works: the boundary lies beyond it; "
                f"{direction} {flag} to look further."
            )
        if converged and first_failing is not None:
            margin = "" if goal == "highest" else " It is the smallest budget that works: leave a margin above it."
            return (
                f"{word} working gpu_memory_utilization: {_fmt(best.utilization)}; "
                f"{_fmt(first_failing.utilization)} fails with {first_failing.outcome}.{margin}"
            )
        gap = f"between {_fmt(best.utilization)} (works) and {_fmt(order[hi]) if hi < len(order) else flag} (fails)"
        return (
            f"best found {_fmt(best.utilization)}, but the boundary {gap} is not resolved to the resolution "
            f"after {len(trials)} startups (the limit is {max_startups}): raise --max-startups or the resolution."
        )
    if lo > hi - 1:
        failing = sorted(trials, key=lambda t: t.utilization)
        return (
            "no gpu_memory_utilization in the range worked: "
            + "; ".join(f"{_fmt(t.utilization)} fails with {t.outcome}" for t in failing)
            + ". Where values fail both for too little and too much memory, the working window (if any) is "
            "narrower than the resolution: lower it. Where all fail for too much memory, the model does not "
            "fit this tier: shorten max_model_len, add enforce_eager, or use a larger tier."
        )
    return (
        f"no working value found within {len(trials)} startups (the limit is {max_startups}): raise "
        "--max-startups or narrow the range."
    )


# ---------------------------------------------------------------------------------------------------------------
# Real trials: a fresh vLLM server per value, through the session state.


def largest_gpu_peak(*per_gpu: Sequence[int]) -> int | None:
    """The fullest GPU's peak over per-GPU series (startup, load); None where none has per-GPU figures (CPU)."""
    return max((peak for series in per_gpu for peak in series), default=None)


def run_trial(
    state: TuneSession,
    config: VLLMConfig,
    utilization: float,
    load: LoadSpec,
    tier: Tier,
    out: Callable[[str], None] = print,
) -> Trial:
    """Start `config` at `utilization` (in terms of the tier), run `load`, check the peak, stop the server."""
    trial_config = config.with_flags(**{UTILIZATION_FLAG: utilization})
    started = time.monotonic()
    state.pool.release_all()  # every trial a fresh server: a reused one would not test this value's startup
    try:
        try:
            server = state.launch(trial_config)
        except VLLMStartupError as error:
            memory = error.memory
            return Trial(
                utilization,
                error.kind,
                failure_side(error.kind, error.diagnosis.figures),
                summary=error.diagnosis.summary,
                peak_memory_bytes=error.startup.peak_memory_bytes or None,
                largest_gpu_peak_bytes=largest_gpu_peak(error.startup.peak_memory_per_gpu),
                kv_cache_tokens=memory.kv_cache_tokens if memory else None,
                duration_s=time.monotonic() - started,
                log_path=str(error.log_path) if error.log_path else None,
                advice=list(error.advice),
            )
        memory = server.memory
        kv_tokens = memory.kv_cache_tokens if memory else None
        startup_s = server.startup.duration_s if server.startup else time.monotonic() - started
        out(
            f"    server up in {startup_s:.0f} s"
            + (f", KV cache {kv_tokens:,} tokens" if kv_tokens else "")
            + f"; load: {load.num_prompts} prompts, {load.concurrency} concurrent, {load.max_tokens} tokens each"
        )
        result = measure_load(server, load)
        startup_peak = server.startup.peak_memory_bytes if server.startup else 0
        peak = max(startup_peak, result.peak_memory_bytes or 0) or None
        largest = largest_gpu_peak(
            server.startup.peak_memory_per_gpu if server.startup else (), result.peak_memory_per_gpu
        )
        trial = Trial(
            utilization,
            OK,
            OK,
            peak_memory_bytes=peak,
            kv_cache_tokens=kv_tokens,
            largest_gpu_peak_bytes=largest,
            output_throughput=result.output_throughput,
            phase="",
            log_path=str(server.log_path),
        )
        if result.failure is not None:
            failure = result.failure
            trial.outcome, trial.phase = failure.kind, "load"
            trial.side = failure_side(failure.kind, failure.figures, during_load=True)
            trial.summary, trial.advice = failure.summary, list(result.advice)
        elif not result.ok:
            first = result.errors[0].text if result.errors else "no error text"
            trial.outcome, trial.side, trial.phase = "load_errors", NOT_MEMORY, "load"
            trial.summary = (
                f"{result.failed} of {result.num_prompts} requests failed with the server alive and no "
                f"memory error in its log (first: {first})"
            )
        elif (tier_peak := trial.tier_peak_bytes) is not None and tier_peak > tier.bytes:
            trial.outcome, trial.side, trial.phase = "tier_exceeded", TOO_HIGH, "peak"
            fullest = "" if largest is None or largest == peak else "on the fullest GPU "
            trial.summary = (
                f"peak {fullest}{format_bytes(tier_peak)} exceeds the {tier} tier "
                f"({format_bytes(tier.bytes)}) by {format_bytes(tier_peak - tier.bytes)}"
            )
        trial.duration_s = time.monotonic() - started
        return trial
    finally:
        state.pool.release_all()


def planned_trial(state: TuneSession, config: VLLMConfig, utilization: float) -> Trial | None:
    """A trial the plan decides without a startup: predicted not to fit at both ends of its estimate range (a
    calibration from an earlier startup of the same model narrows that range to the KV arithmetic). None: run it."""
    trial_config = config.with_flags(**{UTILIZATION_FLAG: utilization})
    launched, _, _ = state.launched_config(trial_config)
    result = state.plan(trial_config, launched)
    if result is None or result.fits or not result.sure or not is_failure_kind(result.verdict):
        return None
    side = failure_side(result.verdict, {"kv_requested_gib": result.kv_bytes.value / GIB})
    return Trial(
        utilization,
        result.verdict,
        side,
        summary=f"planned, no startup: {result.summary}",
        kv_cache_tokens=result.kv_tokens.value,
        phase="planned",
    )


def trial_line(trial: Trial, max_startups: int) -> str:
    """`trial 3/6  gpu_memory_utilization=0.0625  ok           peak 1.9 GiB  KV 150,000 tokens  2,010 tok/s  (41 s)`"""
    parts = [
        f"trial {trial.number}/{max_startups}",
        f"{UTILIZATION_FLAG}={_fmt(trial.utilization):<7}",
        f"{trial.outcome:<12}",
    ]
    if trial.peak_memory_bytes:
        parts.append(f"peak {format_bytes(trial.peak_memory_bytes)}")
        if trial.largest_gpu_peak_bytes is not None and trial.largest_gpu_peak_bytes != trial.peak_memory_bytes:
            parts[-1] += f" (fullest GPU {format_bytes(trial.largest_gpu_peak_bytes)})"
    if trial.kv_cache_tokens:
        parts.append(f"KV {trial.kv_cache_tokens:,} tokens")
    if trial.output_throughput:
        parts.append(f"{trial.output_throughput:,.0f} tok/s")
    parts.append(f"({trial.duration_s:.0f} s)")
    line = "  ".join(parts)
    if not trial.ok:
        where = {"load": "during the load: ", "peak": ""}.get(trial.phase, "at startup: ")
        line += f"\n    {where}{trial.summary}"
    return line


@dataclass
class TuneResult:
    """What tune() found: the search, the tier, and the recommended command with its headroom."""

    search: SearchResult
    model: str
    flags: dict[str, Any]
    tier: Tier
    load: LoadSpec
    duration_s: float
    env: dict[str, str] = field(default_factory=dict)

    @property
    def recommended(self) -> Trial | None:
        return self.search.best

    @property
    def ok(self) -> bool:
        return self.search.best is not None

    @property
    def recommended_config(self) -> VLLMConfig | None:
        best = self.search.best
        return (
            None
            if best is None
            else VLLMConfig(self.model, env=self.env, **{**self.flags, UTILIZATION_FLAG: best.utilization})
        )

    @property
    def headroom_bytes(self) -> int | None:
        best = self.search.best
        if best is None or not best.tier_peak_bytes:
            return None
        return self.tier.bytes - best.tier_peak_bytes

    def summary_lines(self) -> list[str]:
        search = self.search
        lines = [search.verdict]
        best, failing = search.best, search.first_failing
        if best is not None and failing is not None:
            lines.append(
                f"boundary: {_fmt(best.utilization)} works, {_fmt(failing.utilization)} fails ({failing.outcome})"
            )
        if best is not None:
            headroom = ""
            if best.tier_peak_bytes:
                fullest = "" if best.tier_peak_bytes == best.peak_memory_bytes else " on the fullest GPU"
                headroom = (
                    f"  (headroom: peak{fullest} {format_bytes(best.tier_peak_bytes)} of the {self.tier} "
                    f"tier = {format_bytes(self.tier.bytes - best.tier_peak_bytes)} free)"
                )
            lines.append(f"recommended: {self.recommended_config}{headroom}")
        planned = len(search.trials) - search.startups
        decided = f" ({planned} more trial{'s' if planned != 1 else ''} decided by the plan)" if planned else ""
        lines.append(f"{search.startups} startups in {self.duration_s:.0f} s{decided}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        config = self.recommended_config
        flags = VLLMConfig(self.model, **self.flags).masked_flags()  # the JSON may be shared: no tokens in it
        return {
            "model": self.model,
            "flags": flags,
            "tier": self.tier.name,
            "tier_bytes": self.tier.bytes,
            "load": {
                "num_prompts": self.load.num_prompts,
                "concurrency": self.load.concurrency,
                "max_tokens": self.load.max_tokens,
                "prompt_len": self.load.prompt_len,
            },
            "recommended_command": str(config) if config else None,
            "headroom_bytes": self.headroom_bytes,
            "duration_s": round(self.duration_s, 1),
            **self.search.to_dict(),
        }


def resolve_goal(goal: str, backend: str) -> str:
    """ "auto": the highest working value on a GPU, the lowest on the CPU backend (see CPU_RANGE)."""
    if goal not in GOALS:
        raise TuneError(
            f"goal={goal!r}: accepted goals are {', '.join(GOALS)} (auto: highest on a GPU, lowest on "
            "the CPU backend, where a higher utilization only reserves more host RAM)."
        )
    if goal != "auto":
        return goal
    return "lowest" if backend == "cpu" else "highest"


def _refuse_config(state: TuneSession, config: VLLMConfig) -> None:
    """TuneError for a search that cannot run: under --vllm-preflight, or a config that sets the utilization."""
    if state.preflight:
        raise TuneError(
            "the tuner starts a server per trial and --vllm-preflight starts none: run it without "
            "--vllm-preflight, or plan the utilization range with `python -m pytest_vllm_mem plan`."
        )
    if config.flag(UTILIZATION_FLAG) is not None:
        raise TuneError(
            f"the config sets {UTILIZATION_FLAG}={config.flag(UTILIZATION_FLAG)}: that is the value "
            "the tuner searches; remove it and give the range with low/high instead."
        )


def _check_tier_and_flags(state: TuneSession, highest: VLLMConfig) -> Emulation | None:
    """The tier emulation of the highest trial; TuneError for a tier larger than the device or flags vLLM rejects
    (the same at every utilization: refused before spending a startup)."""
    tier = state.tier
    device_total = state.device_total_now()  # a VM's CPU node can grow or shrink within a session
    if tier.bytes > device_total:
        raise TuneError(
            f"the {tier} tier ({format_bytes(tier.bytes)}) is larger than this device "
            f"({state.device.name}, {format_bytes(device_total)}): a larger tier cannot be "
            "emulated on it. Pick a tier up to the device's size, or auto."
        )
    launched, emulation, _notes = state.launched_config(highest)
    problems = flag_problems(launched, state.parser_table)
    if problems:
        raise TuneError("; ".join(problems))
    return emulation


def tune(
    state: TuneSession,
    config: VLLMConfig,
    *,
    low: float | None = None,
    high: float | None = None,
    resolution: float = DEFAULT_RESOLUTION,
    max_startups: int = DEFAULT_MAX_STARTUPS,
    goal: str = "auto",
    load: LoadSpec | None = None,
    out: Callable[[str], None] = print,
) -> TuneResult:
    """Search `config` over gpu_memory_utilization on the session's tier (state.tier; --vllm-gpu / --tier).

    The utilization is in terms of the tier: on a larger device SessionState scales it (tier emulation). Prints a
    "starting trial" line before each startup and a result line after it through `out`. Raises TuneError for input
    that cannot be searched (before any startup); KeyboardInterrupt stops the running server on its way out.
    """
    _refuse_config(state, config)
    backend = state.device.backend
    goal = resolve_goal(goal, backend)
    default_low, default_high = CPU_RANGE if backend == "cpu" else GPU_RANGE
    low = default_low if low is None else low
    high = default_high if high is None else high
    check_range(low, high, resolution, max_startups)
    load = TUNE_LOAD if load is None else load
    tier = state.tier
    emulation = _check_tier_and_flags(state, config.with_flags(**{UTILIZATION_FLAG: high}))

    started = time.monotonic()
    shown_flags = config.short_id()

    def one_trial(utilization: float) -> Trial:
        number = len(trials_done) + 1
        out(
            f"starting trial {number}/{max_startups}: {UTILIZATION_FLAG}={_fmt(utilization)}"
            + (f" {shown_flags}" if shown_flags != "defaults" else "")
            + f" on the {tier} tier ..."
        )
        trial = planned_trial(state, config, utilization) or run_trial(state, config, utilization, load, tier, out)
        trial.number = number
        trials_done.append(trial)
        out(trial_line(trial, max_startups))
        return trial

    trials_done: list[Trial] = []
    out(
        f"tuning {config.model} on the {tier} tier ({state.device.name}, {backend}): the {goal} working "
        f"{UTILIZATION_FLAG} in [{_fmt(low)}, {_fmt(high)}], step {_fmt(resolution)}, at most {max_startups} "
        "startups"
    )
    if emulation is not None:
        out(
            f"tier emulation: each value is scaled by {tier.bytes / emulation.device_total_bytes:.3f} on this "
            f"{format_bytes(emulation.device_total_bytes)} device, so vLLM plans for the tier's memory"
        )
    result = search(one_trial, low=low, high=high, resolution=resolution, max_startups=max_startups, goal=goal)
    tuned = TuneResult(
        result, config.model, dict(config.flags), tier, load, time.monotonic() - started, env=dict(config.env)
    )
    for line in tuned.summary_lines():
        out(line)
    return tuned
