from __future__ import annotations

from pathlib import Path

import pytest

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.advice import advise, power_of_two_at_most, tier_label
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory, classify_failure, parse_startup_memory
from pytest_vllm_mem.tiers import Tier, parse_tier
from pytest_vllm_mem.units import GIB
from pytest_vllm_mem.versions import default_utilization


def sized(text: str) -> Tier:
    """The tier of a size (parse_tier gives None only for `auto`)."""
    tier = parse_tier(text)
    assert tier is not None
    return tier


# vLLM 0.33.0's GPU startup summary (gpu_worker.py compile_or_warm_up_model), numbers filled in: no public log has it.
GPU_TOTALS_033 = (
    "(Worker pid=4320) INFO 11-30 04:48:26 [gpu_worker.py:1066] Free memory on device (23.13/23.55 GiB) on startup. "
    "Desired GPU memory utilization is (0.92, 21.67 GiB). Actual usage is 14.49 GiB for consumed memory (weights + "
    "non-torch), 1.34 GiB for peak activation, and 0.53 GiB for CUDAGraph memory."
)

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"


def from_log(name: str, returncode: int = 1) -> tuple[Diagnosis, StartupMemory]:
    text = (LOGS / name).read_text(encoding="utf-8")
    return classify_failure(text, returncode), parse_startup_memory(text)


def oom(phase: str | None = "serving", **figures: float) -> Diagnosis:
    return Diagnosis("cuda_oom", "vLLM ran out of device memory", (), dict(figures), phase)


# --- helpers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, expected", [(9_344, 8192), (8192, 8192), (13_136, 8192), (300, 256), (10, 256), (108_160, 65536)]
)
def test_power_of_two_at_most(tokens: int, expected: int) -> None:
    assert power_of_two_at_most(tokens) == expected


def test_default_utilization_by_version() -> None:
    assert default_utilization("0.32.0") == 0.92
    assert default_utilization("0.33.1rc1") == 0.92
    assert default_utilization("0.27.1") == 0.92  # read in 0.27.1's CacheConfig
    assert default_utilization("0.25.1") == 0.92  # 0.25.0's CacheConfig, quoted in a public ops guide
    assert default_utilization("0.19.1") == 0.9
    assert default_utilization("0.10.2") == 0.9
    assert default_utilization(None) == 0.9


def test_tier_label() -> None:
    # A tier's own name, as parse_tier gives it: 24gb is 24e9 bytes, not "22.35gb" (issue 23 item 4).
    for name in ("24gb", "7.5gb", "141gb", "24gib", "80gib"):
        assert tier_label(sized(name).bytes) == name


# --- cuda_oom: the phase decides the rungs, the figures decide the values -----------------------------------------


def test_serving_oom_lowers_utilization_by_the_shortfall() -> None:
    diagnosis, memory = from_log("gpu-0.8-serving-oom-v0-13221.log")
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.9), memory)
    # 1.50 GiB tried, 0.2571 GiB free: 1.24 GiB short on a 44.53 GiB card -> 0.9 - 1.24/44.53 - 0.01 = 0.862 -> 0.86
    assert rungs[0] == (
        "gpu_memory_utilization 0.9 -> 0.86 (a 1.50 GiB allocation failed with 0.26 GiB free: 1.24 "
        "GiB more of the 44.53 GiB device stays outside vLLM's budget)"
    )
    assert rungs[-1] == "add enforce_eager (skips CUDA graph capture and its memory pool)"


def test_oom_advice_moves_with_the_measurement() -> None:
    small = advise(oom(tried_allocate_gib=0.5, free_gib=0.1, device_total_gib=80.0), VLLMConfig("m"), None)[0]
    large = advise(oom(tried_allocate_gib=8.0, free_gib=0.1, device_total_gib=80.0), VLLMConfig("m"), None)[0]
    assert small.startswith("gpu_memory_utilization default 0.9 -> 0.88 ")
    assert large.startswith("gpu_memory_utilization default 0.9 -> 0.79 ")


