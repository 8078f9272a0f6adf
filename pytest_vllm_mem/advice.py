"""Next steps for a failed or oversized vLLM config, computed from the figures the log and the probes measured.

Each rung names a flag, its current value and the value to try (`gpu_memory_utilization 0.9 -> 0.8`), then why in
parentheses, best rung first. Nothing here is fixed text: every number comes from the diagnosis, the startup log
or the measured peak, so the advice changes when the measurement does.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from .diagnose import Diagnosis, StartupMemory, rejected_flags

if TYPE_CHECKING:
    from .config import VLLMConfig

GIB = 1024**3
UTILIZATION_STEP = 0.1
UTILIZATION_FLOOR = 0.5  # below this a GPU server keeps too little for the KV cache to be worth running
UTILIZATION_CEILING = 0.95
MIN_MAX_MODEL_LEN = 256

# Flags that vLLM dropped, with what replaced them: said alongside "not accepted".
_REMOVED_FLAGS = {
    "--swap-space": "vLLM removed --swap-space; the V1 engine does not swap to CPU",
}


def _fmt(value: float) -> str:
    """0.9 -> '0.9', 0.85 -> '0.85', 8192 -> '8192'."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def default_utilization(version: str | None) -> float:
    """vLLM's default gpu_memory_utilization: 0.92 in the 0.3x releases (read in 0.32's CacheConfig), 0.9 before."""
    parsed = _version_tuple(version)
    return 0.92 if parsed is not None and parsed >= (0, 32) else 0.9


def _utilization(config: "VLLMConfig", memory: StartupMemory | None,
                 measured: float | None = None) -> tuple[float, str]:
    """(current value, how to name it): 'default 0.9' when the config leaves it to vLLM.

    `measured` is the value the log shows vLLM used, preferred over the version's default when the flag is unset
    (platforms may default differently).
    """
    value = config.flag("gpu_memory_utilization")
    if value is not None:
        number = float(value)
        return number, _fmt(number)
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
    """24 GiB -> '24gb' (the tier names used in markers and reports)."""
    return f"{_fmt(tier_bytes / GIB)}gb"


def _lower_utilization(config: "VLLMConfig", memory: StartupMemory | None, reason: str) -> str | None:
    current, shown = _utilization(config, memory)
    target = max(UTILIZATION_FLOOR, round(current - UTILIZATION_STEP, 2))
    if target >= current:
        return None
    return f"gpu_memory_utilization {shown} -> {_fmt(target)} ({reason})"


def _shorter_context(config: "VLLMConfig", memory: StartupMemory | None) -> str | None:
    if memory is None or memory.kv_cache_tokens is None:
        return None
    current = config.flag("max_model_len")
    target = power_of_two_at_most(memory.kv_cache_tokens)
    if current is not None and int(current) <= target:
        return None
    shown = str(current) if current is not None else "model default"
    return f"max_model_len {shown} -> {target} (KV cache holds {memory.kv_cache_tokens:,} tokens)"


def _eager(config: "VLLMConfig", memory: StartupMemory | None) -> str | None:
    if config.flag("enforce_eager"):
        return None
    if memory is not None and memory.graph_capture_gib is not None:
        return f"add enforce_eager (graph capture took {memory.graph_capture_gib:.2f} GiB)"
    return "add enforce_eager (skips CUDA graph capture and its memory pool)"


def _device_oom(diagnosis: Diagnosis, config: "VLLMConfig", memory: StartupMemory | None) -> list[str]:
    tried = diagnosis.figures.get("tried_allocate_gib")
    room = f"room for the {tried:.2f} GiB allocation that failed" if tried else "room for activations"
    rungs = [
        _lower_utilization(config, memory, f"leaves {room} outside vLLM's budget"),
        _shorter_context(config, memory),
        _eager(config, memory),
    ]
    return [rung for rung in rungs if rung]


def _host_memory(diagnosis: Diagnosis, config: "VLLMConfig", memory: StartupMemory | None) -> list[str]:
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
    if kv is not None and total and figures.get("available_gib") is not None:
        available = figures["available_gib"]
        if "requested_gib" not in figures:  # explicit size: --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE
            fit = _floor_to(available * 0.9, 0.25)
            return [f"lower the explicit KV cache size {kv:.2f} GiB -> {_fmt(fit)} GiB (node has {available:.2f} "
                    "GiB available): --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE",
                    "stop other processes that hold host memory"]
        # Auto size: requested_for_kv = requested - non_kv must fit in what the node has available.
        requested = figures["requested_gib"]
        target = _floor_to((available + requested - kv) * 0.95 / total, 0.05)
        rungs = ["stop other processes that hold host memory (node has "
                 f"{available:.2f} of {total:.2f} GiB available, the KV cache asks for {kv:.2f} GiB)"]
        if 0 < target < current:
            rungs.append(f"gpu_memory_utilization {shown} -> {_fmt(target)} (fits the KV cache into what is "
                         "available)")
        return rungs
    rungs = ["the host ran out of RAM, not device memory: stop other processes or use a machine with more RAM"]
    rungs += [r for r in (_lower_utilization(config, memory, "the CPU backend sizes its KV cache from it"),
                          _shorter_context(config, memory)) if r]
    return rungs


