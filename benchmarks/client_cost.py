"""Client cost of pytest_vllm_mem.load.client.run_load: requests/s and client CPU seconds per request.

A trivial OpenAI-style streaming endpoint runs in a SEPARATE process (its CPU is not counted); this process drives
it with run_load and reads its own CPU time with getrusage(RUSAGE_SELF) around the run. With --compare, the same
load is also driven with vllm bench serve's own request function (vllm.benchmarks.lib.endpoint_request_func), in the
way `vllm bench serve` drives it (semaphore + one task per request), for a like-for-like figure.

    python benchmarks/client_cost.py [--num-prompts 5000] [--concurrency 64] [--max-tokens 4] [--compare]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ---- the trivial endpoint (child process) -------------------------------------------------------------------------


def serve(itl_ms: float, ttft_ms: float = 0.0) -> None:
    """After ttft_ms, stream max_tokens one-token chunks itl_ms apart, a usage chunk and [DONE]; print the port."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = body["max_tokens"]
        prompt_tokens = len(body["prompt"].split())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if ttft_ms:
            await asyncio.sleep(ttft_ms / 1000)  # a known TTFT: both clients must measure it alike
        for n in range(tokens):
            if n and itl_ms:
                await asyncio.sleep(itl_ms / 1000)  # separate network reads per token, as from a real server
            chunk = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "text": " hi", "logprobs": None, "finish_reason": None}],
            }
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        final = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [],
            "usage": usage,
        }
        await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop  # the server should not be the bottleneck; the client under test uses plain asyncio

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# ---- measuring (parent process) -----------------------------------------------------------------------------------


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_run_load(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    from pytest_vllm_mem.load.client import run_load

    cpu = cpu_seconds()
    wall = time.perf_counter()
    result = run_load(
        base_url,
        "fake",
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_len=32,
        timeout_s=600,
    )
    wall = time.perf_counter() - wall
    cpu = cpu_seconds() - cpu
    assert result.ok, result.errors
    assert result.total_output_tokens == args.num_prompts * args.max_tokens
    return {
        "client": "pytest_vllm_mem.load.client.run_load",
        "requests": result.completed,
        "wall_s": wall,
        "req_per_s": result.request_throughput,
        "client_cpu_s": cpu,
        "client_cpu_ms_per_req": 1000 * cpu / result.completed,
        "ttft_p50_ms": result.ttft.p50,
        "tpot_p50_ms": result.tpot.p50,
        "itl_p50_ms": result.itl.p50,
        "itl_mean_ms": result.itl.mean,
    }


def measure_vllm_bench(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """vllm bench serve's request function, driven as benchmark() in vllm/benchmarks/serve.py drives it."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    from pytest_vllm_mem.load.client import make_prompts

    prompts = make_prompts(args.num_prompts, 32)

    async def run() -> list[Any]:
        connector = aiohttp.TCPConnector(
            limit=args.concurrency,
            limit_per_host=args.concurrency,
            ttl_dns_cache=300,
            use_dns_cache=True,
            keepalive_timeout=60,
            enable_cleanup_closed=True,
            force_close=False,
            ssl=False,
        )
        session = aiohttp.ClientSession(
            connector=connector, trust_env=True, timeout=aiohttp.ClientTimeout(total=6 * 60 * 60)
        )
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(request_input: RequestFuncInput) -> Any:
            async with semaphore:
                return await async_request_openai_completions(request_input, session)

        tasks = [
            asyncio.create_task(
                limited(
                    RequestFuncInput(
                        prompt=prompt,
                        api_url=base_url + "/v1/completions",
                        prompt_len=32,
                        output_len=args.max_tokens,
                        model="fake",
                        ignore_eos=True,
                    )
                )
            )
            for prompt in prompts
        ]
        outputs = await asyncio.gather(*tasks)
        await session.close()
        return outputs

    cpu = cpu_seconds()
    wall = time.perf_counter()
    outputs = asyncio.run(run())
    wall = time.perf_counter() - wall
    cpu = cpu_seconds() - cpu
    completed = sum(output.success for output in outputs)
    assert completed == args.num_prompts, next(o.error for o in outputs if not o.success)
    import numpy as np

    ok = [output for output in outputs if output.success]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if (o.output_tokens or 0) > 1]
    return {
        "client": "vllm bench serve request func",
        "requests": completed,
        "wall_s": wall,
        "req_per_s": completed / wall,
        "client_cpu_s": cpu,
        "client_cpu_ms_per_req": 1000 * cpu / completed,
        "ttft_p50_ms": 1000 * float(np.median([o.ttft for o in ok])),
        "tpot_p50_ms": 1000 * float(np.median(tpots)) if tpots else 0.0,
        "itl_p50_ms": 1000 * float(np.median([gap for o in ok for gap in o.itl] or [0.0])),
    }


def measure(
    num_prompts: int = 5000,
    concurrency: int = 64,
    max_tokens: int = 4,
    itl_ms: float = 1.0,
    compare: bool = True,
    profile: str | None = None,
    ttft_ms: float = 0.0,
) -> list[dict[str, Any]]:
    """Start the fake endpoint, measure run_load (and with `compare` vllm bench's request function); one row each."""
    args = argparse.Namespace(num_prompts=num_prompts, concurrency=concurrency, max_tokens=max_tokens, itl_ms=itl_ms)
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--itl-ms", str(itl_ms), "--ttft-ms", str(ttft_ms)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert server.stdout is not None
    try:
        base_url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        if compare:
            import vllm.benchmarks.lib.endpoint_request_func  # noqa: F401  (slow import, outside the measurement)
        from pytest_vllm_mem.load.client import run_load

        run_load(base_url, "fake", num_prompts=200, concurrency=concurrency, max_tokens=max_tokens)  # warm
        rows = []
        for measure_one in [measure_run_load] + ([measure_vllm_bench] if compare else []):
            server_cpu = child_cpu_seconds(server.pid)
            if profile and measure_one is measure_run_load:
                import cProfile

                profiler = cProfile.Profile()
                row = profiler.runcall(measure_one, base_url, args)
                profiler.dump_stats(profile)
            else:
                row = measure_one(base_url, args)
            row["server_cpu_ms_per_req"] = 1000 * (child_cpu_seconds(server.pid) - server_cpu) / row["requests"]
            rows.append(row)
        return rows
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--itl-ms",
        type=float,
        default=1.0,
        help="gap between the fake's token chunks (0 = back to back, often one network read)",
    )
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the fake's first token chunk")
    parser.add_argument("--compare", action="store_true", help="also measure vllm bench serve's request function")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of the run_load measurement to FILE")
    args = parser.parse_args()
    if args.serve:
        serve(args.itl_ms, args.ttft_ms)
        return
    rows = measure(
        args.num_prompts, args.concurrency, args.max_tokens, args.itl_ms, args.compare, args.profile, args.ttft_ms
    )
    print(
        f"{args.num_prompts} streaming requests, max_tokens {args.max_tokens}, concurrency {args.concurrency}, "
        f"chunks {args.itl_ms:g} ms apart, {os.cpu_count()} CPUs, server in a separate process"
    )
    for row in rows:
        print(
            f"  {row['client']:<32} {row['req_per_s']:8.0f} req/s   client CPU {row['client_cpu_ms_per_req']:.3f}"
            f" ms/req ({row['client_cpu_s']:.2f} s)   server CPU {row['server_cpu_ms_per_req']:.3f} ms/req"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
