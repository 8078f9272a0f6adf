"""Concurrent streaming load against a vLLM OpenAI-compatible server, measured as `vllm bench serve` measures.

Definitions follow vllm/benchmarks/serve.py and lib/endpoint_request_func.py so numbers compare with the benchmark:
streaming POST /v1/completions with `stream_options.include_usage`; TTFT = send to first token chunk; ITL = every gap
between token chunks, pooled over requests; TPOT = (E2EL - TTFT) / (output tokens - 1) per request with more than one
output token; E2EL = send to last token chunk; output tokens from the server's final `usage` chunk; duration = first
send to last completion; percentiles with numpy over successful requests, in milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args

import aiohttp

from pytest_vllm_mem.baseline.summary import SAMPLES_KEY, latency_summary, to_us
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis
from pytest_vllm_mem.progress import LoadEnded, watch_load

# Why one request failed (a request failure is data in LoadResult.errors, never a failure kind of the server).
RequestErrorKind = Literal["http_4xx", "http_5xx", "connection", "timeout", "stream", "aborted"]
ERROR_KINDS: tuple[RequestErrorKind, ...] = get_args(RequestErrorKind)
_MAX_ERRORS_KEPT = 10
_MAX_ERROR_TEXT = 300
_ABORT_POLL_S = 0.2
# After cancelling outstanding requests, wait at most this long for them to unwind before returning.
_CANCEL_GRACE_S = 0.5

# Short common words: a byte-level BPE trained on English text keeps most of them as one token (with the leading
# space), so N words is roughly N tokens without loading a tokenizer.
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by hot word but what some "
    "we can out other were all there when up use your how said an each she which do their time if will way about "
    "many then them write would like so these her long make thing see him two has look more day could go come did "
    "number sound no most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every good me give our "
    "under name very through just form sentence great think say help low line differ turn cause much mean before "
    "move right boy old too same tell does set three want air well also play small end put home read hand port "
    "large spell add even land here must big high such follow act why ask men change went light kind off need house"
).split()


class LoadSpecError(ValueError):
    """Unusable load arguments: one paragraph naming each bad input and what is accepted."""


@dataclass(frozen=True)
class LoadSpec:
    """What one load sends: the arguments of run_load and of one vllm_load call, with their defaults.

    request_rate None (or inf) sends everything at once, limited by concurrency; a number gives Poisson arrivals at
    that rate; concurrency 0 means no cap. The whole load stops at timeout_s, one request at request_timeout_s.
    Checked when built: an unusable value raises LoadSpecError.
    """

    num_prompts: int = 100
    concurrency: int = 16
    max_tokens: int = 64
    prompt_len: int = 32
    ignore_eos: bool = True
    request_rate: float | None = None
    timeout_s: float = 600.0
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if problems := _spec_problems(asdict(self)):
            raise LoadSpecError(_unusable("LoadSpec()", problems))
        # One form for what is recorded: an infinite rate is "all at once", numbers are floats.
        rate = self.request_rate
        object.__setattr__(self, "request_rate", None if rate is None or rate == float("inf") else float(rate))
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "request_timeout_s", float(self.request_timeout_s))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(spec_field.name for spec_field in fields(cls))

    @classmethod
    def of(
        cls,
        caller: str,
        arguments: Mapping[str, Any],
        base: LoadSpec | None = None,
        problems: tuple[str, ...] = (),
        also_accepted: tuple[str, ...] = (),
    ) -> LoadSpec:
        """`base` (the defaults when None) with `arguments` replacing its fields; one LoadSpecError naming `caller`,
        every unusable or unknown argument (listing the accepted ones) and the caller's own `problems`."""
        names = cls.names()
        unknown = [name for name in arguments if name not in names]
        found = [*problems, *_spec_problems(arguments)]
        if unknown:
            given = ", ".join(f"{name}={arguments[name]!r}" for name in unknown)
            found.append(
                f"{given} {'is not an argument' if len(unknown) == 1 else 'are not arguments'} of {caller} "
                f"(accepted: {', '.join((*names, *also_accepted))})"
            )
        if found:
            raise LoadSpecError(_unusable(caller, found))
        return replace(base if base is not None else cls(), **arguments)


