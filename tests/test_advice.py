from __future__ import annotations

from pathlib import Path

import pytest

from pytest_vllm_mem.advice import GIB, advise, default_utilization, power_of_two_at_most, tier_label
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnose import Diagnosis, StartupMemory, classify_failure, parse_startup_memory

LOGS = Path(__file__).parent / "data" / "logs"


def from_log(name: str, returncode: int = 1) -> tuple[Diagnosis, StartupMemory]:
    text = (LOGS / name).read_text(encoding="utf-8")
    return classify_failure(text, returncode), parse_startup_memory(text)


def oom(**figures: float) -> Diagnosis:
    return Diagnosis("cuda_oom", "vLLM ran out of device memory while serving requests", (), dict(figures))


# --- helpers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, expected", [(9_344, 8192), (8192, 8192), (13_136, 8192), (300, 256), (10, 256),
                                              (108_160, 65536)])
def test_power_of_two_at_most(tokens: int, expected: int) -> None:
    assert power_of_two_at_most(tokens) == expected


def test_default_utilization_by_version() -> None:
    assert default_utilization("0.32.0") == 0.92
    assert default_utilization("0.33.1rc1") == 0.92
    assert default_utilization("0.10.2") == 0.9
    assert default_utilization(None) == 0.9


def test_tier_label() -> None:
    assert tier_label(24 * GIB) == "24gb"
    assert tier_label(int(7.5 * GIB)) == "7.5gb"


# --- cuda_oom -------------------------------------------------------------------------------------------------------


def test_cuda_oom_full_ladder_from_measured_figures() -> None:
    config = VLLMConfig("m", gpu_memory_utilization=0.9, max_model_len=32768)
    memory = StartupMemory(kv_cache_tokens=9_344, graph_capture_gib=1.6)
    assert advise(oom(tried_allocate_gib=0.5), config, memory) == [
        "gpu_memory_utilization 0.9 -> 0.8 (leaves room for the 0.50 GiB allocation that failed outside vLLM's "
        "budget)",
        "max_model_len 32768 -> 8192 (KV cache holds 9,344 tokens)",
        "add enforce_eager (graph capture took 1.60 GiB)",
    ]


def test_cuda_oom_unset_utilization_names_the_versions_default() -> None:
    rungs = advise(oom(), VLLMConfig("m"), StartupMemory(vllm_version="0.10.2", kv_cache_tokens=13_136))
    assert rungs[0] == "gpu_memory_utilization default 0.9 -> 0.8 (leaves room for activations outside vLLM's budget)"
    assert rungs[1] == "max_model_len model default -> 8192 (KV cache holds 13,136 tokens)"
    assert advise(oom(), VLLMConfig("m"), StartupMemory(vllm_version="0.32.0"))[0].startswith(
        "gpu_memory_utilization default 0.92 -> 0.82")


def test_cuda_oom_floor_eager_and_short_context_already_set() -> None:
    config = VLLMConfig("m", gpu_memory_utilization=0.55, max_model_len=4096, enforce_eager=True)
    rungs = advise(oom(), config, StartupMemory(kv_cache_tokens=9_344, graph_capture_gib=1.6))
    assert rungs == ["gpu_memory_utilization 0.55 -> 0.5 (leaves room for activations outside vLLM's budget)"]
    assert advise(oom(), config.with_flags(gpu_memory_utilization=0.5), None) == []


def test_cuda_oom_from_the_profiling_log() -> None:
    diagnosis, memory = from_log("gpu-0.33-oom-profiling.log")
    assert advise(diagnosis, VLLMConfig("m", max_model_len=32768), memory) == [
        "gpu_memory_utilization default 0.92 -> 0.82 (leaves room for the 0.50 GiB allocation that failed outside "
        "vLLM's budget)",
        "add enforce_eager (skips CUDA graph capture and its memory pool)",
    ]


# --- host_memory ----------------------------------------------------------------------------------------------------


