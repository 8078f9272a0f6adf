"""Pre-quantized checkpoints as vLLM loads them (issue 24): the bytes per weight of each method's linear layers as
vLLM's create_weights allocates them (vllm 0.24-0.33 model_executor/layers/quantization), the modules a checkpoint
leaves unquantized, and the --quantization names vLLM accepts because the checkpoint's own method replaces them."""

from __future__ import annotations

import re
from typing import Any

import pytest
from gpu_startups import MODELS

from pytest_vllm_mem.plan.errors import PlanRefused
from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
from pytest_vllm_mem.plan.modelinfo import ModelInfo, model_info_from_config
from pytest_vllm_mem.plan.weights import architecture_weight_bytes, parameters

H100 = Card("cuda", "H100 80GB", int(79.19 * GIB))
LLAMA = MODELS["meta-llama/Llama-3.1-8B-Instruct"]["config"]


def with_quant(quant: dict[str, Any], base: dict[str, Any] = LLAMA) -> ModelInfo:
    return model_info_from_config({**base, "quantization_config": quant}, name="q")


def linear_bytes_per_weight(info: ModelInfo) -> float:
    """Bytes per linear-layer weight: the architecture's bytes less the 16-bit parts, over the linear parameters."""
    parts = parameters(info)
    linear = (parts.expert_per_layer + parts.other_linear_per_layer) * info.num_layers
    rest = parts.norms_per_layer * info.num_layers + parts.embedding + parts.lm_head + parts.final_norm
    return (architecture_weight_bytes(info, 2) - rest * 2) / linear


def test_block_fp8_keeps_one_float32_scale_per_128_by_128_block() -> None:
    # fp8.py Fp8LinearMethod.create_weights: an fp8 weight and weight_scale_inv of ceil(n/128) x ceil(k/128) float32
    block = with_quant({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert linear_bytes_per_weight(block) == pytest.approx(1 + 4 / (128 * 128), rel=1e-4)
    # per-tensor FP8: one float32 scale per matrix
    assert linear_bytes_per_weight(with_quant({"quant_method": "fp8"})) == pytest.approx(1.0, rel=1e-4)


def test_compressed_tensors_scales_follow_the_scheme() -> None:
    # w8a8 per channel: one float32 scale per output row (ChannelQuantScaleParameter): one byte per weight
    channel = with_quant({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8}}}})
    assert linear_bytes_per_weight(channel) == pytest.approx(1.0, rel=1e-4)
    # wNa16 per group: a scale in the model dtype per group, a packed zero point only when asymmetric
    group = {"num_bits": 4, "group_size": 128}
    sym = with_quant({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": group}}})
    assert linear_bytes_per_weight(sym) == pytest.approx(0.5 + 2 / 128, rel=1e-4)
    asym = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {**group, "symmetric": False}}}}
    assert linear_bytes_per_weight(with_quant(asym)) == pytest.approx(0.5 + 2.5 / 128, rel=1e-4)


def test_modelopt_nvfp4_packs_two_weights_a_byte_with_an_fp8_scale_per_16() -> None:
    # modelopt.py ModelOptNvFp4LinearMethod.create_weights: uint8 of k/2 and float8_e4m3 weight_scale of k/16
    for quant in (
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
        {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}},  # hf_quant_config.json's nesting
    ):
        info = with_quant(quant)
        assert (info.quant_bits, info.quant_group_size) == (4, 16)
        assert linear_bytes_per_weight(info) == pytest.approx(0.5 + 1 / 16, rel=1e-4)


def test_modules_a_checkpoint_leaves_unquantized_stay_at_the_model_dtype() -> None:
    base = MODELS["Qwen/Qwen3.8-27B"]["config"]
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    uniform = with_quant(nvfp4, base)
    skipping = with_quant({**nvfp4, "ignore": ["re:.*linear_attn\\.in_proj_(a|b|qkv|z)$"]}, base)
    # 48 Gated DeltaNet layers' in_proj_qkv (5120 x 10240) and in_proj_z (5120 x 6144), a and b (5120 x 48 each)
    params = 48 * 5120 * (10240 + 6144 + 2 * 48)
    extra = architecture_weight_bytes(skipping, 2) - architecture_weight_bytes(uniform, 2)
    assert extra == pytest.approx(params * (2 - 0.5625), rel=1e-3)
    # AutoRound's extra_config entries of 16 bits, and wildcards, name skipped modules the same way
    auto = with_quant(
        {
            "quant_method": "auto-round",
            "bits": 4,
            "group_size": 128,
            "extra_config": {".*linear_attn\\.in_proj_a$": {"bits": 16}, "x": {"bits": 4}},
        },
        base,
    )
    assert auto.quant_skipped == ("re:.*linear_attn\\.in_proj_a$",)
    star = with_quant(
        {
            **nvfp4,
            "exclude_modules": [
                "*linear_attn.in_proj_qkv",
                "*linear_attn.in_proj_z",
                "*linear_attn.in_proj_a",
                "*linear_attn.in_proj_b",
            ],
        },
        base,
    )
    assert architecture_weight_bytes(star, 2) == architecture_weight_bytes(skipping, 2)


def test_the_served_checkpoints_weights_match_what_vllm_logged_in_vllm_recipes_810() -> None:
    # "weights/GPU" at TP 2 on two RTX 5090: FP8 14.28 GiB, NVFP4 (Inferact) 12.02 GiB, with the MTP head loaded
    # (the plan leaves the drafter out: 0.4 GiB a GPU in bfloat16)
    fp8 = model_info_from_config(MODELS["Qwen/Qwen3.8-27B-FP8"]["config"], name="fp8")
    nvfp4 = model_info_from_config(MODELS["Inferact/Qwen3.8-27B-NVFP4"]["config"], name="nvfp4")
    assert architecture_weight_bytes(fp8, 2) / 2 / GIB == pytest.approx(14.28, rel=0.02)
    assert architecture_weight_bytes(nvfp4, 2) / 2 / GIB == pytest.approx(12.02, rel=0.02)


def test_an_autoround_checkpoint_starts_under_any_quantization_name_as_vllm_replaces_it() -> None:
    # config/model.py _verify_quantization: INCConfig.override_quantization_method maps an "auto-round" checkpoint to
    # "inc" whatever --quantization says, and the flag is set to it (vllm 0.22-0.33), so `auto_round` (a name no
    # release lists) starts club-3090's AutoRound checkpoints
    autoround = with_quant({"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True})
    for name in ("auto_round", "auto-round", "inc", None):
        assert plan(autoround, {"quantization": name} if name else {}, H100).verdict == "fits"
    assert (
        plan(autoround, {"quantization": "auto_round"}, H100).weights.value == plan(autoround, {}, H100).weights.value
    )
    # ModelOpt checkpoints likewise resolve to modelopt / modelopt_fp4 whatever the flag says
    nvfp4 = with_quant({"quant_method": "modelopt", "quant_algo": "NVFP4"})
    assert plan(nvfp4, {"quantization": "modelopt_fp4"}, H100).verdict == "fits"
    # on a checkpoint without that quantization_config vLLM refuses the name as unknown
    with pytest.raises(PlanRefused, match=re.escape("Unknown quantization method: auto_round")):
        plan(model_info_from_config(LLAMA, name="bf16"), {"quantization": "auto_round"}, H100)