def _spec_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the load fields present in `values` (a name that is not a field is not looked at)."""
    problems = []
    for name, least in (("num_prompts", 1), ("max_tokens", 1), ("prompt_len", 1), ("concurrency", 0)):
        count = values.get(name, least)
        if not isinstance(count, int) or isinstance(count, bool) or count < least:
            hint = " (0: no cap, like vllm bench without --max-concurrency)" if name == "concurrency" else ""
            problems.append(f"{name}={count!r} must be an integer >= {least}{hint}")
    if not isinstance(values.get("ignore_eos", True), bool):
        problems.append(f"ignore_eos={values['ignore_eos']!r} must be True or False")
    rate = values.get("request_rate")
    if rate is not None and not (_is_number(rate) and rate > 0):
        problems.append(f"request_rate={rate!r} must be a positive number of requests/s, or None (all at once)")
    for name in ("timeout_s", "request_timeout_s"):
        value = values.get(name, 1.0)
        if not (_is_number(value) and value > 0):
            problems.append(f"{name}={value!r} must be a positive number of seconds")
    return problems


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _unusable(caller: str, problems: list[str]) -> str:
    return f"{caller} got unusable arguments: " + "; ".join(problems) + "."


@dataclass(frozen=True)
class Percentiles:
    """Summary of one latency metric in milliseconds (mean, median, p90, p99), zeros when there is no value."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values_s: list[float]) -> Percentiles:
        """Summarize latencies given in seconds, as vllm bench does (`np.percentile(values or 0, p) * 1000`)."""
        return cls.of_us(to_us(values_s))

    @classmethod
    def of_us(cls, samples_us: list[int]) -> Percentiles:
        """Summarize whole-microsecond samples: the form the results file keeps, so a summary recomputed from it
        (baseline/summary.py, the shard merge) is the same figure."""
        return cls(**latency_summary(samples_us))

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}


@dataclass
class RequestError:
    """One failed request: `kind` is one of ERROR_KINDS, `status` the HTTP status when there was one."""

    index: int
    kind: RequestErrorKind
    status: int | None
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadResult:
    """What one load run measured. The caller fills peak_memory_bytes, server_alive and failure afterwards."""

    num_prompts: int
    concurrency: int
    request_rate: float | None
    completed: int
    failed: int
    errors: list[RequestError]
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_output_tokens: int
    total_input_tokens: int
    ttft: Percentiles
    tpot: Percentiles
    itl: Percentiles
    e2el: Percentiles
    peak_memory_bytes: int | None = None
    peak_memory_per_gpu: list[int] = field(default_factory=list)  # GPUs only: each GPU's own peak, in server order
    server_alive: bool = True
    failure: Diagnosis | None = None  # why the server died or what memory error it logged during the load
    advice: list[str] = field(default_factory=list)  # next steps for that failure
    # CPU backend only: the CPU seconds the server's processes spent during the load (None: not measured).
    server_cpu_s: float | None = None
    # The share of the host's CPU that other processes used during the load (memory/host_cpu.py; None: unknown):
    # above metrics.BUSY_SHARE the load ran on a busy runner and the gate leaves it out where quiet loads exist.
    others_cpu_share: float | None = None
    # The raw per-request latencies behind ttft..e2el, whole microseconds (baseline/summary.py LATENCIES), so that
    # percentiles over several loads or CI shards are recomputed from requests, never averaged.
    samples_us: dict[str, list[int]] = field(default_factory=dict)

    @property
    def cpu_ms_per_token(self) -> float | None:
        """Server CPU milliseconds per generated token: the work the server did per token. On the CPU backend the CPU
        is the device, and a neighbour that takes cores stretches the load's wall clock but not this figure."""
        if self.server_cpu_s is None or self.total_output_tokens <= 0 or self.server_cpu_s <= 0:
            return None
        return self.server_cpu_s * 1000 / self.total_output_tokens

    @property
    def ok(self) -> bool:
        """Every request completed, none failed, the server outlived the load and logged no memory error."""
        return self.completed == self.num_prompts and self.failed == 0 and self.server_alive and self.failure is None

    def ended_event(self, test_id: str, number: int) -> LoadEnded:
        """The progress event of this load's end: the figures the results JSON keeps."""
        return LoadEnded(
            test_id,
            number,
            self.completed,
            self.failed,
            self.num_prompts,
            self.duration_s,
            self.output_throughput,
            self.peak_memory_bytes or 0,
            self.ok,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "num_prompts": self.num_prompts,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "completed": self.completed,
            "failed": self.failed,
            "errors": [error.to_dict() for error in self.errors],
            "duration_s": self.duration_s,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_output_tokens": self.total_output_tokens,
            "total_input_tokens": self.total_input_tokens,
            "ttft_ms": self.ttft.to_dict(),
            "tpot_ms": self.tpot.to_dict(),
            "itl_ms": self.itl.to_dict(),
            "e2el_ms": self.e2el.to_dict(),
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_per_gpu": list(self.peak_memory_per_gpu),
            "server_alive": self.server_alive,
            "failure": self.failure.to_dict() if self.failure is not None else None,
            "advice": list(self.advice),
            "server_cpu_s": self.server_cpu_s,
            "cpu_ms_per_token": self.cpu_ms_per_token,
            "others_cpu_share": self.others_cpu_share,
            SAMPLES_KEY: {name: list(values) for name, values in self.samples_us.items()},
        }