def _kv_cache_insufficient(diagnosis: Diagnosis, config: "VLLMConfig", memory: StartupMemory | None) -> list[str]:
    figures = diagnosis.figures
    rungs: list[str] = []
    configured_len = figures.get("max_model_len") or config.flag("max_model_len")
    current_len = int(configured_len) if configured_len else None
    estimate = figures.get("estimated_max_model_len")
    tokens = memory.kv_cache_tokens if memory is not None else None
    needed, available = figures.get("needed_gib"), figures.get("available_gib")
    if current_len and needed and available and available > 0:
        ceiling = estimate if estimate else (tokens if tokens else current_len * available / needed)
        target = _round_model_len(ceiling)
        if target < current_len:
            if tokens:
                holds = f"the KV cache holds only {tokens:,} tokens"
            else:
                holds = (f"the KV cache has {available:.2f} GiB, one {current_len:,}-token sequence needs "
                         f"{needed:.2f} GiB")
            why = f"{holds}; vLLM estimates a maximum of {int(estimate):,}" if estimate else holds
            rungs.append(f"max_model_len {current_len} -> {target} ({why})")
    cpu_space = config.env.get("VLLM_CPU_KVCACHE_SPACE")
    if cpu_space is not None and needed:
        target_gib = max(math.ceil(needed * 1.1), int(float(cpu_space)) + 1)
        rungs.append(f"{'or ' if rungs else ''}VLLM_CPU_KVCACHE_SPACE {cpu_space} -> {target_gib} "
                     f"(GiB; one sequence needs {needed:.2f} GiB)")
        return rungs
    explicit_bytes = config.flag("kv_cache_memory_bytes")
    if explicit_bytes is not None and needed:
        target_bytes = int(math.ceil(needed * 1.1 * GIB))
        rungs.append(f"{'or ' if rungs else ''}kv_cache_memory_bytes {explicit_bytes} -> {target_bytes} "
                     f"(one sequence needs {needed:.2f} GiB)")
        return rungs
    # Too low a utilization is a cause too: the pool is what is left of the budget after weights and activations.
    utilization, shown = _utilization(config, memory)
    total = memory.device_total_gib if memory is not None else None
    if needed and available is not None and total:
        target = _ceil_to(utilization + (needed - available) * 1.1 / total, 0.05)
    else:
        target = round(utilization + UTILIZATION_STEP, 2)
    target = min(target, UTILIZATION_CEILING)
    if target > utilization:
        rungs.append(f"{'or ' if rungs else ''}raise gpu_memory_utilization {shown} -> {_fmt(target)} "
                     "(the KV cache gets what is left of the budget after weights and activations)")
    if available is not None and available <= 0:
        eager = _eager(config, memory)
        if eager:
            rungs.append(eager)
    return rungs


def _insufficient_free_memory(diagnosis: Diagnosis, config: "VLLMConfig", memory: StartupMemory | None) -> list[str]:
    figures = diagnosis.figures
    free, total = figures.get("free_gib"), figures.get("device_total_gib")
    if free is None or not total:
        return ["another process holds memory on this device: wait for it to exit (an earlier vLLM server may "
                "still be shutting down) or lower gpu_memory_utilization"]
    held = total - free
    # vLLM needs ceil(total * utilization) free at startup; a point of margin for memory that moves meanwhile.
    fit = _floor_to(free / total - 0.01, 0.01)
    if fit < 0.1:
        return [f"another process holds {held:.2f} GiB of this {total:.2f} GiB device: wait for it to exit "
                "(too little is free for any useful gpu_memory_utilization)"]
    asked = ""
    if "gpu_memory_utilization" in figures and "requested_gib" in figures:
        asked = f" ({_fmt(figures['gpu_memory_utilization'])} asks for {figures['requested_gib']:.2f} GiB, "
        asked += f"{free:.2f} GiB are free)"
    return [f"another process holds {held:.2f} GiB on this device: wait for it to exit or lower "
            f"gpu_memory_utilization to {_fmt(fit)}{asked}"]


