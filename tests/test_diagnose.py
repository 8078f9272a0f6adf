from __future__ import annotations

from pathlib import Path

import pytest

from pytest_vllm_mem.diagnose import (
    FAILURE_KINDS,
    Diagnosis,
    StartupMemory,
    classify_failure,
    find_memory_error,
    parse_startup_memory,
    rejected_flags,
    strip_ansi,
    strip_log_prefix,
    timeout_diagnosis,
)

LOGS = Path(__file__).parent / "data" / "logs"


def log(name: str) -> str:
    return (LOGS / name).read_text(encoding="utf-8")


# --- prefixes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        ("(EngineCore pid=10464) ERROR 11-30 04:55:40 [core.py:1510] EngineCore failed to start.",
         "EngineCore failed to start."),
        ("(Worker_TP1 pid=77) INFO 11-30 04:56:05 [gpu_worker.py:760] Available KV cache memory: 6.42 GiB",
         "Available KV cache memory: 6.42 GiB"),
        ("(VllmWorker-0 pid=10476) WARNING 11-30 04:55:33 [vllm.py:725] Model Runner V2 requires Triton; using the "
         "V1 model runner instead.", "Model Runner V2 requires Triton; using the V1 model runner instead."),
        ("\x1b[1;36m(VllmWorker rank=0 pid=123)\x1b[0;0m INFO 08-12 10:01:02 [gpu_model_runner.py:1953] Model "
         "loading took 14.9595 GiB and 4.390297 seconds", "Model loading took 14.9595 GiB and 4.390297 seconds"),
        ("\x1b[1;36m(EngineCore_0 pid=120)\x1b[0;0m INFO 08-12 10:01:02 [kv_cache_utils.py:849] GPU KV cache size: "
         "13,136 tokens", "GPU KV cache size: 13,136 tokens"),
        ("INFO 11-30 04:56:05 [core.py:402] init engine (profile, create kv cache, warmup model) took 5.17 s",
         "init engine (profile, create kv cache, warmup model) took 5.17 s"),
        ("INFO:     Application startup complete.", "Application startup complete."),
        ("RuntimeError: Engine core initialization failed.", "RuntimeError: Engine core initialization failed."),
        # traceback indentation inside an ERROR record is part of the message
        ('(Worker pid=1) ERROR 11-30 04:55:40 [multiproc_executor.py:1063]   File "x.py", line 3, in f',
         '  File "x.py", line 3, in f'),
        ("(APIServer pid=10452) INFO 11-30 04:55:23 [api_utils.py:347] ", ""),
    ],
)
def test_strip_log_prefix(line: str, message: str) -> None:
    assert strip_log_prefix(line) == message


def test_strip_ansi_removes_color_codes_only() -> None:
    assert strip_ansi("\x1b[1;36m(APIServer pid=7)\x1b[0;0m hello \x1b[32mok\x1b[0m") == "(APIServer pid=7) hello ok"


# --- startup figures --------------------------------------------------------------------------------------------


def test_parse_startup_memory_cpu_032_auto_sized_kv_cache() -> None:
    memory = parse_startup_memory(log("cpu-0.32-started.log"))
    assert memory == StartupMemory(
        vllm_version="0.32.0", kv_cache_gib=0.21, kv_cache_tokens=108_160, max_concurrency=52.81,
        max_concurrency_tokens=2048, engine_init_s=5.17, non_kv_gib=0.84, requested_gib=1.05, device_total_gib=10.46,
    )


def test_parse_startup_memory_cpu_032_explicit_kv_cache() -> None:
    text = (
        "(Worker pid=10849) INFO 11-30 04:59:03 [cpu_worker.py:260] Explicitly set (1.0/10.46) GiB for KV cache on "
        "node 0.\n"
        "(EngineCore pid=10833) INFO 11-30 04:59:03 [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, "
        "Maximum concurrency for 512 tokens per request: 1024.00x\n"
        "(EngineCore pid=10833) INFO 11-30 04:59:05 [core.py:402] init engine (profile, create kv cache, warmup "
        "model) took 6.96 s\n"
    )
    memory = parse_startup_memory(text)
    assert (memory.kv_cache_gib, memory.device_total_gib, memory.requested_gib) == (1.0, 10.46, None)
    assert (memory.kv_cache_tokens, memory.max_concurrency_tokens, memory.max_concurrency) == (524_288, 512, 1024.0)
    assert memory.engine_init_s == 6.96


