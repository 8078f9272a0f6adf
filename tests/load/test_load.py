"""Unit tests of the load client's statistics and error handling against a fake streaming endpoint.

The fake only checks the client's bookkeeping; the e2e tests elsewhere drive a real vLLM server.
Fake URL layout: http://127.0.0.1:PORT/<mode>/<ttft_ms>/<itl_ms>/v1/completions, one token chunk per `max_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
from aiohttp import web

from pytest_vllm_mem.load.client import (
    LoadResult,
    LoadSpec,
    LoadSpecError,
    Percentiles,
    arrival_offsets,
    completions_url,
    make_prompts,
    run_load,
)

T = TypeVar("T")


class FakeServer:
    """An OpenAI-style streaming /v1/completions endpoint on its own event loop in a background thread."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.release = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._call(self._start())

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> int:
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/{mode}/{ttft_ms}/{itl_ms}/v1/completions", self._completions)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port: int = self.runner.addresses[0][1]
        return port

    def url(self, mode: str = "ok", ttft_ms: int = 50, itl_ms: int = 20) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}/{ttft_ms}/{itl_ms}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)  # hanging handlers return
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request, body)
        except ConnectionResetError:  # the client gave up (deadline, abort): expected here
            return web.Response(status=499)
        finally:
            self.in_flight -= 1

    async def _respond(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        mode = request.match_info["mode"]
        ttft = int(request.match_info["ttft_ms"]) / 1000
        itl = int(request.match_info["itl_ms"]) / 1000
        index = int(body["prompt"].split()[0])
        if mode == "error500" or (mode == "mixed" and index % 3 == 0):
            return web.Response(status=500, text="engine is dead: EngineCore exited")
        if mode == "error400":
            return web.json_response({"error": {"message": "max_tokens is too large"}}, status=400)
        if mode == "hang":
            await self.release.wait()
            return web.Response(status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(ttft)
        tokens = body["max_tokens"]
        per_chunk = 2 if mode == "bundled" else 1  # two tokens per chunk: usage is the only right count
        chunks = (tokens + per_chunk - 1) // per_chunk
        for n in range(chunks):
            if n:
                await asyncio.sleep(itl)
            if mode == "drop" and n == 1:
                assert request.transport is not None
                request.transport.close()  # the server process died mid-stream
                return response
            if mode == "midhang" and n == 1:
                await self.release.wait()
            if mode == "errorevent" and n == 1:
                error = {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
                await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                break
            chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": " hi"}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {
            "prompt_tokens": len(body["prompt"].split()),
            "completion_tokens": tokens,
            "total_tokens": tokens + len(body["prompt"].split()),
        }
        await response.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def reset_counters(fake: FakeServer) -> None:
    fake.max_in_flight = 0
    fake.requests.clear()


def test_latencies_follow_the_fake_timings(fake: FakeServer) -> None:
    result = run_load(
        fake.url("ok", ttft_ms=50, itl_ms=20), "m", num_prompts=20, concurrency=5, max_tokens=5, prompt_len=8
    )
    assert result.ok and result.completed == 20 and result.failed == 0 and result.errors == []
    # The fake sleeps at least its timings, so the lower bounds hold on any machine; above them a busy machine only
    # adds delay, so the upper bounds are what the figures must be by construction, not by the machine's speed.
    assert result.ttft.p50 >= 45 and result.ttft.mean >= 45
    assert result.itl.p50 >= 15  # four gaps of 20 ms per request
    assert result.tpot.mean >= 15  # (e2el - ttft) / (5 - 1)
    assert result.e2el.p50 >= 120  # 50 + 4 * 20 ms
    assert result.tpot.mean == pytest.approx((result.e2el.mean - result.ttft.mean) / 4, rel=1e-3)  # rounded ms
    assert result.itl.p50 < result.e2el.p50 / 2  # a gap between tokens, not a whole request
    assert result.ttft.p50 <= result.ttft.p90 <= result.ttft.p99
    # Four rounds of five requests, ~130 ms each at least; every request ends within the load.
    assert result.duration_s >= 0.4 and result.e2el.p99 <= result.duration_s * 1000
    assert result.request_throughput == pytest.approx(20 / result.duration_s)
    assert result.total_output_tokens == 100
    assert result.output_throughput == pytest.approx(100 / result.duration_s)
    assert result.total_input_tokens == sum(len(body["prompt"].split()) for body in fake.requests)


def test_request_payload_is_what_vllm_bench_sends(fake: FakeServer) -> None:
    run_load(fake.url("ok", 0, 0), "my-model", num_prompts=3, concurrency=3, max_tokens=7, prompt_len=16)
    body = fake.requests[0]
    assert body["model"] == "my-model" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "temperature" not in body  # vllm bench leaves sampling to the server's default
    assert len({b["prompt"] for b in fake.requests}) == 3


def test_output_tokens_come_from_usage_not_chunks(fake: FakeServer) -> None:
    result = run_load(fake.url("bundled", 10, 10), "m", num_prompts=4, concurrency=4, max_tokens=8)
    assert result.ok
    assert result.total_output_tokens == 32
    # 4 chunks, 3 gaps of ~10 ms spread over 7 later tokens: TPOT ~ 3 * 10 / 7 ms, ITL ~ 10 ms.
    assert result.tpot.mean < result.itl.mean


def test_concurrency_caps_requests_in_flight(fake: FakeServer) -> None:
    result = run_load(fake.url("ok", 20, 5), "m", num_prompts=30, concurrency=4, max_tokens=3)
    assert result.ok
    assert fake.max_in_flight == 4


def test_http_5xx_is_counted_not_raised(fake: FakeServer) -> None:
    result = run_load(fake.url("error500"), "m", num_prompts=25, concurrency=5)
    assert not result.ok and result.completed == 0 and result.failed == 25
    assert len(result.errors) == 10
    error = result.errors[0]
    assert error.kind == "http_5xx" and error.status == 500 and "EngineCore exited" in error.text
    assert result.ttft == Percentiles(0.0, 0.0, 0.0, 0.0) and result.request_throughput == 0


def test_some_failures_leave_the_rest_measured(fake: FakeServer) -> None:
    result = run_load(fake.url("mixed", 5, 5), "m", num_prompts=30, concurrency=6, max_tokens=3)
    assert result.failed == 10 and result.completed == 20 and not result.ok
    assert sorted(e.index for e in result.errors) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]
    assert result.total_output_tokens == 60


def test_http_4xx_keeps_the_server_message(fake: FakeServer) -> None:
    result = run_load(fake.url("error400"), "m", num_prompts=2, concurrency=2)
    assert [e.kind for e in result.errors] == ["http_4xx", "http_4xx"]
    assert result.errors[0].status == 400 and "max_tokens is too large" in result.errors[0].text


def test_dropped_connection_is_a_connection_error(fake: FakeServer) -> None:
    result = run_load(fake.url("drop", 5, 5), "m", num_prompts=4, concurrency=2, max_tokens=4)
    assert result.failed == 4 and {e.kind for e in result.errors} == {"connection"}


def test_error_event_in_the_stream_fails_the_request(fake: FakeServer) -> None:
    result = run_load(fake.url("errorevent", 5, 5), "m", num_prompts=3, concurrency=3, max_tokens=4)
    assert result.failed == 3 and result.errors[0].kind == "stream"
    assert "Internal server error" in result.errors[0].text


def test_refused_connection_is_a_connection_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the load: nothing listens there
    result = run_load(f"http://127.0.0.1:{port}", "m", num_prompts=3, concurrency=2)
    assert result.failed == 3 and result.errors[0].kind == "connection"


def test_load_deadline_is_respected(fake: FakeServer) -> None:
    started = time.perf_counter()
    result = run_load(fake.url("hang"), "m", num_prompts=10, concurrency=4, timeout_s=2)
    elapsed = time.perf_counter() - started
    assert elapsed < 2 + 10  # the deadline, and a margin a busy 2-core machine cannot use up (the fake never answers)
    assert result.failed == 10 and result.completed == 0
    assert {e.kind for e in result.errors} == {"timeout"}
    texts = [e.text for e in result.errors]
    assert sum("in flight" in t for t in texts) == 4 and sum("not sent" in t for t in texts) == 6
    assert "timeout_s=2" in texts[0]
    assert 1.9 <= result.duration_s < 2 + 10


def test_request_timeout_fails_only_the_slow_request(fake: FakeServer) -> None:
    started = time.perf_counter()
    result = run_load(
        fake.url("midhang", 5, 5), "m", num_prompts=4, concurrency=4, max_tokens=4, request_timeout_s=0.5, timeout_s=60
    )
    assert time.perf_counter() - started < 20  # the request timeout ended it, not the load's 60 s
    assert result.failed == 4 and {e.kind for e in result.errors} == {"timeout"}
    assert "request_timeout_s" in result.errors[0].text


def test_should_abort_ends_the_load_early(fake: FakeServer) -> None:
    started = time.perf_counter()
    result = run_load(
        fake.url("hang"),
        "m",
        num_prompts=8,
        concurrency=2,
        timeout_s=60,
        should_abort=lambda: time.perf_counter() - started > 0.5,
    )
    assert time.perf_counter() - started < 20  # should_abort ended it, not the load's 60 s
    assert result.failed == 8 and {e.kind for e in result.errors} == {"aborted"}
    assert "should_abort() returned true" in result.errors[0].text


def test_broken_should_abort_aborts_instead_of_raising(fake: FakeServer) -> None:
    def broken() -> bool:
        raise RuntimeError("psutil went away")

    result = run_load(fake.url("hang"), "m", num_prompts=2, concurrency=2, timeout_s=30, should_abort=broken)
    assert result.failed == 2 and "psutil went away" in result.errors[0].text


def test_poisson_arrivals_pace_the_load(fake: FakeServer) -> None:
    offsets = arrival_offsets(50, 10.0, seed=3)
    assert offsets is not None
    assert offsets == arrival_offsets(50, 10.0, seed=3) and offsets != arrival_offsets(50, 10.0, seed=4)
    assert offsets[-1] == pytest.approx(5.0) and offsets == sorted(offsets)
    assert arrival_offsets(5, None) is None and arrival_offsets(5, float("inf")) is None
    result = run_load(fake.url("ok", 0, 0), "m", num_prompts=10, concurrency=10, max_tokens=2, request_rate=20)
    assert result.ok and result.request_rate == 20
    assert result.duration_s >= 0.45  # the last request is sent at 10 / 20 s: the arrivals paced the load


def test_runs_inside_a_running_event_loop(fake: FakeServer) -> None:
    async def from_async_test() -> LoadResult:
        return run_load(fake.url("ok", 0, 0), "m", num_prompts=3, concurrency=3, max_tokens=2)

    assert asyncio.run(from_async_test()).ok


def test_percentiles_match_numpy() -> None:
    values = [0.001 * v for v in (5, 1, 9, 3, 7, 2, 8)]
    summary = Percentiles.of(values)
    ms = np.array(values) * 1000
    assert summary.mean == pytest.approx(ms.mean()) and summary.p50 == pytest.approx(np.median(ms))
    assert summary.p90 == pytest.approx(np.percentile(ms, 90)) and summary.p99 == pytest.approx(np.percentile(ms, 99))
    assert Percentiles.of([]) == Percentiles(0.0, 0.0, 0.0, 0.0)
    assert summary.to_dict() == {"mean": summary.mean, "p50": summary.p50, "p90": summary.p90, "p99": summary.p99}


def test_prompts_are_distinct_reproducible_and_sized() -> None:
    prompts = make_prompts(200, 32, seed=1)
    assert prompts == make_prompts(200, 32, seed=1) and prompts != make_prompts(200, 32, seed=2)
    assert len(set(prompts)) == 200 and len({p.split()[0] for p in prompts}) == 200
    assert all(len(p.split()) == 32 for p in prompts)


def test_completions_url_accepts_common_base_urls() -> None:
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", "http://h:1/v1/completions"):
        assert completions_url(base) == "http://h:1/v1/completions"


def test_result_to_dict_is_json_and_ok_follows_server_alive(fake: FakeServer) -> None:
    result = run_load(fake.url("ok", 0, 0), "m", num_prompts=2, concurrency=2, max_tokens=2)
    assert result.ok
    result.server_alive = False
    result.peak_memory_bytes = 123
    data = json.loads(json.dumps(result.to_dict()))
    assert data["ok"] is False and data["peak_memory_bytes"] == 123 and data["ttft_ms"]["p50"] >= 0
    assert set(data["e2el_ms"]) == {"mean", "p50", "p90", "p99"}
    assert data["failure"] is None


def test_a_load_failure_is_a_diagnosis_in_the_json(fake: FakeServer) -> None:
    from pytest_vllm_mem.diagnosis.diagnose import Diagnosis

    result = run_load(fake.url("ok", 0, 0), "m", num_prompts=2, concurrency=2, max_tokens=2)
    result.failure = Diagnosis(
        "cuda_oom", "out of memory during the load", ("torch.OutOfMemoryError",), {"tried_gib": 1.5}, "serving"
    )
    data = json.loads(json.dumps(result.to_dict()))
    assert not result.ok and data["ok"] is False
    assert data["failure"] == {
        "kind": "cuda_oom",
        "summary": "out of memory during the load",
        "root_cause": ["torch.OutOfMemoryError"],
        "figures": {"tried_gib": 1.5},
        "phase": "serving",
    }


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"num_prompts": 0}, "num_prompts=0"),
        ({"concurrency": -1}, "concurrency=-1"),
        ({"request_rate": 0}, "request_rate=0"),
        ({"timeout_s": 0}, "timeout_s=0"),
    ],
)
def test_bad_arguments_raise_one_clear_error(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        run_load("http://127.0.0.1:1", "m", **kwargs)
    with pytest.raises(ValueError, match="base_url"):
        run_load("127.0.0.1:8000", "m")


def test_a_spec_with_keyword_overrides_drives_the_load(fake: FakeServer) -> None:
    spec = LoadSpec(num_prompts=3, concurrency=3, max_tokens=7, prompt_len=16, ignore_eos=False)
    result = run_load(fake.url("ok", 0, 0), "m", spec, max_tokens=2)
    assert result.ok and result.num_prompts == 3 and result.total_output_tokens == 3 * 2
    assert len(fake.requests) == 3 and {body["max_tokens"] for body in fake.requests} == {2}
    assert all("ignore_eos" not in body for body in fake.requests)  # the spec's own field, not a default
    assert spec.max_tokens == 7  # the override made a new spec; the caller's is frozen


def test_every_unusable_argument_is_named_in_one_paragraph() -> None:
    with pytest.raises(LoadSpecError) as error:
        run_load("127.0.0.1:8000", "m", num_prompts=0, ignore_eos="yes", nmu_prompts=5)
    message = str(error.value)
    assert "\n" not in message and message.startswith("run_load() got unusable arguments: ")
    assert "base_url='127.0.0.1:8000'" in message and "num_prompts=0 must be an integer >= 1" in message
    assert "ignore_eos='yes' must be True or False" in message
    # The misspelt name, and every name it could have been.
    assert "nmu_prompts=5 is not an argument of run_load() (accepted: num_prompts, concurrency, max_tokens," in message
    assert all(name in message for name in (*LoadSpec.names(), "seed", "should_abort"))
    assert isinstance(error.value, ValueError)


def test_a_spec_is_checked_and_normalized_when_built() -> None:
    with pytest.raises(LoadSpecError, match=r"LoadSpec\(\) got unusable arguments: concurrency=True"):
        LoadSpec(concurrency=True)  # a bool is not a count
    with pytest.raises(LoadSpecError, match="request_timeout_s=0 must be a positive number of seconds"):
        LoadSpec(request_timeout_s=0)
    spec = LoadSpec(request_rate=float("inf"), timeout_s=5)
    assert spec.request_rate is None and spec.timeout_s == 5.0 and isinstance(spec.timeout_s, float)
    assert LoadSpec(request_rate=3).request_rate == 3.0
    assert LoadSpec.of("x()", {"num_prompts": 4}, base=LoadSpec(max_tokens=2)) == LoadSpec(num_prompts=4, max_tokens=2)


def test_a_warm_up_is_one_unmeasured_wave_of_the_load_with_prompts_no_measured_load_sends(fake: FakeServer) -> None:
    from types import SimpleNamespace

    from pytest_vllm_mem.load.client import LoadSpec, make_prompts
    from pytest_vllm_mem.load.measure import warm_up, warm_up_spec

    spec = LoadSpec(num_prompts=30, concurrency=4, max_tokens=3, prompt_len=16, request_rate=5.0)
    assert warm_up_spec(spec) == LoadSpec(num_prompts=4, concurrency=4, max_tokens=3, prompt_len=16)
    assert warm_up_spec(LoadSpec(num_prompts=6, concurrency=0)).num_prompts == 6  # no cap: the wave is every prompt
    assert warm_up_spec(LoadSpec(num_prompts=2, concurrency=16)).num_prompts == 2
    server = SimpleNamespace(url=fake.url("ok", 0, 0), model_name="m", alive=lambda: True)
    server.call = lambda function, *args: function(server, *args)  # a local server runs the call here (Server.call)
    warm_up(server, spec)
    assert len(fake.requests) == 4
    assert all(r["max_tokens"] == 3 for r in fake.requests)
    measured = {p for seed in (1, 2, 3) for p in make_prompts(30, 16, seed=seed)}  # the seeds of loads 1, 2, 3
    assert not {r["prompt"] for r in fake.requests} & measured