def _weights_too_large(diagnosis: Diagnosis, config: "VLLMConfig", memory: StartupMemory | None,
                       tier_bytes: int | None) -> list[str]:
    figures = diagnosis.figures
    tp = int(config.flag("tensor_parallel_size", 1) or 1)
    if memory is not None and memory.weights_gib is not None:
        need = f"the weights need {memory.weights_gib:.2f} GiB"
    elif "process_used_gib" in figures and "device_total_gib" in figures:
        need = (f"the weights need more than {figures['process_used_gib']:.2f} GiB "
                f"(loading filled {figures['device_total_gib']:.2f} GiB device memory)")
    elif "device_total_gib" in figures:
        need = f"the weights need more than the {figures['device_total_gib']:.2f} GiB device"
    else:
        need = "the weights do not fit in device memory"
    where = f" than {tier_label(tier_bytes)}" if tier_bytes else ""
    return [f"{need}: use a larger tier{where}, a quantized model (e.g. --quantization awq) or "
            f"tensor_parallel_size {tp * 2}"]


def _bad_flag(diagnosis: Diagnosis, config: "VLLMConfig", memory: StartupMemory | None) -> list[str]:
    version = f" {memory.vllm_version}" if memory is not None and memory.vllm_version else ""
    unrecognized = "unrecognized arguments" in " ".join(diagnosis.root_cause)
    rungs = []
    for flag in rejected_flags(diagnosis) or ("a setting",):
        if unrecognized:
            note = _REMOVED_FLAGS.get(flag)
            rungs.append(f"{flag} is not accepted by the installed vLLM{version}: remove it from the config"
                         + (f" ({note})" if note else ""))
            continue
        value = config.flag(flag.lstrip("-").replace("-", "_"))
        setting = f"{flag}={value}" if value is not None else flag
        # The summary already says what was wrong: "... rejected gpu_memory_utilization=1.5: Input should ..."
        reason = diagnosis.summary.partition(": ")[2] or diagnosis.summary
        rungs.append(f"{setting} is rejected by the installed vLLM{version}: {reason}")
    rungs.append("list the accepted flags and values with: python -m vllm.entrypoints.openai.api_server --help")
    return rungs


def _timeout(diagnosis: Diagnosis) -> list[str]:
    limit = diagnosis.figures.get("timeout_s")
    shown = f" {limit:g} s" if limit else ""
    return [f"raise the startup timeout (now{shown}): {diagnosis.summary}",
            "keep vLLM's compile cache warm between runs (VLLM_CACHE_ROOT) to shorten startup"]


def _crash(diagnosis: Diagnosis) -> list[str]:
    if diagnosis.figures.get("returncode") == -9 and "OOM killer" in diagnosis.summary:
        return ["the process was killed by SIGKILL with no error logged: check `dmesg` for the kernel OOM killer "
                "and the host's free RAM"]
    return []


def _peak_over_tier(config: "VLLMConfig", memory: StartupMemory | None, tier_bytes: int,
                    peak_bytes: int) -> list[str]:
    peak, tier = peak_bytes / GIB, tier_bytes / GIB
    over = peak - tier
    label = tier_label(tier_bytes)
    if memory is not None and memory.weights_gib is not None and memory.weights_gib >= tier * 0.9:
        return [f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB and the weights alone take "
                f"{memory.weights_gib:.2f} GiB: use a quantized model or tensor_parallel_size "
                f"{int(config.flag('tensor_parallel_size', 1) or 1) * 2}"]
    current, shown = _utilization(config, memory)
    # vLLM's footprint scales with the utilization budget; scale it by tier/peak, less a point of margin.
    target = round(_floor_to(current * tier / peak, 0.01) - 0.01, 2)
    if target <= 0.05:
        return [f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB: this model does not fit the tier"]
    rungs = [f"peak {peak:.2f} GiB exceeds the {label} tier by {over:.2f} GiB: gpu_memory_utilization "
             f"{shown} -> {_fmt(target)}"]
    shorter = _shorter_context(config, memory)
    if shorter:
        rungs.append(shorter)
    return rungs


def advise(diagnosis: Diagnosis | None, config: "VLLMConfig", memory: StartupMemory | None,
           tier_bytes: int | None = None, peak_bytes: int | None = None) -> list[str]:
    """Concrete next steps, best first, for a diagnosis (or, with none, for a peak above the tier); [] if none."""
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