def test_graph_capture_oom_advises_eager_first_not_weights() -> None:
    diagnosis, memory = from_log("gpu-0.9-graph-capture-cuda-error-oom-19186.log")
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.95), memory)
    assert rungs[0] == "add enforce_eager (skips CUDA graph capture and its memory pool)"
    # "CUDA error: out of memory" carries no sizes: the one rung without figures says it is a step.
    assert rungs[1] == (
        "gpu_memory_utilization 0.95 -> 0.9 (CUDA graphs are captured after the KV cache took its "
        "budget; a 0.05 step: the log gives no device total to size it)"
    )
    assert not any("weights" in rung for rung in rungs)


def test_graph_capture_oom_sized_by_the_graph_pool_from_the_startup_summary() -> None:
    memory = StartupMemory(device_total_gib=23.55, gpu_memory_utilization=0.92, graph_pool_estimate_gib=1.2)
    rungs = advise(oom("graph_capture"), VLLMConfig("m"), memory)
    assert rungs == [
        "add enforce_eager (skips CUDA graph capture and its 1.20 GiB pool)",
        "gpu_memory_utilization default 0.92 -> 0.85 (CUDA graphs are captured after the KV cache took its budget: "
        "1.20 GiB more of the 23.55 GiB device stays outside vLLM's budget)",
    ]


def test_sampler_warmup_oom_halves_max_num_seqs() -> None:
    diagnosis, memory = from_log("gpu-0.13-sampler-warmup-oom-2080ti-19445.log")
    rungs = advise(diagnosis, VLLMConfig("m"), memory)
    assert rungs[0] == (
        "max_num_seqs default 256 -> 128 (the sampler warm-up allocates logits for 256 dummy requests at once)"
    )
    assert rungs[1].startswith(
        "gpu_memory_utilization default 0.9 -> 0.88 (the sampler's buffers are allocated after "
        "the KV cache took its budget: 0.09 GiB more of the 10.57 GiB device"
    )
    assert advise(diagnosis, VLLMConfig("m", max_num_seqs=64), memory)[0].startswith("max_num_seqs 64 -> 32 ")


def test_profiling_oom_shrinks_the_profiled_batch() -> None:
    rungs = advise(
        oom("profiling", tried_allocate_gib=2.0),
        VLLMConfig("m", max_num_batched_tokens=8192, tensor_parallel_size=2),
        None,
    )
    assert rungs[0].startswith("max_num_batched_tokens 8192 -> 4096 (the profiling pass runs one batch")
    assert rungs[-1].startswith("tensor_parallel_size 4 ")


def test_kv_allocation_oom_and_wake_up() -> None:
    diagnosis, memory = from_log("gpu-0.4-kv-alloc-oom-qwen458.log")
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.9), memory)[0].startswith(
        "gpu_memory_utilization 0.9 -> 0.85 (the KV cache is sized from the budget and a 0.63 GiB allocation failed"
    )
    diagnosis, memory = from_log("gpu-0.7-wake-up-oom-cumem-13941.log")
    assert advise(diagnosis, VLLMConfig("m"), memory)[1].startswith("free device memory held by the other user")


def test_cuda_oom_floor_and_eager_already_set() -> None:
    config = VLLMConfig("m", gpu_memory_utilization=0.5, max_model_len=4096, enforce_eager=True)
    assert advise(oom(tried_allocate_gib=1.0, device_total_gib=24.0), config, None) == []


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


def test_host_memory_cpu_worker_over_its_reservation_raises_utilization() -> None:
    # vLLM 0.33's message: no node total, but the least utilization that holds the worker.
    figures = {"non_kv_gib": 1.37, "requested_gib": 1.25, "kv_requested_gib": -0.12, "min_gpu_memory_utilization": 0.11}
    diagnosis = Diagnosis("host_memory", "", (), figures, "kv_cache_allocation")
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.1), None) == [
        "gpu_memory_utilization 0.1 -> 0.15 (on CPU it sets the worker's share of the node: 1.25 GiB now, but the "
        "worker already uses 1.37 GiB before its KV cache; vLLM needs more than 0.11)",
        "size the CPU KV cache directly: env VLLM_CPU_KVCACHE_SPACE=1 (GiB) or --kv-cache-memory-bytes",
    ]


