"""Configs vLLM refuses before it allocates memory, with vLLM's own reason (vllm 0.32 config/model.py, cache.py,
model_executor/layers/quantization/__init__.py), and runtime options whose memory the plan does not model.

Checked in vLLM's order: the quantization method (known, and the one the checkpoint was made with), the KV cache
dtype, tensor parallelism against the attention and KV heads, then max_model_len against the model's limit.
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_vllm_mem.plan.errors import PlanRefused, PlanUnsupported
from pytest_vllm_mem.plan.modelinfo import ModelInfo

# vLLM 0.32's QuantizationMethods, plus the names earlier supported releases (0.10-0.31) accepted.
QUANTIZATION_METHODS = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online",
    "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)  # fmt: skip
EARLIER_QUANTIZATION_METHODS = (
    "bitsandbytes", "gguf", "gptq_bitblas", "gptq_marlin_24", "marlin", "bitblas", "hqq", "deepspeedfp", "tpu_int8",
    "ptpc_fp8", "ipex", "auto-round", "rtn", "petit_nvfp4", "nvfp4",
)  # fmt: skip
# Runtime (online) quantization of a 16-bit checkpoint the plan sizes: FP8 weights, one byte each.
ONLINE_FP8 = ("fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "online")
# The overrides vLLM's checkpoint detection accepts for a checkpoint's own method (override_quantization_method).
_COMPATIBLE = {
    "awq": ("awq", "awq_marlin", "auto_awq", "moe_wna16"),
    "gptq": ("gptq", "gptq_marlin", "auto_gptq", "moe_wna16", "gptq_bitblas", "marlin"),
    "mxfp4": ("mxfp4", "gpt_oss_mxfp4"),
    "modelopt": ("modelopt", "modelopt_fp4", "modelopt_mixed", "modelopt_mxfp8"),
}
KV_CACHE_DTYPES = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)  # fmt: skip
# nvfp4 packs each head of K and of V as head_size / 2 bytes of fp4 data plus head_size / 16 fp8 block scales
# (vllm 0.33 utils/torch_utils.py nvfp4_kv_cache_full_dim, FlashInfer's customize_spec): 9/16 of a byte per element
# for head sizes that are multiples of 16; checked exactly on vllm#57475's log (Qwen3.8-27B, vLLM 0.29.1).
KV_CACHE_DTYPE_BYTES = {
    "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "nvfp4": 0.5625,
}  # fmt: skip
# Per-token-head layouts (vllm v1/kv_cache_interface.py AttentionSpec): real_page_size_bytes stores head_size int8 /
# fp8 bytes per head of K and of V (head_size // 2 uint8 for int4), and page_size_bytes adds
# 2 x block_size x num_kv_heads x 4 bytes: one float32 scale per token, head and K/V, carved from the same pool.
PER_TOKEN_HEAD_BYTES = {"int8_per_token_head": 1, "fp8_per_token_head": 1, "int4_per_token_head": 0.5}
PER_TOKEN_HEAD_SCALE_BYTES = 4


# Checkpoint formats whose method vLLM resolves from the checkpoint alone, replacing whatever --quantization says:
# ModelConfig._verify_quantization sets `self.quantization = quantization_override`, and these overrides ignore the
# user's value (vllm 0.22-0.33 config/model.py; inc/inc.py INCConfig.override_quantization_method maps an
# "auto-round" checkpoint to "inc"; modelopt.py maps ModelOpt FP8 / NVFP4 / MXFP8 / mixed checkpoints to modelopt,
# modelopt_fp4, modelopt_mxfp8, modelopt_mixed). So `--quantization auto_round` (a name no release lists) starts an
# AutoRound checkpoint; on any other checkpoint vLLM refuses it as unknown.
FLAG_OVERRIDDEN_BY_CHECKPOINT = {"auto-round": "inc", "modelopt": "modelopt"}


def check_quantization(info: ModelInfo, quantization: str | None) -> None:
    known = QUANTIZATION_METHODS + EARLIER_QUANTIZATION_METHODS
    checkpoint = info.quant_method
    if checkpoint in FLAG_OVERRIDDEN_BY_CHECKPOINT and (checkpoint != "modelopt" or info.quant_bits):
        return  # vLLM replaces the flag with the checkpoint's own method before checking it
    if quantization and quantization not in known:
        raise PlanRefused(
            f"Unknown quantization method: {quantization}. Must be one of {list(QUANTIZATION_METHODS)}.",
            "Pass a method vLLM knows, or none for the checkpoint's own.",
        )
    if checkpoint and quantization and quantization not in _COMPATIBLE.get(checkpoint, (checkpoint,)):
        raise PlanRefused(
            f"Quantization method specified in the model config ({checkpoint}) does not match the quantization "
            f"method specified in the `quantization` argument ({quantization}).",
            "Drop --quantization (vLLM reads the checkpoint's method) or pass a matching one.",
        )
    if checkpoint is None and quantization and quantization not in ONLINE_FP8:
        raise PlanUnsupported(
            f"--quantization {quantization} on the 16-bit checkpoint {info.name}: the plan sizes online FP8 "
            f"({', '.join(ONLINE_FP8)}) and pre-quantized checkpoints, not the memory of {quantization}'s runtime "
            "conversion. Plan a pre-quantized checkpoint of the model instead, or measure this with a real startup."
        )


def kv_dtype_bytes(kv_cache_dtype: str | None, model_dtype: float, head_dim: int | None = None) -> float:
    """Bytes per K/V element (a per-token-head layout's scales spread over its `head_dim` elements); vLLM's
    argparse refuses names outside its choices."""
    name = (kv_cache_dtype or "auto").lower()
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise PlanRefused(
            f"argument --kv-cache-dtype: invalid choice: {kv_cache_dtype!r} "
            f"(choose from {', '.join(KV_CACHE_DTYPES)}).",
        )
    if name in PER_TOKEN_HEAD_BYTES and head_dim:
        return PER_TOKEN_HEAD_BYTES[name] + PER_TOKEN_HEAD_SCALE_BYTES / head_dim
    if name not in KV_CACHE_DTYPE_BYTES:
        planned = [*KV_CACHE_DTYPE_BYTES, *PER_TOKEN_HEAD_BYTES]
        raise PlanUnsupported(
            f"kv_cache_dtype {name}: a quantized KV layout with its own scales and page size, which the plan does "
            f"not model. Planned KV dtypes: auto, {', '.join(planned)}."
        )
    return float(KV_CACHE_DTYPE_BYTES[name])


def check_parallelism(info: ModelInfo, tp: int) -> None:
    if info.num_attention_heads % tp:
        divisors = [n for n in range(1, info.num_attention_heads + 1) if info.num_attention_heads % n == 0]
        raise PlanRefused(
            f"Total number of attention heads ({info.num_attention_heads}) must be divisible by tensor parallel "
            f"size ({tp}).",
            f"Valid tensor_parallel_size values: {', '.join(str(d) for d in divisors if d <= 64)}; or shard by "
            "layers with pipeline_parallel_size.",
        )
    kv = info.num_kv_heads
    if not info.is_mla and (tp % kv if tp >= kv else kv % tp):
        raise PlanRefused(
            f"the {kv} KV heads cannot be split over tensor parallel size {tp}: vLLM's QKVParallelLinear requires "
            "the KV head count and the TP size to divide one another.",
        )


def check_max_model_len(
    info: ModelInfo, max_model_len: int, env: Mapping[str, str], *, before_0_30: bool = False
) -> None:
    limit = info.derived_max_len_before_0_30 if before_0_30 else info.derived_max_len
    if limit is None or max_model_len <= limit or env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip() in ("1", "true"):
        return
    raise PlanRefused(
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"({info.derived_max_len_key}={float(limit or 0)} or model_max_length=None in model's config.json). To allow "
        "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
        f"Give max_model_len {limit:,} or less.",
    )


__all__ = [
    "FLAG_OVERRIDDEN_BY_CHECKPOINT",
    "KV_CACHE_DTYPES",
    "QUANTIZATION_METHODS",
    "check_max_model_len",
    "check_parallelism",
    "check_quantization",
    "kv_dtype_bytes",
]