def test_host_memory_cpu_too_low_utilization_raises_it() -> None:
    diagnosis, memory = from_log("cpu-0.32-host-memory.log")
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.02, max_model_len=2048), memory)
    assert rungs == [
        "gpu_memory_utilization 0.02 -> 0.1 (on CPU it sets the worker's share of the 10.46 GiB node: 0.21 GiB now, "
        "but the worker already uses 0.83 GiB before its KV cache)",
        "size the CPU KV cache directly: env VLLM_CPU_KVCACHE_SPACE=1 (GiB; the node has 9.06 GiB available)",
    ]
    # Unset in the config: the value vLLM used is read back from the log (0.21 of 10.46 GiB).
    assert advise(diagnosis, VLLMConfig("m"), memory)[0].startswith("gpu_memory_utilization default 0.02 -> 0.1 ")


def test_host_memory_cpu_node_short_of_memory_for_auto_kv() -> None:
    diagnosis = Diagnosis("host_memory", "", (), {"available_gib": 2.0, "device_total_gib": 10.0,
                                                  "kv_requested_gib": 8.0, "requested_gib": 9.0, "non_kv_gib": 1.0})
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.9), None) == [
        "stop other processes that hold host memory (node has 2.00 of 10.00 GiB available, the KV cache asks for "
        "8.00 GiB)",
        "gpu_memory_utilization 0.9 -> 0.25 (fits the KV cache into what is available)",
    ]


def test_host_memory_cpu_explicit_kv_size() -> None:
    diagnosis = Diagnosis("host_memory", "", (), {"available_gib": 3.0, "device_total_gib": 10.46,
                                                  "kv_requested_gib": 4.0})
    assert advise(diagnosis, VLLMConfig("m"), None) == [
        "lower the explicit KV cache size 4.00 GiB -> 2.5 GiB (node has 3.00 GiB available): --kv-cache-memory-bytes "
        "or VLLM_CPU_KVCACHE_SPACE",
        "stop other processes that hold host memory",
    ]


def test_host_memory_generic() -> None:
    diagnosis = Diagnosis("host_memory", "the host ran out of memory (RAM, not device memory)", ("MemoryError",), {})
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.8, max_model_len=16384),
                   StartupMemory(kv_cache_tokens=4_000))
    assert rungs == [
        "the host ran out of RAM, not device memory: stop other processes or use a machine with more RAM",
        "gpu_memory_utilization 0.8 -> 0.7 (the CPU backend sizes its KV cache from it)",
        "max_model_len 16384 -> 2048 (KV cache holds 4,000 tokens)",
    ]


# --- kv_cache_insufficient ------------------------------------------------------------------------------------------


def test_kv_cache_insufficient_uses_vllms_estimate_then_utilization() -> None:
    diagnosis, memory = from_log("gpu-0.10-kv-cache-insufficient.log")
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.3, max_model_len=131072), memory)
    assert rungs == [
        "max_model_len 131072 -> 49152 (the KV cache has 6.42 GiB, one 131,072-token sequence needs 16.00 GiB; vLLM "
        "estimates a maximum of 52,576)",
        "or raise gpu_memory_utilization 0.3 -> 0.4 (the KV cache gets what is left of the budget after weights and "
        "activations)",
    ]


def test_kv_cache_insufficient_with_known_token_capacity() -> None:
    diagnosis = Diagnosis("kv_cache_insufficient", "", (), {"max_model_len": 32768, "needed_gib": 4.0,
                                                            "available_gib": 1.14})
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.9), StartupMemory(kv_cache_tokens=9_344))
    assert rungs[0] == "max_model_len 32768 -> 8192 (the KV cache holds only 9,344 tokens)"
    assert rungs[1].startswith("or raise gpu_memory_utilization 0.9 -> 0.95 ")