def test_host_memory_cpu_node_short_of_memory_for_auto_kv() -> None:
    diagnosis = Diagnosis(
        "host_memory",
        "",
        (),
        {
            "available_gib": 2.0,
            "device_total_gib": 10.0,
            "kv_requested_gib": 8.0,
            "requested_gib": 9.0,
            "non_kv_gib": 1.0,
        },
    )
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.9), None) == [
        "stop other processes that hold host memory (node has 2.00 of 10.00 GiB available, the KV cache asks for "
        "8.00 GiB)",
        "gpu_memory_utilization 0.9 -> 0.25 (fits the KV cache into what is available)",
    ]


def test_host_memory_cpu_explicit_kv_size() -> None:
    diagnosis = Diagnosis(
        "host_memory", "", (), {"available_gib": 3.0, "device_total_gib": 10.46, "kv_requested_gib": 4.0}
    )
    assert advise(diagnosis, VLLMConfig("m"), None) == [
        "lower the explicit KV cache size 4.00 GiB -> 2.5 GiB (node has 3.00 GiB available): --kv-cache-memory-bytes "
        "or VLLM_CPU_KVCACHE_SPACE",
        "stop other processes that hold host memory",
    ]


def test_host_memory_generic() -> None:
    diagnosis = classify_failure("MemoryError\n", -6)
    rungs = advise(
        diagnosis,
        VLLMConfig("m", gpu_memory_utilization=0.8, max_model_len=16384),
        StartupMemory(kv_cache_tokens=4_000),
    )
    assert rungs[0] == "the host ran out of RAM, not device memory: stop other processes or use a machine with more RAM"
    assert rungs[2] == "max_model_len 16384 -> 2048 (KV cache holds 4,000 tokens)"


# --- kv_cache_insufficient ------------------------------------------------------------------------------------------


def test_v0_kv_too_small_gpu_computes_the_raise_from_the_profiling_figures() -> None:
    diagnosis, memory = from_log("gpu-0.6-kv-max-seq-len-10517.log")
    rungs = advise(diagnosis, VLLMConfig("m", max_model_len=29000), memory)
    assert rungs == [
        "max_model_len 29000 -> 21504 (the KV cache holds only 23,648 tokens)",
        # needs 3.54 GiB, has 2.89 -> 0.9 (read from the log) + 0.65 * 1.1 / 23.58 + 0.01 -> 0.95
        "or raise gpu_memory_utilization default 0.9 -> 0.95 (the KV cache lacks 0.65 GiB of the 23.58 GiB device; it "
        "gets what is left of the budget after weights, activations and graphs)",
    ]


def test_v0_kv_too_small_cpu_scales_the_kv_space() -> None:
    diagnosis, memory = from_log("cpu-0.8-kv-max-seq-len-cpu-opea1762.log")
    assert advise(diagnosis, VLLMConfig("m"), memory) == [
        "max_model_len 131072 -> 20480 (the KV cache holds only 21,840 tokens)",
        "or VLLM_CPU_KVCACHE_SPACE default 4 -> 27 (GiB; 4 GiB hold 21,840 tokens, one sequence is 131,072)",
    ]
    config = VLLMConfig("m", env={"VLLM_CPU_KVCACHE_SPACE": "40"})
    assert advise(diagnosis, config, memory)[1] == (
        "or VLLM_CPU_KVCACHE_SPACE 40 -> 265 (GiB; 40 GiB hold 21,840 tokens, one sequence is 131,072)"
    )


def test_kv_cache_insufficient_uses_vllms_estimate() -> None:
    diagnosis, _memory = from_log("gpu-0.14-kv-cache-needed-pp-32105.log")
    rungs = advise(diagnosis, VLLMConfig("m"), StartupMemory(device_total_gib=80.0))
    assert rungs[0] == (
        "max_model_len 202752 -> 76800 (the KV cache has 28.57 GiB, one 202,752-token sequence needs "
        "71.16 GiB; vLLM estimates a maximum of 81,392)"
    )
    assert rungs[1] == "or raise gpu_memory_utilization default 0.9 -> 0.95 " + rungs[1].split("0.95 ", 1)[1]


