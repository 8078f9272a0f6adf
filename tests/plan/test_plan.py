"""The plan's arithmetic against figures vLLM printed (tests/data/logs, DESIGN.md) and published model configs."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from model_configs import TINY_CONFIG

from pytest_vllm_mem.plan.known_models import KNOWN_CONFIGS
from pytest_vllm_mem.plan.memory_plan import (
    GIB,
    Calibration,
    Card,
    PlanError,
    PlanUnsupported,
    kv_bytes_per_token,
    plan,
)
from pytest_vllm_mem.plan.modelinfo import (
    ModelInfo,
    ModelInfoError,
    checkpoint_bytes,
    find_model_folder,
    load_model_info,
    model_info_from_config,
    read_safetensors_header,
)
from pytest_vllm_mem.plan.weights import architecture_weight_bytes

# Public config.json figures (Hugging Face model cards), trimmed to what the plan reads: the plugin's built-in copies,
# so a test and the preflight of a model that was never downloaded read the same figures.
LLAMA2_7B = KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]
LLAMA3_8B = KNOWN_CONFIGS["meta-llama/Meta-Llama-3-8B"]
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": 1536,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "sliding_window": 4096,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def info(config: dict[str, Any], name: str = "m") -> ModelInfo:
    return model_info_from_config(config, name=name)


def gpu(total_gb: float) -> Card:
    return Card("cuda", f"{total_gb:g}gb", int(total_gb * 1e9))


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A real safetensors file: header (dtype, shape, offsets) then zero bytes."""
    header, offset = {}, 0
    for name, (dtype, shape, itemsize) in tensors.items():
        size = itemsize
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * offset)


def test_kv_bytes_per_token_dense_gqa_tp_fp8_and_mla() -> None:
    assert kv_bytes_per_token(info(LLAMA2_7B), tp=1, model_dtype=2, kv_cache_dtype=None) == 512 * 1024
    llama3 = info(LLAMA3_8B)
    assert kv_bytes_per_token(llama3, tp=1, model_dtype=2, kv_cache_dtype="auto") == 131072  # 8 KV heads
    assert kv_bytes_per_token(llama3, tp=2, model_dtype=2, kv_cache_dtype="auto") == 65536
    assert kv_bytes_per_token(llama3, tp=16, model_dtype=2, kv_cache_dtype="auto") == 16384  # one replicated head
    assert kv_bytes_per_token(llama3, tp=1, model_dtype=2, kv_cache_dtype="fp8") == 65536
    # MLA: one 512 + 64 latent per layer, replicated on every GPU.
    assert kv_bytes_per_token(info(DEEPSEEK_V3), tp=8, model_dtype=2, kv_cache_dtype=None) == 61 * 576 * 2


def test_architecture_weights_match_logged_loading_figures() -> None:
    # vLLM logs "Model loading took 12.55 GiB" for Llama-2-7B fp16 and 14.99 GiB for Llama-3-8B bf16.
    assert architecture_weight_bytes(info(LLAMA2_7B), 2) / GIB == pytest.approx(12.55, rel=0.01)
    assert architecture_weight_bytes(info(LLAMA3_8B), 2) / GIB == pytest.approx(14.99, rel=0.01)
    # DeepSeek-V3 has 671B parameters (without its MTP layer), FP8 on disk.
    params = architecture_weight_bytes(info(DEEPSEEK_V3), 1)
    assert params / 1e9 == pytest.approx(671, rel=0.03)


def test_safetensors_header_sizes_without_reading_data(tmp_path: Path) -> None:
    write_safetensors(
        tmp_path / "model-00001.safetensors", {"a.weight": ("BF16", [64, 32], 2), "b.qweight": ("I32", [16, 32], 4)}
    )
    write_safetensors(tmp_path / "model-00002.safetensors", {"c.weight": ("F32", [10], 4)})
    assert read_safetensors_header(tmp_path / "model-00002.safetensors")["c.weight"]["shape"] == [10]
    ckpt = checkpoint_bytes(tmp_path)
    assert ckpt is not None
    assert (ckpt.total, ckpt.float_bytes, ckpt.files) == (64 * 32 * 2 + 16 * 32 * 4 + 40, 64 * 32 * 2 + 40, 2)
    (tmp_path / "bad.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ModelInfoError, match="LFS pointer"):
        checkpoint_bytes(tmp_path)


def test_quantized_checkpoint_counts_its_real_tensor_bytes(tmp_path: Path) -> None:
    config = {**LLAMA2_7B, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "model.safetensors", {"q": ("I32", [1000, 1000], 4), "emb": ("F16", [1000], 2)})
    loaded = load_model_info(str(tmp_path))
    result = plan(loaded, {}, gpu(24))
    assert result.weights.value == 4_002_000 and result.weights.source == "checkpoint"
    # From config.json alone a 4-bit AWQ Llama-2-7B is ~3.9 GB (TheBloke's 3.89 GB of safetensors).
    alone = plan(info(config), {}, gpu(24))
    assert alone.weights.source == "architecture"
    assert alone.weights.value / 1e9 == pytest.approx(3.89, rel=0.04)


def test_float32_checkpoint_is_served_as_bfloat16(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_7B, "torch_dtype": "float32"}))
    write_safetensors(tmp_path / "model.safetensors", {"w": ("F32", [1000, 1000], 4)})
    assert plan(load_model_info(str(tmp_path)), {}, gpu(24)).weights.value == 2_000_000
    assert plan(load_model_info(str(tmp_path)), {"dtype": "float32"}, gpu(24)).weights.value == 4_000_000


