"""vLLM's V0 engine sorts the logits in its profile run too (memory_plan.v0_engine): `worker/model_runner.py`
`profile_run` samples its max_num_seqs dummy sequences with top_k = vocab_size - 1 and top_p = 0.99, and V0's
Sampler sorts the float32 logits over the whole vocabulary. V0 is every release before 0.8, and 0.8-0.9 on cards
below compute capability 8.0 or with VLLM_USE_V1=0. Checked on the fit-split rows of issue 24's fourth collection
(benchmarks/data/gpu_startups.json): a T4 on 0.8.2 and two RTX 4090 on 0.7.2, planned 5.8% and 10.1% over before."""

from __future__ import annotations

from typing import Any

import pytest
from gpu_startups import model

from pytest_vllm_mem.plan.memory_plan import (
    GIB,
    NATIVE_SORT_BYTES_PER_LOGIT,
    Card,
    gpu_activation,
    plan,
    pre_ampere,
    profile_sampler_path,
    v0_engine,
)


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ("Tesla T4", True),
        ("Tesla V100-SXM2-32GB", True),
        ("NVIDIA GeForce RTX 2080 Ti", True),
        ("Quadro RTX 6000", True),
        ("RTX 4090", False),
        ("RTX 3090", False),
        ("L4", False),
        ("A10G", False),
        ("H100 80GB", False),
        ("RTX PRO 6000 Blackwell Max-Q", False),
    ],
)
def test_cards_below_compute_capability_8_are_told_by_name(card: str, expected: bool) -> None:
    assert pre_ampere(card) is expected


@pytest.mark.parametrize(
    ("version", "env", "card", "expected"),
    [
        ("0.6.5", {}, "H100 80GB", True),  # before 0.8 every release is V0
        ("0.7.2", {}, "RTX 4090", True),
        ("0.8.2", {}, "Tesla T4", True),  # "Compute Capability < 8.0 is not supported by the V1 Engine"
        ("0.9.2", {"VLLM_USE_V1": "0"}, "H100 80GB", True),
        ("0.8.2", {}, "RTX 4090", False),
        ("0.10.1", {}, "Tesla T4", False),  # 0.10 removed V0
        (None, {}, "Tesla T4", False),
    ],
)
def test_the_v0_engine_follows_the_release_the_card_and_vllm_use_v1(
    version: str | None, env: dict[str, str], card: str, expected: bool
) -> None:
    assert v0_engine(version, env, card) is expected


def test_v0_profiles_the_native_sort_and_v1_before_0_10_keeps_the_forward_term() -> None:
    assert profile_sampler_path("0.7.2", {}) == "native"
    assert profile_sampler_path("0.8.2", {}, "Tesla T4") == "native"
    assert profile_sampler_path("0.8.2", {}, "A100 80GB") == "no_sort"


def test_the_t4_startup_of_the_hugging_face_cookbook_profiles_the_sort() -> None:
    # huggingface/cookbook fine_tune_chatbot_docs_synthetic.ipynb: Llama-3.2-3B-Instruct on a Colab T4, vLLM 0.8.2
    # (V0 fallback), 192 sequences, 2048 batched tokens: 'PyTorch activation peak memory takes 0.90GiB', 'KV Cache is
    # 6.22GiB', 3637 blocks. The forward-pass term alone planned 0.31 GiB and 6.58 GiB of KV.
    llama = model("meta-llama/Llama-3.2-3B-Instruct")
    args: dict[str, Any] = {"tp": 1, "dtype": 2, "batched_tokens": 2048, "max_num_seqs": 192}
    peak = gpu_activation(llama, vllm_version="0.8.2", card_name="Tesla T4", **args)
    assert peak.value == 192 * 128256 * NATIVE_SORT_BYTES_PER_LOGIT
    assert peak.value / GIB == pytest.approx(0.90, rel=0.05)
    assert gpu_activation(llama, vllm_version="0.8.2", card_name="A100 80GB", **args).value < peak.value / 2
    flags = {
        "gpu_memory_utilization": 0.8938626454842437,
        "max_model_len": 2048,
        "max_num_seqs": 192,
        "max_num_batched_tokens": 2048,
        "dtype": "float16",
    }
    predicted = plan(llama, flags, Card("cuda", "Tesla T4", int(14.74 * GIB), nvlink=False), vllm_version="0.8.2")
    assert predicted.kv_tokens.value == pytest.approx(58192, rel=0.05)


def test_two_rtx_4090_on_v0_are_planned_as_short_of_the_models_length_as_the_driver_worker_was() -> None:
    # vllm#13061: DeepSeek-R1-Distill-Qwen-14B, TP 2 on two RTX 4090, vLLM 0.7.2, utilization 0.98, the model's
    # 131072 tokens: the engine took 81,536 tokens from the worker that samples (the other logged 8.69 GiB, 94,920).
    predicted = plan(
        model("deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"),
        {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.98},
        Card("cuda", "RTX 4090", int(23.55 * GIB), nvlink=False),
        vllm_version="0.7.2",
    )
    assert predicted.verdict == "kv_cache_insufficient"
    assert predicted.kv_tokens.value == pytest.approx(81536, rel=0.05)