def make_prompts(num_prompts: int, prompt_len: int, seed: int = 0) -> list[str]:
    """`num_prompts` distinct prompts of about `prompt_len` tokens, the same for the same seed.

    Each starts with its own index so no two share a first token (prefix caching cannot turn the load into cache
    hits within one run). Runs with the same seed send the same prompts, as vllm bench's random dataset does.
    """
    rng = random.Random(seed)
    words = _WORDS
    return [f"{index} " + " ".join(rng.choices(words, k=max(prompt_len - 1, 1))) for index in range(num_prompts)]


def arrival_offsets(num_prompts: int, request_rate: float | None, seed: int = 0) -> list[float] | None:
    """Send times in seconds after the start for a Poisson process of `request_rate` req/s; None = all at once.

    As vllm bench (burstiness 1): exponential gaps, then rescaled so the last request is sent at
    num_prompts / request_rate, which keeps the mean rate exact for every seed.
    """
    if request_rate is None or request_rate == float("inf"):
        return None
    rng = random.Random(seed)
    offsets: list[float] = []
    total = 0.0
    for _ in range(num_prompts):
        total += rng.expovariate(request_rate)
        offsets.append(total)
    if total > 0:
        scale = (num_prompts / request_rate) / total
        offsets = [offset * scale for offset in offsets]
    return offsets