def test_kv_cache_insufficient_cpu_explicit_bytes_real_log() -> None:
    diagnosis, memory = from_log("cpu-0.32-kv-cache-insufficient.log")
    config = VLLMConfig("m", max_model_len=32768, kv_cache_memory_bytes=16_000_000)
    assert advise(diagnosis, config, memory) == [
        "max_model_len 32768 -> 7168 (the KV cache has 0.01 GiB, one 32,768-token sequence needs 0.06 GiB; vLLM "
        "estimates a maximum of 7,680)",
        "or kv_cache_memory_bytes 16000000 -> 70866961 (one sequence needs 0.06 GiB)",
    ]


def test_kv_cache_insufficient_cpu_env_space() -> None:
    diagnosis = Diagnosis("kv_cache_insufficient", "", (), {"max_model_len": 2048, "needed_gib": 2.5,
                                                            "available_gib": 1.0, "estimated_max_model_len": 800})
    config = VLLMConfig("m", env={"VLLM_CPU_KVCACHE_SPACE": "1"}, max_model_len=2048)
    assert advise(diagnosis, config, None) == [
        "max_model_len 2048 -> 512 (the KV cache has 1.00 GiB, one 2,048-token sequence needs 2.50 GiB; vLLM "
        "estimates a maximum of 800)",
        "or VLLM_CPU_KVCACHE_SPACE 1 -> 3 (GiB; one sequence needs 2.50 GiB)",
    ]


def test_kv_cache_utilization_target_from_device_total() -> None:
    # CPU logs give the node total: the raise is computed, not a fixed step.
    diagnosis = Diagnosis("kv_cache_insufficient", "", (), {"max_model_len": 8192, "needed_gib": 2.0,
                                                            "available_gib": 1.0})
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.1, max_model_len=8192),
                   StartupMemory(device_total_gib=10.0))
    assert rungs[-1].startswith("or raise gpu_memory_utilization 0.1 -> 0.25 ")


def test_no_cache_blocks_raises_utilization_first() -> None:
    diagnosis, memory = from_log("gpu-0.10-no-cache-blocks.log")
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.5), memory) == [
        "raise gpu_memory_utilization 0.5 -> 0.6 (the KV cache gets what is left of the budget after weights and "
        "activations)",
        "add enforce_eager (skips CUDA graph capture and its memory pool)",
    ]


# --- insufficient_free_memory, weights, flags -------------------------------------------------------------------


def test_insufficient_free_memory_from_free_and_total() -> None:
    diagnosis, memory = from_log("gpu-0.33-free-memory.log")
    assert advise(diagnosis, VLLMConfig("m"), memory) == [
        "another process holds 11.38 GiB on this device: wait for it to exit or lower gpu_memory_utilization to 0.5 "
        "(0.92 asks for 21.68 GiB, 12.18 GiB are free)"
    ]


def test_insufficient_free_memory_nearly_full_device() -> None:
    diagnosis = Diagnosis("insufficient_free_memory", "", (), {"free_gib": 1.0, "device_total_gib": 80.0})
    assert advise(diagnosis, VLLMConfig("m"), None) == [
        "another process holds 79.00 GiB of this 80.00 GiB device: wait for it to exit (too little is free for any "
        "useful gpu_memory_utilization)"
    ]


def test_weights_too_large_from_the_log_and_tier() -> None:
    diagnosis, memory = from_log("gpu-0.33-weights-oom.log")
    assert advise(diagnosis, VLLMConfig("m", tensor_parallel_size=2), memory, tier_bytes=24 * GIB) == [
        "the weights need more than 23.10 GiB (loading filled 23.55 GiB device memory): use a larger tier than 24gb, "
        "a quantized model (e.g. --quantization awq) or tensor_parallel_size 4"
    ]


def test_weights_too_large_with_measured_weights() -> None:
    diagnosis = Diagnosis("weights_too_large", "", (), {})
    assert advise(diagnosis, VLLMConfig("m"), StartupMemory(weights_gib=30.5)) == [
        "the weights need 30.50 GiB: use a larger tier, a quantized model (e.g. --quantization awq) or "
        "tensor_parallel_size 2"
    ]