def test_kv_cache_utilization_target_from_device_total() -> None:
    diagnosis = Diagnosis(
        "kv_cache_insufficient", "", (), {"max_model_len": 8192, "needed_gib": 2.0, "available_gib": 1.0}
    )
    rungs = advise(
        diagnosis, VLLMConfig("m", gpu_memory_utilization=0.1, max_model_len=8192), StartupMemory(device_total_gib=10.0)
    )
    # 0.1 + (2 - 1) * 1.1 / 10 + 0.01 = 0.22
    assert rungs[-1].startswith(
        "or raise gpu_memory_utilization 0.1 -> 0.22 (the KV cache lacks 1.00 GiB of the 10.00 GiB device"
    )
    bigger = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.1), StartupMemory(device_total_gib=4.0))
    assert "0.1 -> 0.39 " in bigger[-1]  # the same shortfall is a bigger share of a smaller device


def test_kv_cache_insufficient_cpu_explicit_bytes_real_log() -> None:
    diagnosis, memory = from_log("cpu-0.32-kv-cache-insufficient.log")
    config = VLLMConfig("m", max_model_len=32768, kv_cache_memory_bytes=16_000_000)
    assert advise(diagnosis, config, memory) == [
        "max_model_len 32768 -> 7168 (the KV cache has 0.01 GiB, one 32,768-token sequence needs 0.06 GiB; vLLM "
        "estimates a maximum of 7,680)",
        "or kv_cache_memory_bytes 16000000 -> 70866961 (one sequence needs 0.06 GiB)",
    ]


def test_kv_cache_insufficient_cpu_env_space() -> None:
    diagnosis, memory = from_log("cpu-0.11-kv-cache-needed-29233.log")
    config = VLLMConfig("m", env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert advise(diagnosis, config, memory) == [
        "max_model_len 40960 -> 34816 (the KV cache has 4.00 GiB, one 40,960-token sequence needs 4.38 GiB; vLLM "
        "estimates a maximum of 37,376)",
        "or VLLM_CPU_KVCACHE_SPACE 4 -> 5 (GiB; one sequence needs 4.38 GiB)",
    ]


def test_no_cache_blocks_with_a_huge_graph_estimate_skips_the_reservation_first() -> None:
    diagnosis, memory = from_log("gpu-0.28-no-cache-blocks-graph-estimate-53013.log")
    rungs = advise(diagnosis, VLLMConfig("m"), memory)
    assert rungs[0] == (
        "skip the CUDA graph reservation: env VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 or add "
        "enforce_eager (vLLM set 118.65 GiB aside for graphs before sizing the KV cache)"
    )


def test_no_cache_blocks_raise_sized_by_the_negative_pool() -> None:
    diagnosis = Diagnosis(
        "kv_cache_insufficient",
        "no memory was left",
        ("ValueError: No available memory for the cache blocks.",),
        {"available_gib": -1.25},
    )
    rungs = advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=0.5), StartupMemory(device_total_gib=23.55))
    # 0.5 + 1.25 * 1.1 / 23.55 + 0.01 = 0.568 -> 0.57
    assert rungs[0].startswith(
        "raise gpu_memory_utilization 0.5 -> 0.57 (the KV cache lacks 1.25 GiB of the 23.55 GiB device"
    )
    assert rungs[1] == "add enforce_eager (skips CUDA graph capture and its memory pool)"


# --- free memory, profiling, external weights, weights, flags ---------------------------------------------------


def test_insufficient_free_memory_from_free_and_total() -> None:
    diagnosis, memory = from_log("gpu-0.9-free-memory-20305.log")
    assert advise(diagnosis, VLLMConfig("m"), memory) == [
        "another process holds 15.94 GiB on this device: wait for it to exit or lower gpu_memory_utilization to 0.65 "
        "(0.95 asks for 45.01 GiB, 31.44 GiB are free)"
    ]


