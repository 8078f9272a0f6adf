"""Llama-2-7B-chat serving on 8, 16 and 24 GB cards: each rung of the memory ladder starts, survives concurrent load,
and stays inside its tier; a known-bad config fails for the right reason.

    pytest example_suite --vllm-gpu=24gb                              # on a GPU runner
    pytest example_suite --vllm-gpu=8gb --vllm-model-override=tiny    # on a CPU, with the built-in tiny model
"""

from __future__ import annotations

import pytest
from conftest import LARGE_CARD_CONFIGS, SMALL_CARD_CONFIGS

from pytest_vllm_mem import VLLMStartupError


@pytest.mark.vllm_tier("8gb", max="8gb")
@pytest.mark.parametrize("vllm_config", SMALL_CARD_CONFIGS)
def test_8gb_strategy_serves(vllm_server, vllm_load):
    result = vllm_load(num_prompts=64, concurrency=8, max_tokens=64)
    assert result.ok, result.errors


@pytest.mark.vllm_tier("16gb", max="16gb")
@pytest.mark.parametrize("vllm_config", SMALL_CARD_CONFIGS)
def test_16gb_strategy_serves(vllm_server, vllm_load):
    result = vllm_load(num_prompts=100, concurrency=16, max_tokens=100)
    assert result.ok, result.errors


@pytest.mark.vllm_tier("24gb")
@pytest.mark.parametrize("vllm_config", LARGE_CARD_CONFIGS)
def test_24gb_strategy_serves(vllm_server, vllm_load):
    result = vllm_load(num_prompts=100, concurrency=16, max_tokens=100)
    assert result.ok, result.errors


@pytest.mark.vllm_tier("8gb", max="8gb")
@pytest.mark.parametrize("vllm_config", SMALL_CARD_CONFIGS[-1:])
def test_8gb_concurrency_200_prompts(vllm_server, vllm_load):
    """The combined config under the load that breaks naive setups: 200 prompts, 16 at a time."""
    result = vllm_load(num_prompts=200, concurrency=16, max_tokens=100)
    assert result.ok, result.errors
    assert result.completed == 200


@pytest.mark.vllm_tier("24gb")
@pytest.mark.parametrize("vllm_config", LARGE_CARD_CONFIGS[-1:])
def test_24gb_concurrency_200_prompts(vllm_server, vllm_load):
    result = vllm_load(num_prompts=200, concurrency=16, max_tokens=100)
    assert result.ok, result.errors


def test_known_bad_config_fails_for_kv_cache(vllm_start, known_bad_config):
    """The config people try first after an OOM: too little KV cache for the context length. It must keep failing
    for that reason (and not, after an upgrade, for another one)."""
    with pytest.raises(VLLMStartupError) as error:
        vllm_start(known_bad_config)
    assert error.value.kind == "kv_cache_insufficient", str(error.value)