def completions_url(base_url: str) -> str:
    """`http://host:port`, `.../` or `.../v1` -> `.../v1/completions`."""
    url = base_url.rstrip("/")
    if url.endswith("/v1/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/completions"
    return url + "/v1/completions"


class _Request:
    """Timings of one streamed request (seconds, perf_counter clock)."""

    __slots__ = ("input_tokens", "itl", "latency", "output_tokens", "ttft")

    def __init__(self) -> None:
        self.ttft = 0.0
        self.latency = 0.0
        self.itl: list[float] = []
        self.output_tokens: int | None = None
        self.input_tokens: int | None = None


class _StreamError(Exception):
    """The response was not a usable token stream (carries the kind and status of the RequestError)."""

    def __init__(self, kind: RequestErrorKind, status: int | None, text: str) -> None:
        super().__init__(text)
        self.kind = kind
        self.status = status
        self.text = text


def _parse_events(block: bytes) -> list[Any]:
    """JSON payloads of the `data:` lines in complete SSE events; `[DONE]` and comments are skipped."""
    payloads = []
    for line in block.split(b"\n"):
        if line[:5] != b"data:":
            continue  # blank separators, `: ping` comments, `event:`/`id:` fields
        data = line[5:].strip()
        if data and data != b"[DONE]":
            payloads.append(json.loads(data))
    return payloads


def _is_token_event(record: _Request, data: Any) -> bool:
    """True for a token chunk; records usage; raises _StreamError for an error event."""
    if data.get("choices"):
        return True  # any choice counts, even with empty text (special tokens), as in vllm bench
    if usage := data.get("usage"):
        record.output_tokens = usage.get("completion_tokens")
        record.input_tokens = usage.get("prompt_tokens")
    elif "error" in data or data.get("object") == "error":
        error = data.get("error", data)
        message = error.get("message", error) if isinstance(error, dict) else error
        raise _StreamError("stream", 200, f"error event in the stream: {message}")
    return False


async def _stream_one(session: aiohttp.ClientSession, url: str, body: bytes) -> _Request:
    record = _Request()
    start = time.perf_counter()
    last = start
    first = True
    itl = record.itl
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            detail = (await response.read())[:_MAX_ERROR_TEXT].decode("utf-8", "replace")
            kind: RequestErrorKind = (
                "http_5xx" if response.status >= 500 else "http_4xx" if response.status >= 400 else "stream"
            )
            raise _StreamError(kind, response.status, f"HTTP {response.status} {response.reason}: {detail}")
        tail = b""
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            if tail:
                chunk = tail + chunk
            if b"\r" in chunk:
                chunk = chunk.replace(b"\r\n", b"\n")
            cut = chunk.rfind(b"\n\n")
            if cut < 0:
                tail = chunk
                continue
            tail = chunk[cut + 2 :]
            for data in _parse_events(chunk[:cut]):
                if _is_token_event(record, data):
                    if first:
                        record.ttft = now - start
                        first = False
                    else:
                        itl.append(now - last)
                    last = now
        for data in _parse_events(tail):  # a final event without its blank line (only usage can matter here)
            _is_token_event(record, data)
    if first:
        raise _StreamError("stream", 200, "the stream ended without any token chunk (no `choices` in any event)")
    record.latency = last - start
    if record.output_tokens is None:
        # No usage chunk (not a vLLM server?): vLLM streams one token per chunk, so count the chunks.
        record.output_tokens = len(itl) + 1
    return record


def _describe(exc: BaseException) -> tuple[RequestErrorKind, int | None, str]:
    if isinstance(exc, _StreamError):
        return exc.kind, exc.status, exc.text
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout", None, f"no complete response within request_timeout_s ({type(exc).__name__}: {exc})"
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return "connection", None, f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (ValueError, UnicodeDecodeError)):
        return "stream", None, f"unreadable stream event ({type(exc).__name__}: {exc})"
    return "stream", None, f"{type(exc).__name__}: {exc}"


