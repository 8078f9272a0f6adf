"""Next steps for a failed or oversized vLLM config, computed from the figures the log and the probes measured.

Each rung names a flag, its current value and the value to try (`gpu_memory_utilization 0.9 -> 0.8`), then why in
parentheses, best rung first. Nothing here is fixed text: every number comes from the diagnosis, the startup log
or the measured peak (device total, requested budget, non-KV usage, CUDA graph pool, the failed allocation), so the
advice changes when the measurement does. Only when a log gives no figure at all does a rung fall back to a step,
and it says so.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory, rejected_flags
from pytest_vllm_mem.units import GIB
from pytest_vllm_mem.versions import default_utilization

if TYPE_CHECKING:
    from pytest_vllm_mem.config import VLLMConfig

UTILIZATION_STEP = 0.05  # only when the log gives no device total to compute from
UTILIZATION_FLOOR = 0.5  # below this a GPU server keeps too little for the KV cache to be worth running
UTILIZATION_CEILING = 0.95
MARGIN = 0.01  # a point of the device for memory that moves between the measurement and the next start
MIN_MAX_MODEL_LEN = 256
MIN_BATCHED_TOKENS = 256

# Flags that vLLM dropped, with what replaced them: said alongside "not accepted".
_REMOVED_FLAGS = {
    "--swap-space": "vLLM removed --swap-space; the V1 engine does not swap to CPU",
}
CPU_KVCACHE_SPACE_DEFAULT_GIB = 4  # VLLM_CPU_KVCACHE_SPACE when unset (vLLM's CPU backend up to 0.11)


def _fmt(value: float) -> str:
    """0.9 -> '0.9', 0.85 -> '0.85', 8192 -> '8192'."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _utilization(config: VLLMConfig, memory: StartupMemory | None, measured: float | None = None) -> tuple[float, str]:
    """(current value, how to name it): 'default 0.9' when the config leaves it to vLLM.

    `measured` is the value the log shows vLLM used, preferred over the version's default when the flag is unset
    (platforms may default differently); the startup log's own figure is the next best.
    """
    value = config.flag("gpu_memory_utilization")
    if value is not None:
        number = float(value)
        return number, _fmt(number)
    if measured is None and memory is not None:
        measured = memory.gpu_memory_utilization
    number = measured if measured is not None else default_utilization(memory.vllm_version if memory else None)
    return number, f"default {_fmt(number)}"


def _floor_to(value: float, step: float) -> float:
    return round(math.floor(value / step + 1e-9) * step, 2)


def _ceil_to(value: float, step: float) -> float:
    return round(math.ceil(value / step - 1e-9) * step, 2)


def power_of_two_at_most(tokens: int, minimum: int = MIN_MAX_MODEL_LEN) -> int:
    """The largest power of two <= tokens, at least `minimum`."""
    return max(minimum, 1 << (max(int(tokens), 1).bit_length() - 1))