def test_insufficient_free_memory_nearly_full_device() -> None:
    diagnosis, memory = from_log("gpu-0.15-free-memory-ci-33297.log")
    assert advise(diagnosis, VLLMConfig("m"), memory) == [
        "another process holds 20.52 GiB of this 22.05 GiB device: wait for it to exit (too little is free for any "
        "useful gpu_memory_utilization)"
    ]


def test_memory_profiling_error_points_at_the_other_process() -> None:
    diagnosis, memory = from_log("gpu-0.29-memory-profiling-assert-56830.log")
    rungs = advise(diagnosis, VLLMConfig("m"), memory)
    assert "(free memory went from 82.94 to 90.17 GiB during profiling)" in rungs[0]
    assert "CUDA_VISIBLE_DEVICES" in rungs[0]


def test_external_weights_raise_the_budget_over_them() -> None:
    diagnosis = Diagnosis(
        "external_weights_over_budget",
        "",
        (),
        {"external_gib": 20.5, "device_total_gib": 23.55, "gpu_memory_utilization": 0.8, "requested_gib": 18.84},
    )
    rungs = advise(diagnosis, VLLMConfig("m"), None)
    # 20.5 / 23.55 + 0.1 = 0.97 -> capped at 0.95
    assert rungs[0].startswith("raise gpu_memory_utilization default 0.8 -> 0.95 (the budget counts the 20.50 GiB")


