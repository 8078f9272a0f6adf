"""What a user's repository holds: the configs under test, one place.

The seed scenario is Llama-2-7B-chat on 8, 16 and 24 GB cards with the usual ladder of fixes:
  A: lower --gpu-memory-utilization (0.7)     B: cap --max-model-len (2048)
  C: --enforce-eager (no CUDA graph pool)     D: all three combined (0.75 + 4096 + eager)
fp16 weights of a 7B model take 12.6 GiB, so on 8 and 16 GB cards the 4-bit AWQ build is what people deploy.

Without a GPU, `--vllm-model-override=tiny` serves every config with the plugin's built-in tiny model on the CPU:
the flags, tiers, fixtures and reports are exercised for real, the absolute figures are the tiny model's.
"""

from __future__ import annotations

import pytest

from pytest_vllm_mem import VLLMConfig

LLAMA2_7B = "meta-llama/Llama-2-7b-chat-hf"
LLAMA2_7B_AWQ = "TheBloke/Llama-2-7B-Chat-AWQ"


def strategies(model: str, **common) -> list:
    """The four rungs of the ladder for one model, as pytest params with readable ids. B and C keep 0.8 rather than
    the 0.9/0.92 default: the default leaves under 1 GB of an 8 GB card to everything outside vLLM's budget."""
    return [
        pytest.param(VLLMConfig(model, gpu_memory_utilization=0.7, **common), id="A-util0.7"),
        pytest.param(VLLMConfig(model, gpu_memory_utilization=0.8, max_model_len=2048, **common), id="B-len2048"),
        pytest.param(VLLMConfig(model, gpu_memory_utilization=0.8, enforce_eager=True, **common), id="C-eager"),
        pytest.param(
            VLLMConfig(model, gpu_memory_utilization=0.75, max_model_len=4096, enforce_eager=True, **common),
            id="D-combined",
        ),
    ]


# 4-bit weights (3.9 GB) leave room for a KV cache on 8 and 16 GB cards.
SMALL_CARD_CONFIGS = strategies(LLAMA2_7B_AWQ, quantization="awq", max_num_seqs=64)
# fp16 weights (13.5 GB) on a 24 GB card.
LARGE_CARD_CONFIGS = strategies(LLAMA2_7B)


@pytest.fixture
def known_bad_config(pytestconfig: pytest.Config) -> VLLMConfig:
    """A config whose KV cache cannot hold one sequence of max_model_len tokens.

    On a 24 GB card, 0.65 of the memory minus 12.6 GiB of fp16 weights and the activation peak leaves about 1 GiB
    of KV cache, while one 4,096-token sequence of Llama-2-7B needs 2 GiB (512 KiB per token: 32 layers x K and V
    x 4,096 hidden x 2 bytes). The tiny model needs about 1 KiB per token, so no utilization starves it: its
    stand-in caps the KV cache at 16 MB (~15,000 tokens) under a 32,768-token max_model_len.
    """
    if pytestconfig.getoption("vllm_model_override") == "tiny":
        return VLLMConfig("tiny", kv_cache_memory_bytes=16_000_000, max_model_len=32768)
    return VLLMConfig(LLAMA2_7B, gpu_memory_utilization=0.65, max_model_len=4096)