def test_parse_startup_memory_gpu_03x_one_line_kv_and_concurrency() -> None:
    memory = parse_startup_memory(log("gpu-0.33-started.log"))
    assert memory.vllm_version == "0.33.0"
    assert (memory.weights_gib, memory.weights_load_s) == (14.25, 5.812345)
    assert (memory.kv_cache_gib, memory.kv_cache_tokens) == (4.46, 83_520)
    assert (memory.max_concurrency_tokens, memory.max_concurrency) == (32_768, 2.55)
    assert (memory.graph_capture_s, memory.graph_capture_gib) == (14.0, 0.53)
    assert memory.engine_init_s == 29.87  # "took 29.87 s (compilation: 10.21 s)"
    assert memory.device_total_gib is None and memory.non_kv_gib is None


def test_parse_startup_memory_gpu_010_ansi_two_lines_and_seconds() -> None:
    memory = parse_startup_memory(log("gpu-0.10-started.log"))
    assert memory.vllm_version == "0.10.2"
    assert (memory.weights_gib, memory.weights_load_s) == (14.9595, 4.390297)
    assert (memory.kv_cache_gib, memory.kv_cache_tokens) == (6.42, 13_136)
    assert (memory.max_concurrency_tokens, memory.max_concurrency) == (4096, 3.21)
    assert (memory.graph_capture_s, memory.graph_capture_gib) == (12.0, 1.6)
    assert memory.engine_init_s == 35.21


def test_parse_startup_memory_keeps_a_negative_kv_pool() -> None:
    assert parse_startup_memory(log("gpu-0.10-no-cache-blocks.log")).kv_cache_gib == -1.25


def test_parse_startup_memory_version_from_banner_when_engine_line_missing() -> None:
    assert parse_startup_memory(log("cpu-0.32-validation-error.log")).vllm_version == "0.32.0"


def test_parse_startup_memory_ignores_flag_echoes() -> None:
    # "version" in a deprecation warning is not a version; an empty log has nothing.
    text = "api_server.py:24: DeprecationWarning: will likely be unsupported in a future version. Use the launcher\n"
    assert parse_startup_memory(text) == StartupMemory()
    assert parse_startup_memory("") == StartupMemory()


def test_startup_memory_to_dict_has_every_field() -> None:
    as_dict = parse_startup_memory(log("cpu-0.32-started.log")).to_dict()
    assert as_dict["kv_cache_tokens"] == 108_160 and as_dict["weights_gib"] is None
    assert set(as_dict) == {f for f in StartupMemory.__dataclass_fields__}


# --- classify_failure ---------------------------------------------------------------------------------------------


def test_cpu_host_memory_real_log_root_cause_is_the_valueerror_once() -> None:
    diagnosis = classify_failure(log("cpu-0.32-host-memory.log"), 1)
    assert diagnosis.kind == "host_memory"
    # The ValueError is printed 3 times and quoted by a RuntimeError: one root cause line, never the generic one.
    assert diagnosis.root_cause == (
        "ValueError: Available memory on node 0 (9.06/10.46 GiB) on kv cache allocation is less than requested "
        "memory for kv (-0.62/0.21 GiB). Reduce CPU memory used by other processes.",
    )
    assert diagnosis.figures == {"available_gib": 9.06, "device_total_gib": 10.46, "kv_requested_gib": -0.62,
                                 "requested_gib": 0.21, "non_kv_gib": 0.83, "returncode": 1.0}
    assert "0.83 GiB already in use" in diagnosis.summary