def _round_model_len(tokens: float) -> int:
    """A round max_model_len safely under vLLM's estimate: 95 %, down to a multiple of 1024 (256 when small)."""
    target = tokens * 0.95
    step = 1024 if target >= 2048 else 256
    return max(MIN_MAX_MODEL_LEN, int(target // step) * step)


def tier_label(tier_bytes: int) -> str:
    """A tier's own name from its size, as tiers.parse_tier names it: 24e9 bytes -> '24gb', 24 * 2^30 -> '24gib'."""
    if tier_bytes % GIB == 0:
        return f"{tier_bytes // GIB}gib"
    return f"{tier_bytes / 10**9:.2f}".rstrip("0").rstrip(".") + "gb"


def _device_total(diagnosis: Diagnosis | None, memory: StartupMemory | None) -> float | None:
    """The device (or CPU node) total in GiB: from the error itself, else from the startup summary lines."""
    if diagnosis is not None and diagnosis.figures.get("device_total_gib"):
        return diagnosis.figures["device_total_gib"]
    return memory.device_total_gib if memory is not None and memory.device_total_gib else None


def _shortfall(diagnosis: Diagnosis) -> float | None:
    """GiB the failed allocation was short: tried minus what was free (torch prints both), else what it tried."""
    tried = diagnosis.figures.get("tried_allocate_gib")
    if tried is None:
        return None
    free = diagnosis.figures.get("free_gib")
    return max(tried - free, 0.0) if free is not None and free < tried else tried


def _lower_utilization(
    config: VLLMConfig, memory: StartupMemory | None, diagnosis: Diagnosis | None, room_gib: float | None, reason: str
) -> str | None:
    """gpu_memory_utilization lowered by room_gib of the device (plus a margin point), floored to a hundredth.

    Without a device total or a room figure the log gives nothing to compute from: one UTILIZATION_STEP, said so.
    """
    current, shown = _utilization(config, memory)
    total = _device_total(diagnosis, memory)
    if room_gib is not None and total:
        target = max(UTILIZATION_FLOOR, _floor_to(current - room_gib / total - MARGIN, 0.01))
        why = f"{reason}: {room_gib:.2f} GiB more of the {total:.2f} GiB device stays outside vLLM's budget"
    else:
        target = max(UTILIZATION_FLOOR, round(current - UTILIZATION_STEP, 2))
        why = f"{reason}; a {_fmt(UTILIZATION_STEP)} step: the log gives no device total to size it"
    if target >= current:
        return None
    return f"gpu_memory_utilization {shown} -> {_fmt(target)} ({why})"


def _shorter_context(config: VLLMConfig, memory: StartupMemory | None) -> str | None:
    if memory is None or memory.kv_cache_tokens is None:
        return None
    current = config.flag("max_model_len")
    target = power_of_two_at_most(memory.kv_cache_tokens)
    if current is not None and int(current) <= target:
        return None
    shown = str(current) if current is not None else "model default"
    return f"max_model_len {shown} -> {target} (KV cache holds {memory.kv_cache_tokens:,} tokens)"


def _graph_pool(memory: StartupMemory | None) -> float | None:
    """The CUDA graph pool vLLM measured (actual), else its estimate, else the capture's own figure."""
    if memory is None:
        return None
    for value in (memory.graph_pool_gib, memory.graph_pool_estimate_gib, memory.graph_capture_gib):
        if value is not None and value > 0:
            return value
    return None


def _eager(config: VLLMConfig, memory: StartupMemory | None) -> str | None:
    if config.flag("enforce_eager"):
        return None
    pool = _graph_pool(memory)
    if pool is not None:
        return f"add enforce_eager (skips CUDA graph capture and its {pool:.2f} GiB pool)"
    return "add enforce_eager (skips CUDA graph capture and its memory pool)"


def _fewer_seqs(config: VLLMConfig, diagnosis: Diagnosis) -> str | None:
    """The sampler warm-up runs max_num_seqs dummy requests: halve the number the log reports."""
    requests = diagnosis.figures.get("dummy_requests")
    current = config.flag("max_num_seqs")
    count = int(current) if current is not None else (int(requests) if requests else None)
    if count is None or count <= 1:
        return None
    shown = str(current) if current is not None else f"default {count}"
    return (
        f"max_num_seqs {shown} -> {max(1, count // 2)} (the sampler warm-up allocates logits for "
        f"{count} dummy requests at once)"
    )


def _fewer_batched_tokens(config: VLLMConfig) -> str:
    current = config.flag("max_num_batched_tokens")
    if current is not None:
        target = max(MIN_BATCHED_TOKENS, int(current) // 2)
        return (
            f"max_num_batched_tokens {current} -> {target} (the profiling pass runs one batch of that many "
            "tokens; its activations must fit beside the weights)"
        )
    return (
        "set max_num_batched_tokens below vLLM's default, e.g. 1024 (the profiling pass runs one batch of that "
        "many tokens; its activations must fit beside the weights)"
    )


def _device_oom(diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    """Rungs by the phase the traceback shows: what was being allocated decides what to shrink."""
    phase = diagnosis.phase
    room = _shortfall(diagnosis)
    tried, free = diagnosis.figures.get("tried_allocate_gib"), diagnosis.figures.get("free_gib")
    if tried is not None and free is not None:
        shown_room = f"a {tried:.2f} GiB allocation failed with {free:.2f} GiB free"
    elif tried is not None:
        shown_room = f"a {tried:.2f} GiB allocation failed"
    else:
        shown_room = "an allocation outside the budget failed"
    rungs: list[str | None]
    if phase == "graph_capture":
        pool = _graph_pool(memory)
        graph_room = max(r for r in (room, pool) if r is not None) if (room or pool) else None
        rungs = [
            _eager(config, memory),
            _lower_utilization(
                config, memory, diagnosis, graph_room, "CUDA graphs are captured after the KV cache took its budget"
            ),
        ]
    elif phase == "sampler_warmup":
        rungs = [
            _fewer_seqs(config, diagnosis),
            _lower_utilization(
                config,
                memory,
                diagnosis,
                room,
                "the sampler's buffers are allocated after the KV cache took its budget",
            ),
        ]
    elif phase == "profiling":
        rungs = [
            _fewer_batched_tokens(config),
            _shorter_context(config, memory),
            f"tensor_parallel_size {int(config.flag('tensor_parallel_size', 1) or 1) * 2} (splits the weights "
            "and the activation peak across devices)",
        ]
    elif phase == "kv_cache_allocation":
        rungs = [
            _lower_utilization(
                config, memory, diagnosis, room, f"the KV cache is sized from the budget and {shown_room}"
            ),
            _shorter_context(config, memory),
        ]
    elif phase == "wake_up":
        rungs = [
            _lower_utilization(
                config,
                memory,
                diagnosis,
                room,
                "waking up re-allocates weights and KV cache beside what others took meanwhile",
            ),
            "free device memory held by the other user of the device (e.g. the trainer) before wake_up",
        ]
    else:  # serving, or a phase the log does not show
        rungs = [
            _lower_utilization(config, memory, diagnosis, room, shown_room),
            _shorter_context(config, memory),
            _eager(config, memory),
        ]
    return [rung for rung in rungs if rung]


def _host_memory(diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    figures = diagnosis.figures
    total = figures.get("device_total_gib")
    measured = round(figures["requested_gib"] / total, 2) if total and "requested_gib" in figures else None
    current, shown = _utilization(config, memory, measured)
    kv = figures.get("kv_requested_gib")
    non_kv = figures.get("non_kv_gib")
    if kv is not None and kv <= 0 and total and non_kv is not None:
        # On the CPU backend the utilization is the worker's share of the node: too low leaves no KV cache.
        target = max(_ceil_to(non_kv * 1.25 / total, 0.05), round(current + 0.05, 2))
        return [
            f"gpu_memory_utilization {shown} -> {_fmt(target)} (on CPU it sets the worker's share of the "
            f"{total:.2f} GiB node: {figures.get('requested_gib', current * total):.2f} GiB now, but the worker "
            f"already uses {non_kv:.2f} GiB before its KV cache)",
            f"size the CPU KV cache directly: env VLLM_CPU_KVCACHE_SPACE=1 (GiB; the node has "
            f"{figures.get('available_gib', 0):.2f} GiB available)",
        ]
    if kv is not None and kv <= 0 and non_kv is not None and "min_gpu_memory_utilization" in figures:
        # vLLM 0.33 prints no node total here, but names the least utilization that holds the worker (rounded up).
        minimum = figures["min_gpu_memory_utilization"]
        target = max(_ceil_to(minimum * 1.25, 0.05), round(current + 0.05, 2))
        return [
            f"gpu_memory_utilization {shown} -> {_fmt(target)} (on CPU it sets the worker's share of the node: "
            f"{figures.get('requested_gib', 0):.2f} GiB now, but the worker already uses {non_kv:.2f} GiB before "
            f"its KV cache; vLLM needs more than {_fmt(minimum)})",
            "size the CPU KV cache directly: env VLLM_CPU_KVCACHE_SPACE=1 (GiB) or --kv-cache-memory-bytes",
        ]
    if kv is not None and total and figures.get("available_gib") is not None:
        available = figures["available_gib"]
        if "requested_gib" not in figures:  # explicit size: --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE
            fit = _floor_to(available * 0.9, 0.25)
            return [
                f"lower the explicit KV cache size {kv:.2f} GiB -> {_fmt(fit)} GiB (node has {available:.2f} "
                "GiB available): --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE",
                "stop other processes that hold host memory",
            ]
        # Auto size: requested_for_kv = requested - non_kv must fit in what the node has available.
        requested = figures["requested_gib"]
        target = _floor_to((available + requested - kv) * 0.95 / total, 0.05)
        rungs = [
            "stop other processes that hold host memory (node has "
            f"{available:.2f} of {total:.2f} GiB available, the KV cache asks for {kv:.2f} GiB)"
        ]
        if 0 < target < current:
            rungs.append(f"gpu_memory_utilization {shown} -> {_fmt(target)} (fits the KV cache into what is available)")
        return rungs
    rungs = ["the host ran out of RAM, not device memory: stop other processes or use a machine with more RAM"]
    if figures.get("host_kill"):  # Ray's memory monitor or the kernel's OOM killer stopped a process
        if "threshold" in figures:
            rungs.append(
                f"or let Ray kill later: env RAY_memory_usage_threshold (now {figures['threshold']:g} of the node's "
                "RAM) when Ray starts"
            )
        if diagnosis.platform != "cpu":
            return rungs  # off the CPU backend, gpu_memory_utilization sizes device memory, not the host's
    rungs += [
        r
        for r in (
            _lower_utilization(config, memory, diagnosis, None, "the CPU backend sizes its KV cache from it"),
            _shorter_context(config, memory),
        )
        if r
    ]
    return rungs


def _raise_utilization(
    config: VLLMConfig, memory: StartupMemory | None, diagnosis: Diagnosis, missing_gib: float | None
) -> str | None:
    """gpu_memory_utilization raised by the GiB the KV cache lacks (10 % spare), over the device total."""
    utilization, shown = _utilization(config, memory, diagnosis.figures.get("gpu_memory_utilization"))
    total = _device_total(diagnosis, memory)
    if missing_gib is not None and total:
        target = _ceil_to(utilization + missing_gib * 1.1 / total + MARGIN, 0.01)
        why = (
            f"the KV cache lacks {missing_gib:.2f} GiB of the {total:.2f} GiB device; it gets what is left of "
            "the budget after weights, activations and graphs"
        )
    else:
        target = round(utilization + 2 * UTILIZATION_STEP, 2)
        why = (
            f"a {_fmt(2 * UTILIZATION_STEP)} step: the log gives no device total to size it; the KV cache gets "
            "what is left of the budget after weights and activations"
        )
    target = min(target, UTILIZATION_CEILING)
    if target <= utilization:
        return None
    return f"raise gpu_memory_utilization {shown} -> {_fmt(target)} ({why})"


def _kv_cache_insufficient(diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    figures = diagnosis.figures
    rungs: list[str] = []
    configured_len = figures.get("max_model_len") or config.flag("max_model_len")
    current_len = int(configured_len) if configured_len else None
    estimate = figures.get("estimated_max_model_len")
    tokens = figures.get("kv_cache_tokens") or (memory.kv_cache_tokens if memory is not None else None)
    needed, available = figures.get("needed_gib"), figures.get("available_gib")
    if current_len and (estimate or tokens or (needed and available and available > 0)):
        ceiling = estimate or tokens or current_len * (available or 0.0) / (needed or 1.0)
        target = _round_model_len(ceiling)
        if target < current_len:
            if tokens:
                holds = f"the KV cache holds only {int(tokens):,} tokens"
            else:
                holds = (
                    f"the KV cache has {available:.2f} GiB, one {current_len:,}-token sequence needs {needed:.2f} GiB"
                )
            why = f"{holds}; vLLM estimates a maximum of {int(estimate):,}" if estimate else holds
            rungs.append(f"max_model_len {current_len} -> {target} ({why})")
    cpu_space = config.env.get("VLLM_CPU_KVCACHE_SPACE")
    if cpu_space is not None or figures.get("cpu_backend"):
        space = float(cpu_space) if cpu_space is not None else float(CPU_KVCACHE_SPACE_DEFAULT_GIB)
        shown = cpu_space if cpu_space is not None else f"default {CPU_KVCACHE_SPACE_DEFAULT_GIB}"
        if needed:
            target_gib = max(math.ceil(needed * 1.1), int(space) + 1)
            why = f"GiB; one sequence needs {needed:.2f} GiB"
        elif tokens and current_len:
            # The space holds `tokens` tokens: scale it to one max_model_len sequence, 10 % spare.
            target_gib = max(math.ceil(space * current_len / tokens * 1.1), int(space) + 1)
            why = f"GiB; {_fmt(space)} GiB hold {int(tokens):,} tokens, one sequence is {current_len:,}"
        else:
            target_gib = int(space) * 2
            why = "GiB"
        rungs.append(f"{'or ' if rungs else ''}VLLM_CPU_KVCACHE_SPACE {shown} -> {target_gib} ({why})")
        return rungs
    explicit_bytes = config.flag("kv_cache_memory_bytes")
    if explicit_bytes is not None and needed:
        target_bytes = math.ceil(needed * 1.1 * GIB)
        rungs.append(
            f"{'or ' if rungs else ''}kv_cache_memory_bytes {explicit_bytes} -> {target_bytes} "
            f"(one sequence needs {needed:.2f} GiB)"
        )
        return rungs
    # Too low a utilization is a cause too: the pool is what is left of the budget after weights and activations.
    missing: float | None = None
    if needed is not None and available is not None:
        missing = needed - available
    elif available is not None and available <= 0:
        missing = -available
    graph = figures.get("graph_estimate_gib")
    raised = _raise_utilization(config, memory, diagnosis, missing)
    if raised:
        rungs.append(f"{'or ' if rungs else ''}{raised}")
    if graph:
        # The estimate comes out of the KV budget first: when it alone empties the pool, skipping it is the fix.
        rungs.insert(
            0,
            f"skip the CUDA graph reservation: env VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 or add "
            f"enforce_eager (vLLM set {graph:.2f} GiB aside for graphs before sizing the KV cache)",
        )
    elif (available is not None and available <= 0) or "No available memory" in " ".join(diagnosis.root_cause):
        eager = _eager(config, memory)
        if eager:
            rungs.append(eager)
    return rungs


def _insufficient_free_memory(diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    figures = diagnosis.figures
    free, total = figures.get("free_gib"), figures.get("device_total_gib")
    if free is None or not total:
        return [
            "another process holds memory on this device: wait for it to exit (an earlier vLLM server may "
            "still be shutting down) or lower gpu_memory_utilization"
        ]
    held = total - free
    # vLLM needs ceil(total * utilization) free at startup; a point of margin for memory that moves meanwhile.
    fit = _floor_to(free / total - MARGIN, 0.01)
    if fit < 0.1:
        return [
            f"another process holds {held:.2f} GiB of this {total:.2f} GiB device: wait for it to exit "
            "(too little is free for any useful gpu_memory_utilization)"
        ]
    asked = ""
    if "gpu_memory_utilization" in figures and "requested_gib" in figures:
        asked = f" ({_fmt(figures['gpu_memory_utilization'])} asks for {figures['requested_gib']:.2f} GiB, "
        asked += f"{free:.2f} GiB are free)"
    return [
        f"another process holds {held:.2f} GiB on this device: wait for it to exit or lower "
        f"gpu_memory_utilization to {_fmt(fit)}{asked}"
    ]


def _memory_profiling_error(diagnosis: Diagnosis) -> list[str]:
    figures = diagnosis.figures
    moved = ""
    if "initial_free_gib" in figures and "current_free_gib" in figures:
        moved = (
            f" (free memory went from {figures['initial_free_gib']:.2f} to {figures['current_free_gib']:.2f} "
            "GiB during profiling)"
        )
    return [
        f"run vLLM on a device no other process allocates on or frees while it starts{moved}: pick another "
        "GPU with CUDA_VISIBLE_DEVICES, or start vLLM before (or after) the other process settles",
        "retry once the other process on the device is idle (vLLM profiles once, at startup)",
    ]


def _external_weights_over_budget(diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    figures = diagnosis.figures
    external, total = figures.get("external_gib"), figures.get("device_total_gib")
    current, shown = _utilization(config, memory, figures.get("gpu_memory_utilization"))
    if external is None or not total:
        return [
            "raise gpu_memory_utilization: the budget must cover the weights held outside vLLM's process plus "
            "vLLM's own activations and KV cache"
        ]
    # The engine gets budget - external: leave it a tenth of the device for activations, graphs and a KV cache.
    target = min(UTILIZATION_CEILING, _ceil_to(external / total + 0.1, 0.01))
    rungs = []
    if target > current:
        rungs.append(
            f"raise gpu_memory_utilization {shown} -> {_fmt(target)} (the budget counts the {external:.2f} "
            f"GiB of weights held outside vLLM; this leaves {target * total - external:.2f} GiB of the "
            f"{total:.2f} GiB device for vLLM's own activations and KV cache)"
        )
    rungs.append("or load fewer weights outside vLLM's process on this device")
    return rungs


def _weights_too_large(
    diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None, tier_bytes: int | None
) -> list[str]:
    figures = diagnosis.figures
    tp = int(config.flag("tensor_parallel_size", 1) or 1)
    if memory is not None and memory.weights_gib is not None:
        need = f"the weights need {memory.weights_gib:.2f} GiB"
    elif "process_used_gib" in figures and "device_total_gib" in figures:
        need = (
            f"the weights need more than {figures['process_used_gib']:.2f} GiB "
            f"(loading filled {figures['device_total_gib']:.2f} GiB device memory)"
        )
    elif "device_total_gib" in figures:
        need = f"the weights need more than the {figures['device_total_gib']:.2f} GiB device"
    else:
        need = "the weights do not fit in device memory"
    where = f" than {tier_label(tier_bytes)}" if tier_bytes else ""
    return [
        f"{need}: use a larger tier{where}, a quantized model (e.g. --quantization awq) or "
        f"tensor_parallel_size {tp * 2}"
    ]


def _usage(diagnosis: Diagnosis, memory: StartupMemory | None) -> list[str]:
    version = f" {memory.vllm_version}" if memory is not None and memory.vllm_version else ""
    if "repository is gated" in diagnosis.summary:
        return [
            "accept the model's license on its hub page and set HF_TOKEN to a token of that account, or serve a "
            "local copy"
        ]
    if "no hub repository or local folder" in diagnosis.summary:
        return [
            "give the model as a hub repository id or a local folder that holds its config.json (the installed "
            f"vLLM{version} found none where the model argument points)"
        ]
    if "positional argument (" in diagnosis.summary:
        return [
            "pass the model with --model to python -m vllm.entrypoints.openai.api_server, or launch "
            f"`vllm serve <model>` (the installed vLLM{version} refused a positional argument)"
        ]
    return [
        f"pass the model as the first positional argument: `vllm serve <model> [flags]` (the installed "
        f"vLLM{version}: {diagnosis.summary})"
    ]


def _bad_flag(diagnosis: Diagnosis, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    if diagnosis.phase == "usage":
        return _usage(diagnosis, memory)
    version = f" {memory.vllm_version}" if memory is not None and memory.vllm_version else ""
    derived = diagnosis.figures.get("derived_max_model_len")
    if derived and "max_model_len" in diagnosis.figures:
        return [
            f"max_model_len {int(diagnosis.figures['max_model_len'])} -> {int(derived)} (the model's config "
            f"allows {int(derived):,} tokens; env VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lifts the check at the risk vLLM "
            "warns of)"
        ]
    unrecognized = "unrecognized arguments" in " ".join(diagnosis.root_cause)
    rungs = []
    for flag in rejected_flags(diagnosis) or ("a setting",):
        if unrecognized:
            note = _REMOVED_FLAGS.get(flag)
            rungs.append(
                f"{flag} is not accepted by the installed vLLM{version}: remove it from the config"
                + (f" ({note})" if note else "")
            )
            continue
        value = config.flag(flag.lstrip("-").replace("-", "_"))
        setting = f"{flag}={value}" if value is not None else flag
        # The summary already says what was wrong: "... rejected gpu_memory_utilization=1.5: Input should ..."
        reason = diagnosis.summary.partition(": ")[2] or diagnosis.summary
        rungs.append(f"{setting} is rejected by the installed vLLM{version}: {reason}")
    rungs.append("list the accepted flags and values with: python -m vllm.entrypoints.openai.api_server --help")
    return rungs


def _timeout(diagnosis: Diagnosis) -> list[str]:
    if diagnosis.figures.get("worker_rpc_timeout"):  # a worker stopped answering; the startup timeout is not it
        return [
            f"{diagnosis.summary}: a step slower than the wait can be given longer with "
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s by default); a worker stuck on its device needs the device's "
            "logs (dmesg, the driver's) and a restart",
        ]
    limit = diagnosis.figures.get("timeout_s")
    shown = f" {limit:g} s" if limit else ""
    return [
        f"raise the startup timeout (now{shown}): {diagnosis.summary}",
        "keep vLLM's compile cache warm between runs (VLLM_CACHE_ROOT) to shorten startup",
    ]


def _crash(diagnosis: Diagnosis) -> list[str]:
    if diagnosis.figures.get("returncode") == -9 and "OOM killer" in diagnosis.summary:
        return [
            "the process was killed by SIGKILL with no error logged: check `dmesg` for the kernel OOM killer "
            "and the host's free RAM"
        ]
    return []


def _peak_over_tier(config: VLLMConfig, memory: StartupMemory | None, tier_bytes: int, peak_bytes: int) -> list[str]:
    peak, tier = peak_bytes / GIB, tier_bytes / GIB
    over = peak - tier
    label = tier_label(tier_bytes)
    if memory is not None and memory.weights_gib is not None and memory.weights_gib >= tier * 0.9:
        return [
            f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB and the weights alone take "
            f"{memory.weights_gib:.2f} GiB: use a quantized model or tensor_parallel_size "
            f"{int(config.flag('tensor_parallel_size', 1) or 1) * 2}"
        ]
    current, shown = _utilization(config, memory)
    total = memory.device_total_gib if memory is not None else None
    requested = memory.requested_gib if memory is not None else None
    if total and requested:
        return _peak_over_tier_from_budget(config, memory, tier, peak, total, requested)
    # vLLM's footprint scales with the utilization budget; scale it by tier/peak, less a point of margin.
    target = round(_floor_to(current * tier / peak, 0.01) - MARGIN, 2)
    if target <= 0.05:
        return [f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB: this model does not fit the tier"]
    return _then_shorter_context(
        f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB: gpu_memory_utilization "
        f"{shown} -> {_fmt(target)}",
        config,
        memory,
    )


def _then_shorter_context(rung: str, config: VLLMConfig, memory: StartupMemory | None) -> list[str]:
    """A peak-over-tier fix, then a shorter max_model_len when the log says how many tokens the KV cache holds."""
    shorter = _shorter_context(config, memory)
    return [rung, shorter] if shorter else [rung]


def _peak_over_tier_from_budget(
    config: VLLMConfig, memory: StartupMemory | None, tier: float, peak: float, total: float, requested: float
) -> list[str]:
    """With the budget vLLM logged: the peak is the budget plus what vLLM used outside it (CUDA context, NCCL,
    allocator slack); only the budget moves with gpu_memory_utilization, so size it to what the tier leaves."""
    _current, shown = _utilization(config, memory)
    label, over = tier_label(int(tier * GIB)), peak - tier
    outside = max(peak - requested, 0.0)
    target = _floor_to((tier - outside) / total - MARGIN, 0.01)
    non_kv = memory.non_kv_gib if memory is not None else None
    kv_left = target * total - non_kv if non_kv is not None else None
    head = f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB"
    if target <= 0 or (kv_left is not None and kv_left <= 0):
        what = f"weights, activations and graphs alone take {non_kv:.2f} GiB" if non_kv is not None else "it does not"
        return [
            f"{head}: the tier cannot hold this model's server ({what}, and vLLM used {outside:.2f} GiB outside "
            "its budget): use a quantized model or a larger tier"
        ]
    kv = f"; {kv_left:.2f} GiB of it stays for the KV cache" if kv_left is not None else ""
    return _then_shorter_context(
        f"{head}: gpu_memory_utilization {shown} -> {_fmt(target)} (a {target * total:.2f} GiB budget of the "
        f"{total:.2f} GiB device, plus the {outside:.2f} GiB vLLM used outside its budget, fits the tier{kv})",
        config,
        memory,
    )


# "gpu_memory_utilization 0.15 -> 0.13", "default 0.92 -> 0.8", "gpu_memory_utilization to 0.5": the values of a rung.
_UTILIZATION_RUNG = re.compile(
    r"gpu_memory_utilization (?:(default )?(\d+(?:\.\d+)?) -> (\d+(?:\.\d+)?)|to (\d+(?:\.\d+)?))"
)


def advise(
    diagnosis: Diagnosis | None,
    config: VLLMConfig,
    memory: StartupMemory | None,
    tier_bytes: int | None = None,
    peak_bytes: int | None = None,
    *,
    requested: VLLMConfig | None = None,
) -> list[str]:
    """Concrete next steps, best first, for a diagnosis (or, with none, for a peak above the tier); [] if none.

    `config` is what ran; `requested`, what the test asked for. Under tier emulation the launched
    gpu_memory_utilization is the user's scaled by tier/device (0.92 on the 24gb tier of an H200 runs as 0.1543):
    the advice then names the user's value and what to set it to, with the launched figures beside them."""
    steps = _advise(diagnosis, config, memory, tier_bytes, peak_bytes)
    return _in_requested_units(steps, config, requested, memory) if requested is not None else steps


def _in_requested_units(
    steps: list[str], launched: VLLMConfig, requested: VLLMConfig, memory: StartupMemory | None
) -> list[str]:
    ran = launched.flag("gpu_memory_utilization")
    asked = requested.flag("gpu_memory_utilization")
    if ran is None or asked == ran:
        return steps
    user = float(asked) if asked is not None else default_utilization(memory.vllm_version if memory else None)
    scale = float(ran) / user
    if not 0 < scale < 1:
        return steps

    def convert(match: re.Match[str]) -> str:
        if match.group(4) is not None:
            target = float(match.group(4))
            return f"gpu_memory_utilization to {_fmt(_floor_to(target / scale, 0.01))} (launched as {target:g})"
        before, after = float(match.group(2)), float(match.group(3))
        is_current = abs(before - float(ran)) <= 0.005  # the rung shows the launched value to two decimals
        shown = ("default " if asked is None else "") + _fmt(user if is_current else before / scale)
        return (
            f"gpu_memory_utilization {shown} -> {_fmt(_floor_to(after / scale, 0.01))} (the tier emulation "
            f"launches it as {float(ran) if is_current else before:g} -> {after:g})"
        )

    return [_UTILIZATION_RUNG.sub(convert, step) for step in steps]


def _advise(
    diagnosis: Diagnosis | None,
    config: VLLMConfig,
    memory: StartupMemory | None,
    tier_bytes: int | None,
    peak_bytes: int | None,
) -> list[str]:
    if diagnosis is None:
        if tier_bytes and peak_bytes and peak_bytes > tier_bytes:
            return _peak_over_tier(config, memory, tier_bytes, peak_bytes)
        return []
    kind = diagnosis.kind
    if kind == "cuda_oom":
        return _device_oom(diagnosis, config, memory)
    if kind == "host_memory":
        return _host_memory(diagnosis, config, memory)
    if kind == "kv_cache_insufficient":
        return _kv_cache_insufficient(diagnosis, config, memory)
    if kind == "insufficient_free_memory":
        return _insufficient_free_memory(diagnosis, config, memory)
    if kind == "memory_profiling_error":
        return _memory_profiling_error(diagnosis)
    if kind == "external_weights_over_budget":
        return _external_weights_over_budget(diagnosis, config, memory)
    if kind == "weights_too_large":
        return _weights_too_large(diagnosis, config, memory, tier_bytes)
    if kind == "bad_flag":
        return _bad_flag(diagnosis, config, memory)
    if kind == "timeout":
        return _timeout(diagnosis)
    return _crash(diagnosis)


def render_steps(steps: list[str]) -> list[str]:
    """The ladder as failure-message lines: the best rung first, the alternatives under it."""
    if not steps:
        return []
    return [f"next step: {steps[0]}"] + [f"       or: {step}" for step in steps[1:]]