class _Load:
    """One run: a fixed pool of workers (at most `concurrency` requests in flight) over a shared queue of indices."""

    def __init__(
        self,
        url: str,
        bodies: list[bytes],
        spec: LoadSpec,
        offsets: list[float] | None,
        should_abort: Callable[[], bool] | None,
    ) -> None:
        self.url = url
        self.bodies = bodies
        self.concurrency = spec.concurrency
        self.offsets = offsets
        self.timeout_s = spec.timeout_s
        self.request_timeout_s = spec.request_timeout_s
        self.should_abort = should_abort
        self.records: list[_Request | None] = [None] * len(bodies)
        self.sent = [False] * len(bodies)
        self.errors: list[RequestError] = []
        self.failed = 0
        self.failed_indices: set[int] = set()
        self.start = 0.0
        self.stop_reason: tuple[RequestErrorKind, str] | None = None
        self.internal_error = ""

    def _fail(self, index: int, kind: RequestErrorKind, status: int | None, text: str) -> None:
        self.failed += 1
        self.failed_indices.add(index)
        if len(self.errors) < _MAX_ERRORS_KEPT:
            self.errors.append(RequestError(index, kind, status, text[:_MAX_ERROR_TEXT]))

    async def _worker(
        self, session: aiohttp.ClientSession, indices: Iterator[int] | None, queue: asyncio.Queue[int | None] | None
    ) -> None:
        while True:
            # Without a request rate all workers pull from one iterator: no per-request queue traffic.
            index = next(indices, None) if queue is None else await queue.get()  # type: ignore[arg-type]
            if index is None:
                return
            self.sent[index] = True
            try:
                self.records[index] = await _stream_one(session, self.url, self.bodies[index])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every request failure is data, never an exception out of run_load
                self._fail(index, *_describe(exc))

    async def _dispatch(self, queue: asyncio.Queue[int | None], workers: int) -> None:
        assert self.offsets is not None
        for index, offset in enumerate(self.offsets):
            delay = self.start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            queue.put_nowait(index)
        for _ in range(workers):
            queue.put_nowait(None)

    def _abort_requested(self) -> str | None:
        if self.should_abort is None:
            return None
        try:
            return "should_abort() returned true" if self.should_abort() else None
        except Exception as exc:  # a broken callback ends the load rather than the test session
            return f"should_abort() raised {type(exc).__name__}: {exc}"

    async def run(self) -> float:
        """Run to completion, deadline or abort; returns the duration in seconds."""
        count = len(self.bodies)
        workers = min(self.concurrency, count) if self.concurrency > 0 else count
        connector = aiohttp.TCPConnector(
            limit=self.concurrency or 0, limit_per_host=self.concurrency or 0, keepalive_timeout=60, force_close=False
        )
        session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)
        )
        tasks: list[asyncio.Task[None]] = []
        try:
            self.start = time.perf_counter()
            deadline = self.start + self.timeout_s
            if self.offsets is None:
                shared = iter(range(count))
                tasks = [asyncio.ensure_future(self._worker(session, shared, None)) for _ in range(workers)]
            else:
                queue: asyncio.Queue[int | None] = asyncio.Queue()
                tasks = [asyncio.ensure_future(self._worker(session, None, queue)) for _ in range(workers)]
                tasks.append(asyncio.ensure_future(self._dispatch(queue, workers)))
            pending = set(tasks)
            while pending:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self.stop_reason = ("timeout", f"the load's deadline (timeout_s={self.timeout_s:g}) passed")
                    break
                if self.should_abort is not None and (why := self._abort_requested()):
                    self.stop_reason = ("aborted", f"the load was aborted: {why}")
                    break
                poll = min(remaining, _ABORT_POLL_S) if self.should_abort is not None else remaining
                _, pending = await asyncio.wait(pending, timeout=poll)
            end = time.perf_counter()
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    self.internal_error = f"load client bug: {type(exc).__name__}: {exc}"
            if pending:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=_CANCEL_GRACE_S)
        finally:
            await session.close()
        # As vllm bench: from just before the first send to the return of the last request (or the stop).
        return max(end - self.start, 1e-9)

    def counts(self) -> tuple[int, int, int]:
        """(completed, failed, output tokens of the completed) so far: read by a progress thread at its own rate,
        so that nothing is done per request for progress."""
        done = [record for record in self.records if record is not None]
        return len(done), self.failed, sum(record.output_tokens or 0 for record in done)

    def account_unfinished(self) -> None:
        """Fail every request the deadline or abort (or a client bug) left without an outcome."""
        kind, why = self.stop_reason or ("stream", self.internal_error or "the load client lost this request")
        for index, record in enumerate(self.records):
            if record is None and index not in self.failed_indices:
                state = "in flight" if self.sent[index] else "not sent"
                self._fail(index, kind, None, f"{why}; this request was {state}")