def test_weights_too_large_from_the_log_and_tier() -> None:
    diagnosis, memory = from_log("gpu-0.11-weights-oom-create-weights-28143.log")
    assert advise(diagnosis, VLLMConfig("m", tensor_parallel_size=2), memory, tier_bytes=sized("96gib").bytes) == [
        "the weights need more than 92.34 GiB (loading filled 93.09 GiB device memory): use a larger tier than 96gib, "
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
    assert rungs[0] == (
        "--swap-space is not accepted by the installed vLLM 0.32.0: remove it from the config (vLLM "
        "removed --swap-space; the V1 engine does not swap to CPU)"
    )
    assert rungs[-1].startswith("list the accepted flags")


def test_bad_flag_value() -> None:
    diagnosis, memory = from_log("cpu-0.32-validation-error.log")
    assert advise(diagnosis, VLLMConfig("m", gpu_memory_utilization=1.5), memory)[0] == (
        "gpu_memory_utilization=1.5 is rejected by the installed vLLM 0.32.0: Input should be less than or equal to 1"
    )


def test_usage_errors_say_how_to_give_the_model() -> None:
    diagnosis, memory = from_log("gpu-0.8-usage-model-flag-16691.log")
    assert advise(diagnosis, VLLMConfig("m"), memory)[0].startswith(
        "pass the model as the first positional argument: `vllm serve <model> [flags]`"
    )
    diagnosis, memory = from_log("gpu-0.11-usage-model-positional-to-api-server-27389.log", 2)
    assert advise(diagnosis, VLLMConfig("m"), memory)[0].startswith(
        "pass the model with --model to python -m vllm.entrypoints.openai.api_server"
    )
    # A model argument that names nothing loadable, or a gated repository: the advice is about the model, not the
    # command line (it had told both to pass the model positionally, which they had done).
    diagnosis, memory = from_log("gpu-0.11-no-config-json-qwen-image-edit-omni-vllmomni474.log")
    assert advise(diagnosis, VLLMConfig("m"), memory)[0].startswith("give the model as a hub repository id or a local")
    diagnosis, memory = from_log("gpu-0.18-bad-flag-gated-model-403-facebook-cwm-contextbench.log")
    assert "HF_TOKEN" in advise(diagnosis, VLLMConfig("m"), memory)[0]


# --- peak above tier, timeout, crash -----------------------------------------------------------------------------


def test_peak_above_tier_scales_utilization() -> None:
    rungs = advise(
        None,
        VLLMConfig("m", gpu_memory_utilization=0.9),
        StartupMemory(weights_gib=15.0),
        tier_bytes=sized("24gib").bytes,
        peak_bytes=26 * GIB,
    )
    assert rungs == ["peak 26.00 GiB exceeds the 24gib tier by 2.00 GiB: gpu_memory_utilization 0.9 -> 0.82"]


def test_peak_above_tier_from_a_large_card_and_short_context() -> None:
    rungs = advise(
        None,
        VLLMConfig("m", max_model_len=32768),
        StartupMemory(vllm_version="0.33.0", kv_cache_tokens=20_000),
        tier_bytes=sized("24gib").bytes,
        peak_bytes=int(75.5 * GIB),
    )
    assert rungs == [
        "peak 75.50 GiB exceeds the 24gib tier by 51.50 GiB: gpu_memory_utilization default 0.92 -> 0.28",
        "max_model_len 32768 -> 16384 (KV cache holds 20,000 tokens)",
    ]


def test_peak_above_tier_when_weights_alone_do_not_fit() -> None:
    rungs = advise(
        None,
        VLLMConfig("m"),
        StartupMemory(weights_gib=23.0),
        tier_bytes=sized("24gib").bytes,
        peak_bytes=30 * GIB,
    )
    assert rungs == [
        "peak 30.00 GiB exceeds the 24gib tier by 6.00 GiB and the weights alone take 23.00 GiB: use a "
        "quantized model or tensor_parallel_size 2"
    ]


def test_no_advice_when_the_peak_fits_or_nothing_is_known() -> None:
    assert advise(None, VLLMConfig("m"), None) == []
    assert advise(None, VLLMConfig("m"), None, tier_bytes=sized("24gib").bytes, peak_bytes=20 * GIB) == []


def test_timeout_and_crash_advice() -> None:
    timeout = Diagnosis(
        "timeout",
        "vLLM did not become healthy within 240 s (last stage reached: loading the weights)",
        (),
        {"timeout_s": 240.0},
    )
    assert advise(timeout, VLLMConfig("m"), None)[0] == (
        "raise the startup timeout (now 240 s): vLLM did not become healthy within 240 s (last stage reached: "
        "loading the weights)"
    )
    killed = classify_failure("", -9)
    assert advise(killed, VLLMConfig("m"), None) == [
        "the process was killed by SIGKILL with no error logged: check `dmesg` for the kernel OOM killer and the "
        "host's free RAM"
    ]
    assert advise(classify_failure("OSError: boom\n", 1), VLLMConfig("m"), None) == []


def test_max_model_len_over_the_models_own_lowers_it_to_the_model() -> None:
    diagnosis, memory = from_log("gpu-0.1x-max-model-len-over-derived-longvt9.log")
    assert advise(diagnosis, VLLMConfig("m", max_model_len=131072), memory) == [
        "max_model_len 131072 -> 32768 (the model's config allows 32,768 tokens; env VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
        "lifts the check at the risk vLLM warns of)"
    ]


def test_peak_above_tier_sized_from_the_logged_budget() -> None:
    # 0.33's startup summary gives device total, budget and non-KV usage: only the budget moves with the
    # utilization, what vLLM used outside it stays.
    memory = parse_startup_memory(GPU_TOTALS_033)  # 23.55 GiB device, 0.92 -> 21.67 GiB budget, 16.36 GiB non-KV
    rungs = advise(None, VLLMConfig("m"), memory, tier_bytes=sized("20gib").bytes, peak_bytes=int(22.5 * GIB))
    # outside = 22.5 - 21.67 = 0.83; (20 - 0.83) / 23.55 - 0.01 = 0.804 -> 0.8; 0.8 * 23.55 - 16.36 = 2.48 for KV
    assert rungs == [
        "peak 22.50 GiB exceeds the 20gib tier by 2.50 GiB: gpu_memory_utilization default 0.92 -> 0.8 "
        "(a 18.84 GiB budget of the 23.55 GiB device, plus the 0.83 GiB vLLM used outside its budget, "
        "fits the tier; 2.48 GiB of it stays for the KV cache)"
    ]
    too_small = advise(None, VLLMConfig("m"), memory, tier_bytes=sized("16gib").bytes, peak_bytes=int(22.5 * GIB))
    assert too_small[0].endswith(
        "(weights, activations and graphs alone take 16.36 GiB, and vLLM used 0.83 GiB "
        "outside its budget): use a quantized model or a larger tier"
    )
