"""One measured load against a running server: memory marks around it, and a diagnosis when the server dies or runs
out of memory during it. Used by the vllm_load fixture and by the tuner."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from pytest_vllm_mem.baseline.metrics import BUSY_SHARE
from pytest_vllm_mem.diagnosis.advice import advise, render_steps
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, classify_failure, find_memory_error
from pytest_vllm_mem.launch.launcher import RunningServer
from pytest_vllm_mem.launch.ray_cluster import NodeLostError  # Ray itself is imported only by a cluster's launcher
from pytest_vllm_mem.launch.server import Server, VLLMServer
from pytest_vllm_mem.load.client import LoadResult, LoadSpec, planned_load_result, run_load
from pytest_vllm_mem.memory import cpu_seconds_between, others_share, read_host_cpu


def measure_load(server: RunningServer, spec: LoadSpec) -> LoadResult:
    """`measured_load` next to `server`, wherever it runs: in this process for a local server, on the server's node
    for one on a cluster (its per-request samples brought back), so latencies are vLLM's, not a network's. A node
    lost during the load is the load's failure (kind node_lost), naming the node and the rank."""
    try:
        return server.call(measured_load, spec)
    except NodeLostError as error:
        result = planned_load_result(spec)  # nothing came back: no request counts as completed
        result.completed, result.server_alive = 0, False
        result.failure = Diagnosis(kind="node_lost", summary=str(error), root_cause=(), figures={})
        return result


# A fresh server's first requests of a load's shape can pay one-time costs that later loads of that shape do not (a
# batch shape the CPU backend's compiled graph had not seen, allocators and thread pools growing); benchmark tools
# warm up for this reason (`vllm bench serve --num-warmups`). One wave of the load's shape runs unmeasured first.
# It does not remove the stalled sessions of a 2-core CPU runner (docs/baselines-and-gate.md), which come at any
# point of a server's life. The warm-up's prompts come from a seed no measured load uses (those use 1, 2, ...), so
# none is a prefix-cache hit.
WARM_UP_SEED = 0


def warm_up_spec(spec: LoadSpec) -> LoadSpec:
    """One wave of `spec`: its concurrency (all of it with no cap) of its prompts, all at once, same token counts."""
    wave = spec.concurrency or spec.num_prompts
    return replace(spec, num_prompts=min(spec.num_prompts, wave), request_rate=None)


def warm_up(server: RunningServer, spec: LoadSpec) -> None:
    """One unmeasured wave of `spec`'s requests (warm_up_spec) next to `server`, before its first measured load of
    that shape. Nothing is recorded: a failure shows in the measured load that follows."""
    server.call(_unmeasured_load, warm_up_spec(spec))


def _unmeasured_load(server: VLLMServer, spec: LoadSpec) -> None:
    run_load(server.url, server.model_name, spec, seed=WARM_UP_SEED, should_abort=lambda: not server.alive())


def measured_load(server: VLLMServer, spec: LoadSpec) -> LoadResult:
    """The load `spec` against `server` with the memory sampler marking it; diagnoses a death or OOM during it."""
    sampler = server.sampler
    log_offset = len(server.log_text())
    sampler.sample_now()
    server.loads_run += 1
    started = sampler.mark(f"load {server.loads_run}")
    # The CPU backend's device is the CPU: its work per token is read from the server's CPU time. (On a GPU the host
    # CPU time holds the CUDA synchronisation spin and says little about the device's work: not measured there.)
    # The host's CPU around the load: how much of it other processes took (a busy runner), on any backend.
    host_before = read_host_cpu(server.pid)
    # A fresh seed per load on this server: repeated prompts would hit vLLM's prefix cache and flatter TTFT.
    result = run_load(
        server.url, server.model_name, spec, seed=server.loads_run, should_abort=lambda: not server.alive()
    )
    host_after = read_host_cpu(server.pid)
    result.others_cpu_share = others_share(host_before, host_after)
    if server.device.backend == "cpu" and host_before.server:
        result.server_cpu_s = cpu_seconds_between(host_before.server, host_after.server)
    sampler.sample_now()
    sampler.mark("load end")
    result.peak_memory_bytes = sampler.peak_between(started)
    if server.device.backend == "cuda":
        result.peak_memory_per_gpu = list(sampler.device_peaks_between(started))
    result.server_alive = server.alive()
    new_log = server.log_text()[log_offset:]
    failure = find_memory_error(new_log)
    if failure is None and not result.server_alive:
        code = server.process.poll()
        died = classify_failure(new_log, code)
        which = f"the API server exited with code {code}" if code is not None else "its engine process exited"
        failure = (
            died
            if died.kind in ("cuda_oom", "host_memory")
            else Diagnosis(
                kind="crash",
                summary=f"the vLLM server died during the load: {which}",
                root_cause=died.root_cause,
                figures=died.figures,
            )
        )
    if failure is not None:
        result.failure = failure
        result.advice = advise(failure, server.launched, server.memory, peak_bytes=result.peak_memory_bytes)
    return result


# Before a confirmation session (the gate's fresh servers): how long to wait for a busy runner to quiet down, and the
# window each look measures the other processes' share of the CPU over.
QUIET_WAIT_S = 60.0
QUIET_WINDOW_S = 2.0


def wait_for_quiet_host(
    server_pid: int, timeout_s: float = QUIET_WAIT_S, look: Callable[[], float | None] | None = None
) -> str | None:
    """Wait, at most `timeout_s`, until processes other than this one and the server's tree take no more than
    BUSY_SHARE of the host's CPU over a window of QUIET_WINDOW_S (`look`: one such reading). None when the host was
    quiet at the first look; otherwise the record's note on the wait (how long, or that the runner stayed busy and
    the loads ran anyway)."""

    def window() -> float | None:
        before = read_host_cpu(server_pid)
        time.sleep(QUIET_WINDOW_S)
        return others_share(before, read_host_cpu(server_pid))

    started = time.monotonic()
    looks = 0
    while True:
        share = (look or window)()
        looks += 1
        if share is None or share <= BUSY_SHARE:
            return (
                None if looks == 1 else f"busy runner: waited {time.monotonic() - started:.0f} s for it to quiet down"
            )
        if time.monotonic() - started >= timeout_s:
            return (
                f"busy runner: other processes still took {share:.0%} of its CPU after {timeout_s:.0f} s; "
                "the confirmation measured anyway"
            )


def load_failure_message(server: Server, result: LoadResult) -> str:
    """The test failure text of a load that `measured_load` found a failure in (result.failure is set)."""
    failure = result.failure
    if failure is None:
        raise ValueError("load_failure_message: the load did not fail (result.failure is None)")
    lines = [
        f"vLLM failed during the load [{failure.kind}]: {failure.summary}",
        f"completed {result.completed}/{result.num_prompts} requests, {result.failed} failed, "
        f"server {'alive' if result.server_alive else 'dead'}",
    ]
    if failure.root_cause:
        lines.append("root cause (from the server log):")
        lines += [f"    {line}" for line in failure.root_cause]
    lines.append(f"command: {server.launched}")
    lines += render_steps(result.advice)
    lines.append(f"full log: {server.log_path}")
    return "\n".join(lines)