def test_cpu_host_memory_explicit_kv_size() -> None:
    text = ("(Worker pid=1) ERROR 11-30 04:55:40 [multiproc_executor.py:1063] ValueError: Available memory on node 0 "
            "(0.5/10.46 GiB) on kv cache allocation is less than requested memory for kv (4.0 GiB). Decrease "
            "--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.\n")
    diagnosis = classify_failure(text, 1)
    assert diagnosis.kind == "host_memory"
    assert diagnosis.figures == {"available_gib": 0.5, "device_total_gib": 10.46, "kv_requested_gib": 4.0,
                                 "returncode": 1.0}


@pytest.mark.parametrize("message", [
    "RuntimeError: [enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)",
    "terminate called after throwing an instance of 'std::bad_alloc'",
    "MemoryError",
    "OSError: [Errno 12] Cannot allocate memory",
])
def test_host_memory_generic_messages(message: str) -> None:
    diagnosis = classify_failure(f"(Worker pid=3) INFO 11-30 04:55:33 [x.py:1] loading\n{message}\n", -6)
    assert diagnosis.kind == "host_memory"
    assert diagnosis.root_cause == (message,)
    assert diagnosis.summary == "the host ran out of memory (RAM, not device memory)"


def test_cpu_kv_cache_insufficient_real_log() -> None:
    diagnosis = classify_failure(log("cpu-0.32-kv-cache-insufficient.log"), 1)
    assert diagnosis.kind == "kv_cache_insufficient"
    assert diagnosis.figures == {"max_model_len": 32768.0, "needed_gib": 0.06, "available_gib": 0.01,
                                 "estimated_max_model_len": 7680.0, "returncode": 1.0}
    assert len(diagnosis.root_cause) == 1 and diagnosis.root_cause[0].startswith("ValueError: To serve at least")
    assert diagnosis.summary == ("the KV cache (0.01 GiB) cannot hold one 32,768-token sequence (needs 0.06 GiB); "
                                 "vLLM estimates a maximum model length of 7,680")


def test_gpu_010_kv_cache_insufficient_old_wording() -> None:
    diagnosis = classify_failure(log("gpu-0.10-kv-cache-insufficient.log"), 1)
    assert diagnosis.kind == "kv_cache_insufficient"
    assert diagnosis.figures["max_model_len"] == 131072
    assert diagnosis.figures["estimated_max_model_len"] == 52576
    assert (diagnosis.figures["needed_gib"], diagnosis.figures["available_gib"]) == (16.0, 6.42)


def test_no_available_memory_for_cache_blocks_takes_the_pool_from_the_log() -> None:
    diagnosis = classify_failure(log("gpu-0.10-no-cache-blocks.log"), 1)
    assert diagnosis.kind == "kv_cache_insufficient"
    assert diagnosis.figures["available_gib"] == -1.25
    assert "no memory was left for the KV cache (-1.25 GiB)" in diagnosis.summary


def test_cuda_oom_while_profiling() -> None:
    diagnosis = classify_failure(log("gpu-0.33-oom-profiling.log"), 1)
    assert diagnosis.kind == "cuda_oom"
    assert diagnosis.summary == "vLLM ran out of device memory while profiling (tried to allocate 512.00 MiB)"
    assert diagnosis.figures == {"tried_allocate_gib": 0.5, "device_total_gib": 23.55, "free_gib": 0.2944,
                                 "process_used_gib": 23.24, "returncode": 1.0}
    # The worker's torch error once; the EngineCore's "Worker failed with error '...'" re-raise is dropped.
    assert len(diagnosis.root_cause) == 1 and diagnosis.root_cause[0].startswith("torch.OutOfMemoryError: CUDA out")


def test_cuda_error_out_of_memory_during_graph_capture() -> None:
    diagnosis = classify_failure(log("gpu-0.10-graph-capture-oom.log"), 1)
    assert diagnosis.kind == "cuda_oom"
    assert diagnosis.summary == "vLLM ran out of device memory while capturing CUDA graphs"
    assert diagnosis.root_cause == ("RuntimeError: CUDA error: out of memory",)