def _summarize(load: _Load, spec: LoadSpec, duration: float) -> LoadResult:
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    output_tokens = 0
    input_tokens = 0
    completed = 0
    for record in load.records:
        if record is None:
            continue
        completed += 1
        out = record.output_tokens or 0
        output_tokens += out
        input_tokens += record.input_tokens if record.input_tokens is not None else spec.prompt_len
        ttfts.append(record.ttft)
        e2els.append(record.latency)
        itls.extend(record.itl)
        if out > 1:
            tpots.append((record.latency - record.ttft) / (out - 1))
    samples = {"ttft": to_us(ttfts), "tpot": to_us(tpots), "itl": to_us(itls), "e2el": to_us(e2els)}
    return LoadResult(
        num_prompts=spec.num_prompts,
        concurrency=spec.concurrency,
        request_rate=spec.request_rate,
        completed=completed,
        failed=load.failed,
        errors=load.errors,
        duration_s=duration,
        request_throughput=completed / duration,
        output_throughput=output_tokens / duration,
        total_output_tokens=output_tokens,
        total_input_tokens=input_tokens,
        ttft=Percentiles.of_us(samples["ttft"]),
        tpot=Percentiles.of_us(samples["tpot"]),
        itl=Percentiles.of_us(samples["itl"]),
        e2el=Percentiles.of_us(samples["e2el"]),
        samples_us=samples,
    )


# run_load's own keywords besides the LoadSpec fields: they vary per run, not per load.
_RUN_ONLY = ("seed", "should_abort")


def _target_problems(base_url: str, model: str) -> tuple[str, ...]:
    problems = []
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        problems.append(f"base_url={base_url!r} must be the server's http(s) address, e.g. 'http://127.0.0.1:8000'")
    if not isinstance(model, str) or not model:
        problems.append(f"model={model!r} must be the served model name (as listed by GET /v1/models)")
    return tuple(problems)


def _run_coroutine(make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    # Called from inside a running loop (an async test, a notebook): asyncio.run cannot nest, so use a thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-load") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def run_load(
    base_url: str,
    model: str,
    spec: LoadSpec | None = None,
    *,
    seed: int = 0,
    should_abort: Callable[[], bool] | None = None,
    **arguments: Any,
) -> LoadResult:
    """Send `spec.num_prompts` streaming completions to `base_url` with at most `spec.concurrency` in flight and
    measure them. Keyword arguments named as LoadSpec's fields replace those of `spec` (the defaults when None).

    Request failures (HTTP errors, dropped connections, per-request timeouts, error events) are counted in `failed`
    and never raised. The whole load stops at `timeout_s` (unfinished requests fail as "timeout"); `should_abort` is
    polled every 0.2 s and ends the load early (unfinished requests fail as "aborted"). `seed` picks the prompts and
    arrival times. Raises LoadSpecError (a ValueError) only for unusable arguments.
    """
    spec = LoadSpec.of(
        "run_load()", arguments, base=spec, problems=_target_problems(base_url, model), also_accepted=_RUN_ONLY
    )
    bodies = []
    for prompt in make_prompts(spec.num_prompts, spec.prompt_len, seed):
        # The payload of vllm bench's async_request_openai_completions (no temperature: the server's default).
        payload: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "repetition_penalty": 1.0,
            "max_tokens": spec.max_tokens,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if spec.ignore_eos:
            payload["ignore_eos"] = True
        bodies.append(json.dumps(payload).encode())
    offsets = arrival_offsets(spec.num_prompts, spec.request_rate, seed)
    load = _Load(completions_url(base_url), bodies, spec, offsets, should_abort)
    watch = watch_load(load.counts, spec.num_prompts)  # a progress thread when the pytest adapter observes this load
    try:
        duration = _run_coroutine(load.run)
    finally:
        watch.close()
    load.account_unfinished()
    return _summarize(load, spec, duration)


def planned_load_result(spec: LoadSpec) -> LoadResult:
    """What vllm_load returns under --vllm-preflight: every request of `spec` 'completed', no figures measured."""
    zero = Percentiles(0.0, 0.0, 0.0, 0.0)
    return LoadResult(
        num_prompts=spec.num_prompts,
        concurrency=spec.concurrency,
        request_rate=spec.request_rate,
        completed=spec.num_prompts,
        failed=0,
        errors=[],
        duration_s=0.0,
        request_throughput=0.0,
        output_throughput=0.0,
        total_output_tokens=0,
        total_input_tokens=0,
        ttft=zero,
        tpot=zero,
        itl=zero,
        e2el=zero,
    )
