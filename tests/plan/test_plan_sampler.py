"""The profile run's dummy sampler pass on vLLM 0.10-0.16 (memory_plan.profile_sampler_path) and the mxfp4 MoE backend by card, both
read from vLLM's wheels and checked against public startup logs (benchmarks/data/gpu_startups.json). Before them the
plan added a fitted 3.3 GiB to every 0.10-0.16 text model and a 7.2 GiB mxfp4 workspace on every card: A100 rows of
vLLM 0.10.1 were planned 14-70% short of the KV cache they logged."""

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
    pre_hopper,
    profile_sampler_path,
)

A100 = Card("cuda", "A100 80GB", int(79.25 * GIB))
FLASHINFER = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}


@pytest.mark.parametrize(
    ("version", "env", "path"),
    [
        ("0.11.2", {}, "native"),  # FlashInfer opt-in from 0.11.1: the sort runs by default
        ("0.16.0", {}, "native"),
        ("0.16.0", FLASHINFER, "no_sort"),
        ("0.11.0", {}, "flashinfer_or_native"),  # FlashInfer by default when installed (an optional extra)
        ("0.10.1", {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, "native"),
        ("0.17.0", {}, "no_sort"),  # Triton top-k/top-p from 0.17.0
        ("0.19.0", {}, "no_sort"),
    ],
)
def test_the_sampler_kernel_of_the_profile_run_follows_the_release_and_the_flashinfer_switch(
    version: str, env: dict[str, str], path: str
) -> None:
    assert profile_sampler_path(version, env) == path


def test_the_native_sort_sets_the_activation_peak_of_a_small_model_as_vllm_0_11_logged_it() -> None:
    # llm-d-planner's vLLM 0.11 log on an H100 (8192 batched tokens, 1024 sequences): 5.56 GiB peak activation for
    # Qwen3-0.6B, whose forward pass and float32 logits the plan sizes at about 1.4 GiB.
    qwen = model("Qwen/Qwen3-0.6B")
    args: dict[str, Any] = {"tp": 1, "dtype": 2, "batched_tokens": 8192, "max_num_seqs": 1024}
    sorted_run = gpu_activation(qwen, vllm_version="0.11.2", **args)
    assert sorted_run.value == 1024 * 151936 * NATIVE_SORT_BYTES_PER_LOGIT
    assert sorted_run.value / GIB == pytest.approx(5.56, rel=0.02)
    # 0.17 samples without the sort (Triton top-k/top-p): 14 bytes per logit and the hidden states (profile_peak.py);
    # Qwen3-14B logged 2.23 GiB there (planner sweep, v0.17.0), 5.64 with the sort on v0.16.0.
    no_sort = gpu_activation(qwen, vllm_version="0.17.0", **args)
    assert no_sort.value == 1024 * 151936 * 14 + 8192 * 1024 * 4
    assert no_sort.value < sorted_run.value / 2
    flashinfer = gpu_activation(qwen, vllm_version="0.16.0", env=FLASHINFER, **args)
    assert flashinfer.value < sorted_run.value / 3


def test_a_flashinfer_sampled_startup_on_vllm_0_10_is_planned_without_the_sort() -> None:
    # dennislee22/vLLM-benchmarking, log/vllm-7B-1gpuA10080GB-0.25GRAM.log: Qwen2-7B-Instruct on an A100 80GB, vLLM
    # 0.10.1.1, utilization 0.25, 'Using FlashInfer for top-p & top-k sampling', 'Available KV cache memory: 5.01
    # GiB'. The fitted 3.3 GiB of the old rule planned 1.52 GiB.
    predicted = plan(
        model("Qwen/Qwen2-7B-Instruct"),
        {"gpu_memory_utilization": 0.25, "max_model_len": 16384},
        A100,
        env=FLASHINFER,
        vllm_version="0.10.1",
    )
    assert predicted.kv_bytes.value / GIB == pytest.approx(5.01, rel=0.05)


def test_mxfp4_moe_holds_the_triton_workspace_on_hopper_only() -> None:
    # vLLM 0.10.1/0.11.0 pick the Marlin MoE backend before compute capability 9.0 (the gpt-oss-120b A100 log says
    # 'Weight-only FP4 compression will be used leveraging the Marlin kernel'); the 7.2 GiB workspace was measured on
    # H100s, on the Triton backend.
    gpt = model("openai/gpt-oss-120b")
    args: dict[str, Any] = {"tp": 4, "dtype": 2, "batched_tokens": 2048, "max_num_seqs": 256, "vllm_version": "0.10.1"}
    assert gpu_activation(gpt, card_name="H100 80GB", **args).value == int(7.2 * GIB)
    assert gpu_activation(gpt, card_name="A100 80GB", env=FLASHINFER, **args).value < 2 * GIB


@pytest.mark.parametrize(
    ("name", "before_hopper"),
    [
        ("A100 80GB", True),
        ("NVIDIA A10G", True),
        ("L40S", True),
        ("NVIDIA L4", True),
        ("RTX 4090", True),
        ("RTX 3090", True),
        ("H100 80GB", False),
        ("NVIDIA H200", False),
        ("NVIDIA B200", False),
        ("RTX 5090", False),
        ("RTX PRO 6000 Blackwell Workstation", False),
    ],
)
def test_cards_before_compute_capability_9_are_known_by_name(name: str, before_hopper: bool) -> None:
    assert pre_hopper(name) is before_hopper


def test_the_patch_release_and_the_minor_release_read_a_version_alike() -> None:
    from pytest_vllm_mem.versions import patch_release, release

    for version, patch in (
        ("0.11.0", (0, 11, 0)),
        ("0.11.2rc1", (0, 11, 2)),
        ("v0.10.1.1", (0, 10, 1)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.3x", (0, 3, 0)),
    ):
        assert patch_release(version) == patch and release(version) == patch[:2]
    assert patch_release("banana") is None and patch_release(None) is None and release("banana") is None