def test_failed_to_load_model_is_weights_too_large() -> None:
    diagnosis = classify_failure(log("gpu-0.33-weights-oom.log"), 1)
    assert diagnosis.kind == "weights_too_large"
    assert diagnosis.root_cause[0].startswith("Failed to load model - not enough GPU memory.")
    assert diagnosis.figures["process_used_gib"] == 23.1 and diagnosis.figures["device_total_gib"] == 23.55
    assert diagnosis.summary == "the model weights do not fit in device memory: 23.10 of 23.55 GiB in use"


def test_cuda_oom_before_model_loading_took_is_weights_too_large() -> None:
    # vLLM 0.10 printed no "Failed to load model" line: the OOM before "Model loading took" decides.
    diagnosis = classify_failure(log("gpu-0.10-load-oom.log"), 1)
    assert diagnosis.kind == "weights_too_large"
    assert diagnosis.figures["tried_allocate_gib"] == pytest.approx(1002 / 1024, abs=1e-4)


def test_insufficient_free_memory_figures() -> None:
    diagnosis = classify_failure(log("gpu-0.33-free-memory.log"), 1)
    assert diagnosis.kind == "insufficient_free_memory"
    assert diagnosis.figures == {"free_gib": 12.18, "device_total_gib": 23.56, "gpu_memory_utilization": 0.92,
                                 "requested_gib": 21.68, "returncode": 1.0}
    assert diagnosis.summary == ("only 12.18 of 23.56 GiB were free on cuda:0 at startup, but gpu_memory_utilization "
                                 "0.92 asks for 21.68 GiB")


def test_insufficient_free_memory_010_wording_without_device_name() -> None:
    text = ("\x1b[1;36m(VllmWorker rank=0 pid=9)\x1b[0;0m ERROR 08-12 10:00:00 [multiproc_executor.py:559] "
            "ValueError: Free memory on device (5.31/23.56 GiB) on startup is less than desired GPU memory "
            "utilization (0.8, 18.85 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
            "processes.\n")
    diagnosis = classify_failure(text, 1)
    assert diagnosis.kind == "insufficient_free_memory"
    assert (diagnosis.figures["free_gib"], diagnosis.figures["requested_gib"]) == (5.31, 18.85)
    assert "free on the device at startup" in diagnosis.summary


@pytest.mark.parametrize("line, flags, summary", [
    ("api_server.py: error: unrecognized arguments: --swap-space", ("--swap-space",),
     "the installed vLLM does not accept --swap-space"),
    ("vllm serve: error: unrecognized arguments: --swap-space 4 --foo", ("--swap-space", "--foo"),
     "the installed vLLM does not accept --swap-space, --foo"),
    ("api_server.py: error: argument --gpu-memory-utilization/--device-memory-utilization: invalid float value: "
     "'abc'", ("--gpu-memory-utilization",),
     "the installed vLLM rejected the value of --gpu-memory-utilization: invalid float value: 'abc'"),
    ("api_server.py: error: argument --dtype: invalid choice: 'foo' (choose from 'auto', 'bfloat16')", ("--dtype",),
     "the installed vLLM rejected the value of --dtype: invalid choice: 'foo' (choose from 'auto', 'bfloat16')"),
    ("api_server.py: error: argument --max-model-len: expected one argument", ("--max-model-len",),
     "the installed vLLM rejected the value of --max-model-len: expected one argument"),
])
def test_argparse_errors_are_bad_flag(line: str, flags: tuple[str, ...], summary: str) -> None:
    text = "usage: api_server.py [-h] [--model MODEL]\n                     [model_tag]\n" + line + "\n"
    diagnosis = classify_failure(text, 2)
    assert diagnosis.kind == "bad_flag"
    assert diagnosis.summary == summary
    assert diagnosis.root_cause == (line,)
    assert rejected_flags(diagnosis) == flags


def test_pydantic_validation_error_is_bad_flag_real_log() -> None:
    diagnosis = classify_failure(log("cpu-0.32-validation-error.log"), 1)
    assert diagnosis.kind == "bad_flag"
    assert diagnosis.summary == ("the installed vLLM rejected gpu_memory_utilization=1.5: Input should be less than "
                                 "or equal to 1")
    assert rejected_flags(diagnosis) == ("gpu_memory_utilization",)