def test_bad_flag_unrecognized_names_flag_and_version() -> None:
    diagnosis = classify_failure("api_server.py: error: unrecognized arguments: --swap-space\n", 2)
    rungs = advise(diagnosis, VLLMConfig("m", swap_space=4), StartupMemory(vllm_version="0.32.0"))
    assert rungs[0] == ("--swap-space is not accepted by the installed vLLM 0.32.0: remove it from the config (vLLM "
                        "removed --swap-space; the V1 engine does not swap to CPU)")
    assert rungs[-1].startswith("list the accepted flags")


def test_bad_flag_value() -> None:
    diagnosis, memory = from_log("cpu-0.32-validation-error.log")
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=1.5), memory)[0] == (
        "gpu_memory_utilization=1.5 is rejected by the installed vLLM 0.32.0: Input should be less than or equal to 1")
    argparse = classify_failure("api_server.py: error: argument --dtype: invalid choice: 'foo' (choose from "
                                "'auto', 'half')\n", 2)
    assert advise(argparse, VLLMConfig("m", dtype="foo"), None)[0] == (
        "--dtype=foo is rejected by the installed vLLM: invalid choice: 'foo' (choose from 'auto', 'half')")


# --- peak above tier, timeout, crash -----------------------------------------------------------------------------


def test_peak_above_tier_scales_utilization() -> None:
    rungs = advise(None, VLLMConfig("m", gpu_memory_utilization=0.9), StartupMemory(weights_gib=15.0),
                   tier_bytes=24 * GIB, peak_bytes=26 * GIB)
    assert rungs == ["peak 26.00 GiB exceeds the 24gb tier by 2.00 GiB: gpu_memory_utilization 0.9 -> 0.82"]


def test_peak_above_tier_from_a_large_card_and_short_context() -> None:
    # Measured on an 80 GiB card at the default: emulating the 24gb tier needs a much smaller share.
    rungs = advise(None, VLLMConfig("m", max_model_len=32768), StartupMemory(vllm_version="0.33.0",
                   kv_cache_tokens=20_000), tier_bytes=24 * GIB, peak_bytes=int(75.5 * GIB))
    assert rungs == [
        "peak 75.50 GiB exceeds the 24gb tier by 51.50 GiB: gpu_memory_utilization default 0.92 -> 0.28",
        "max_model_len 32768 -> 16384 (KV cache holds 20,000 tokens)",
    ]


def test_peak_above_tier_when_weights_alone_do_not_fit() -> None:
    rungs = advise(None, VLLMConfig("m"), StartupMemory(weights_gib=23.0), tier_bytes=24 * GIB, peak_bytes=30 * GIB)
    assert rungs == ["peak 30.00 GiB exceeds the 24gb tier by 6.00 GiB and the weights alone take 23.00 GiB: use a "
                     "quantized model or tensor_parallel_size 2"]


def test_no_advice_when_the_peak_fits_or_nothing_is_known() -> None:
    assert advise(None, VLLMConfig("m"), None) == []
    assert advise(None, VLLMConfig("m"), None, tier_bytes=24 * GIB, peak_bytes=20 * GIB) == []


def test_timeout_and_crash_advice() -> None:
    timeout = Diagnosis("timeout", "vLLM did not become healthy within 240 s (last stage reached: loading the "
                        "weights)", (), {"timeout_s": 240.0})
    assert advise(timeout, VLLMConfig("m"), None)[0] == (
        "raise the startup timeout (now 240 s): vLLM did not become healthy within 240 s (last stage reached: "
        "loading the weights)")
    killed = classify_failure("", -9)
    assert advise(killed, VLLMConfig("m"), None) == [
        "the process was killed by SIGKILL with no error logged: check `dmesg` for the kernel OOM killer and the "
        "host's free RAM"]
    assert advise(classify_failure("OSError: boom\n", 1), VLLMConfig("m"), None) == []