def test_hf_cache_snapshot_is_found_and_the_hub_never_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA3_8B))
    (tmp_path / "models--org--name" / "refs").mkdir()
    (tmp_path / "models--org--name" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert find_model_folder("org/name") == snapshot
    assert load_model_info("org/name").num_kv_heads == 8
    with pytest.raises(ModelInfoError, match="never downloads"):
        load_model_info("org/missing")


def test_example_suite_ladder_on_24gb_and_the_known_bad_config() -> None:
    llama = info(LLAMA2_7B)
    for flags in (
        {"gpu_memory_utilization": 0.8, "max_model_len": 2048},
        {"gpu_memory_utilization": 0.8, "enforce_eager": True},
        {"gpu_memory_utilization": 0.75, "max_model_len": 4096, "enforce_eager": True},
    ):
        assert plan(llama, flags, gpu(24), vllm_version="0.33.0").verdict == "fits", flags
    # A (0.7, 4,096 tokens, graphs) leaves about the 2 GiB one sequence needs: the plan says it cannot be sure.
    assert not plan(llama, {"gpu_memory_utilization": 0.7}, gpu(24), vllm_version="0.33.0").sure
    bad = plan(llama, {"gpu_memory_utilization": 0.65, "max_model_len": 4096}, gpu(24), vllm_version="0.33.0")
    assert bad.verdict == "kv_cache_insufficient"
    assert 0 < bad.longest_context < 4096 and bad.longest_context % 16 == 0
    assert "longest context that fits" in bad.summary


def test_weights_too_large_and_tp_splits_them() -> None:
    big = info(LLAMA3_70B)
    assert plan(big, {}, gpu(80)).verdict == "weights_too_large"
    split = plan(big, {"tensor_parallel_size": 4, "max_model_len": 8192}, gpu(80))
    assert split.verdict == "fits"
    assert split.weights.value == pytest.approx(plan(big, {}, gpu(80)).weights.value / 4, rel=1e-6)


def test_calibration_makes_kv_exact_and_tokens_follow_vllms_block_count() -> None:
    # Llama-3-8B on an 80 GiB card (vLLM 0.8 log): requested 71.33 GiB, weights 14.99, non-torch 0.23,
    # activation 4.34 -> 51.77 GiB of KV cache = 424,096 tokens at 128 KiB per token (16-token blocks).
    card = Card("cuda", "H100", int(79.25 * GIB))
    cal = Calibration(
        activation_bytes=int(4.34 * GIB), non_torch_bytes=int(0.23 * GIB), graph_bytes=0, weights_bytes=int(14.99 * GIB)
    )
    result = plan(info(LLAMA3_8B), {"gpu_memory_utilization": 0.9}, card, vllm_version="0.8.5", calibration=cal)
    assert result.kv_bytes.low == result.kv_bytes.high
    assert result.kv_bytes.value / GIB == pytest.approx(51.77, abs=0.01)
    assert result.kv_tokens.value == pytest.approx(424_096, rel=0.001)


def test_cpu_plan_with_kvcache_space_is_exact() -> None:
    tiny = info(TINY_CONFIG)
    card = Card("cpu", "node 0", int(10.46 * GIB), available_bytes=9 * GIB)
    result = plan(tiny, {"max_model_len": 2048}, card, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert result.kv_bytes_per_token == 1024 and result.block_size == 128
    assert result.kv_tokens.value == result.kv_tokens.low == GIB // 1024
    starved = plan(tiny, {"gpu_memory_utilization": 0.02, "max_model_len": 2048}, card)
    assert starved.verdict == "host_memory"  # vLLM's cpu_worker refuses a KV budget <= 0
    greedy = plan(tiny, {"gpu_memory_utilization": 0.95}, card)
    assert greedy.verdict == "host_memory" and "available" in greedy.summary


def test_unsupported_layouts_say_so() -> None:
    hybrid = {**LLAMA3_8B, "layer_types": ["full_attention", "linear_attention"] * 16}
    with pytest.raises(PlanUnsupported, match="hybrid"):
        plan(info(hybrid), {}, gpu(24))
    with pytest.raises(PlanError, match="max-model-len"):
        plan(info(LLAMA3_8B), {"max_model_len": "long"}, gpu(24))
    with pytest.raises(ModelInfoError, match="num_hidden_layers"):
        info({"architectures": ["X"]})