def test_pydantic_model_level_error_names_no_field() -> None:
    text = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
            "  Value error, User-specified max_model_len (999999) is greater than the derived max_model_len "
            "(max_position_embeddings=32768 in model's config.json). [type=value_error, input_value=ArgsKwargs((), "
            "{'model': 'm'}), input_type=ArgsKwargs]\n")
    diagnosis = classify_failure(text, 1)
    assert diagnosis.kind == "bad_flag"
    assert "User-specified max_model_len (999999)" in diagnosis.summary
    assert rejected_flags(diagnosis) == ()


def test_flag_echoes_and_warnings_are_not_causes() -> None:
    # INFO/WARNING lines mention flags and OOM; only error lines count.
    text = (
        "(APIServer pid=1) INFO 11-30 04:55:23 [api_utils.py:286] non-default args: {'swap_space': 4} (an old "
        "vLLM said: error: unrecognized arguments: --x)\n"
        "(Worker pid=2) WARNING 11-30 04:55:33 [gpu_worker.py:800] ... may require lowering --gpu-memory-utilization "
        "to avoid OOM; CUDA out of memory was seen before\n"
        "(APIServer pid=1) WARNING 11-30 04:55:23 [system_utils.py:255] This can cause fd limit errors like "
        "`OSError: [Errno 24] Too many open files`.\n"
    )
    diagnosis = classify_failure(text, 1)
    assert diagnosis.kind == "crash"
    assert find_memory_error(text) is None


def test_crash_quotes_the_earliest_specific_error_not_the_generic_one() -> None:
    diagnosis = classify_failure(log("cpu-0.32-bad-model-crash.log"), 1)
    assert diagnosis.kind == "crash"
    assert diagnosis.root_cause[0].startswith("huggingface_hub.errors.HFValidationError: Repo id must use")
    # The chained OSError says the same thing: deduplicated.
    assert len(diagnosis.root_cause) == 1
    assert diagnosis.summary.startswith("vLLM exited with code 1 before it became healthy")
    assert diagnosis.figures == {"returncode": 1.0}
    assert not any("Engine core initialization failed" in line for line in diagnosis.root_cause)


def test_crash_skips_the_generic_engine_failure_line() -> None:
    text = ("(EngineCore pid=1) ERROR 11-30 04:55:40 [core.py:1510] EngineCore failed to start.\n"
            "(EngineCore pid=1) ERROR 11-30 04:55:40 [core.py:1510] ImportError: libcuda.so.1: cannot open shared "
            "object file\n"
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "
            "{'EngineCore': 1}\n")
    diagnosis = classify_failure(text, 1)
    assert diagnosis.kind == "crash"
    assert diagnosis.root_cause == ("ImportError: libcuda.so.1: cannot open shared object file",)


def test_crash_without_any_error_quotes_the_last_lines() -> None:
    diagnosis = classify_failure(log("cpu-0.32-started.log"), -15)
    assert diagnosis.kind == "crash"
    assert diagnosis.summary.startswith("vLLM was killed by SIGTERM before it became healthy")
    assert diagnosis.root_cause[-1] == "Application shutdown complete."
    assert not any(line.startswith(("nanobind", "- leaked")) for line in diagnosis.root_cause)


def test_sigkill_without_error_points_at_the_oom_killer() -> None:
    text = "(Worker pid=3) INFO 11-30 04:55:33 [cpu_model_runner.py:68] Starting to load model tiny-model...\n"
    diagnosis = classify_failure(text, -9)
    assert diagnosis.kind == "crash"
    assert "SIGKILL" in diagnosis.summary and "OOM killer" in diagnosis.summary
    assert "while loading the weights" in diagnosis.summary
    assert diagnosis.figures == {"returncode": -9.0}


def test_returncode_none_and_empty_log() -> None:
    diagnosis = classify_failure("", None)
    assert diagnosis.kind == "crash"
    assert diagnosis.root_cause == () and diagnosis.figures == {}
    assert diagnosis.summary.startswith("vLLM stopped before it became healthy")


def test_every_kind_is_a_failure_kind() -> None:
    names = ["cpu-0.32-host-memory.log", "cpu-0.32-kv-cache-insufficient.log", "cpu-0.32-validation-error.log",
             "cpu-0.32-bad-model-crash.log", "gpu-0.33-oom-profiling.log", "gpu-0.33-weights-oom.log",
             "gpu-0.33-free-memory.log"]
    kinds = {classify_failure(log(name), 1).kind for name in names}
    kinds.add(timeout_diagnosis("", 1).kind)
    assert kinds == set(FAILURE_KINDS)  # every kind is reachable from a real or source-built log


# --- find_memory_error / timeout ----------------------------------------------------------------------------------


def test_find_memory_error_none_for_a_healthy_server() -> None:
    assert find_memory_error(log("cpu-0.32-started.log")) is None
    assert find_memory_error(log("gpu-0.33-started.log")) is None


def test_find_memory_error_runtime_oom_while_serving() -> None:
    text = log("gpu-0.33-started.log") + (
        "(EngineCore pid=4301) ERROR 11-30 04:50:00 [core.py:900] EngineCore encountered a fatal error.\n"
        "(EngineCore pid=4301) ERROR 11-30 04:50:00 [core.py:900] torch.OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.55 GiB of which 1.02 GiB is free.\n"
        "(APIServer pid=4242) ERROR 11-30 04:50:00 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n"
    )
    diagnosis = find_memory_error(text)
    assert diagnosis is not None and diagnosis.kind == "cuda_oom"
    assert diagnosis.summary == "vLLM ran out of device memory while serving requests (tried to allocate 2.00 GiB)"
    assert diagnosis.figures["free_gib"] == 1.02


def test_find_memory_error_host_memory() -> None:
    diagnosis = find_memory_error(log("cpu-0.32-host-memory.log"))
    assert diagnosis is not None and diagnosis.kind == "host_memory"


def test_timeout_diagnosis_reports_stage_and_last_lines() -> None:
    text = log("gpu-0.33-started.log").split("(Worker pid=4320) INFO 11-30 04:48:25")[0]
    diagnosis = timeout_diagnosis(text, 240)
    assert diagnosis.kind == "timeout"
    assert diagnosis.summary == "vLLM did not become healthy within 240 s (last stage reached: capturing CUDA graphs)"
    assert diagnosis.figures == {"timeout_s": 240.0}
    assert diagnosis.root_cause[-1].startswith("GPU KV cache size: 83,520 tokens")  # the bar after it is noise
    assert not any("it/s]" in line for line in diagnosis.root_cause)  # progress bars are not news
    assert len(diagnosis.root_cause) <= 5


def test_diagnosis_to_dict() -> None:
    diagnosis = Diagnosis("crash", "x", ("a",), {"returncode": 1.0})
    assert diagnosis.to_dict() == {"kind": "crash", "summary": "x", "root_cause": ["a"], "figures": {"returncode": 1.0}}


def test_cuda_oom_after_the_pool_was_sized_is_kv_allocation() -> None:
    text = ("(Worker_TP1 pid=8) INFO 11-30 04:48:10 [gpu_worker.py:760] Model loading took 7.10 GiB memory and 3.2 "
            "seconds\n"
            "(Worker_TP1 pid=8) INFO 11-30 04:48:10 [gpu_worker.py:760] Available KV cache memory: 9.00 GiB\n"
            "(Worker_TP1 pid=8) ERROR 11-30 04:48:11 [multiproc_executor.py:1063] torch.OutOfMemoryError: CUDA out of "
            "memory. Tried to allocate 4.50 GiB. GPU 1 has a total capacity of 23.55 GiB of which 2.01 GiB is free.\n")
    diagnosis = classify_failure(text, 1)
    assert diagnosis.kind == "cuda_oom"
    assert diagnosis.summary == ("vLLM ran out of device memory while allocating the KV cache (tried to allocate "
                                 "4.50 GiB)")


def test_ray_worker_prefix_with_ip() -> None:
    assert strip_log_prefix("(RayWorkerWrapper pid=5, ip=10.0.0.1) INFO 08-12 10:00:00 [x.py:1] hello") == "hello"
