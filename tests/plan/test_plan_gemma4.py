"""Gemma 4: KV-shared layers, per-layer input embeddings, full-attention layers with their own head size, towers.

Expected figures come from transformers 5.19's own Gemma4ForConditionalGeneration built on the meta device (no
weights), the parameter count of each part summed, for the published E2B config:

    from transformers import Gemma4Config; from transformers.models.gemma4 import modeling_gemma4 as m
    with torch.device("meta"): model = m.Gemma4ForConditionalGeneration(Gemma4Config(text_config=E2B,
        vision_config={}, audio_config={}))

vision_tower 167.36M + embed_vision 1.18M, audio_tower 304.82M + embed_audio 2.36M, 5,104.3M in all; and from vLLM
0.32's gemma4.py / kv_cache_utils.py for what keeps a cache and how pages are unified.
"""

from __future__ import annotations

from typing import Any

import pytest
from gpu_startups import model

from pytest_vllm_mem.plan.kv_layout import KVLayout, layout
from pytest_vllm_mem.plan.layers import FULL, KV_SHARED, SLIDING
from pytest_vllm_mem.plan.memory_plan import GIB, Card, concurrent_batches, kv_bytes_per_token, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config
from pytest_vllm_mem.plan.speculative import speculative
from pytest_vllm_mem.plan.towers import gemma4_audio_params, gemma4_vision_params
from pytest_vllm_mem.plan.weights import architecture_weight_bytes

E2B_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256,
    "sliding_window": 512,
    "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True,
    "attention_k_eq_v": False,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
    "tie_word_embeddings": True,
}
E2B = {
    "model_type": "gemma4",
    "architectures": ["Gemma4ForConditionalGeneration"],
    "text_config": E2B_TEXT,
    "vision_config": {"model_type": "gemma4_vision"},
    "audio_config": {
        "model_type": "gemma4_audio",
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "output_proj_dims": 1536,
    },
    "tie_word_embeddings": True,
}
L4 = Card("cuda", "L4", int(22.05 * GIB), nvlink=False)


def _e2b_layout(*, max_model_len: int, in_flight: int) -> KVLayout:
    """E2B's cache layers on one GPU in bf16: 12 sliding (one 256-wide KV head, 16 KiB a block of 16) and 3 full
    (one 512-wide head, 32 KiB)."""
    return layout(
        (SLIDING,) * 12 + (FULL,) * 3,
        page_bytes=16 * 1024,
        page_by_kind={FULL: 32 * 1024},
        max_model_len=max_model_len,
        block=16,
        window=512,
        chunk=None,
        in_flight=in_flight,
    )


def test_the_towers_are_counted_as_transformers_builds_them() -> None:
    assert gemma4_vision_params(E2B, 1536) == pytest.approx(167.36e6 + 1.18e6, rel=0.002)
    assert gemma4_audio_params(E2B, 1536) == pytest.approx(304.82e6 + 2.36e6, rel=0.01)
    assert gemma4_vision_params({"text_config": E2B_TEXT}, 1536) == 0  # no tower in the config, none counted


def test_e2b_weights_hold_the_per_layer_embeddings_the_double_wide_mlp_and_the_towers() -> None:
    info = model_info_from_config(E2B, name="google/gemma-4-E2B-it")
    assert architecture_weight_bytes(info, 2) / 2 == pytest.approx(5104.3e6, rel=0.005)
    # Without the per-layer table (2.35B parameters) the count was less than half of the model.
    text_only = model_info_from_config({"text_config": {**E2B_TEXT, "hidden_size_per_layer_input": 0}}, name="x")
    assert architecture_weight_bytes(text_only, 2) / 2 < 2.8e9


def test_kv_shared_layers_keep_no_cache_and_full_layers_use_their_own_head_size() -> None:
    info = model_info_from_config(E2B, name="google/gemma-4-E2B-it")
    kinds = info.cache_kinds
    assert kinds.count(KV_SHARED) == 20 and kinds[:15].count(FULL) == 3 and kinds[:15].count(SLIDING) == 12
    # 12 sliding layers x K and V x 1 head x 256 x 2 bytes, 3 full layers x 1 head x 512 (global_head_dim)
    assert kv_bytes_per_token(info, tp=1, model_dtype=2, kv_cache_dtype=None) == 12 * 2 * 256 * 2 + 3 * 2 * 512 * 2


def test_a_smaller_page_kind_gets_a_raised_block_as_vllm_unifies_page_sizes() -> None:
    # kv_cache_utils.unify_kv_cache_spec_page_size: the sliding layers' 16 KiB page at block 16 is half the full
    # layers' 32 KiB, so their block holds 32 tokens and every page is 32 KiB.
    pages = _e2b_layout(max_model_len=8192, in_flight=2048)
    assert pages.page_bytes == 32 * 1024 and pages.group_size == 3
    sliding_blocks = -(-(511 + 2048) // 32) + 1  # per sliding group, at 32 tokens a block
    assert pages.blocks_per_request == 4 * sliding_blocks + 8192 // 16
    assert pages.block == 16  # the full layers keep theirs: they bound the longest context


@pytest.mark.parametrize(("version", "towers"), [("0.21.0", True), ("0.27.1", False)])
def test_language_model_only_drops_the_towers_from_the_release_that_skips_them(version: str, towers: bool) -> None:
    info = model_info_from_config(E2B, name="google/gemma-4-E2B-it")
    flags = {"max_model_len": 8192, "language_model_only": True}
    with_flag = plan(info, flags, L4, vllm_version=version).weights.value
    without = plan(info, {"max_model_len": 8192}, L4, vllm_version=version).weights.value
    tower_bytes = (info.vision_params + info.audio_params) * 2
    assert without - with_flag == (0 if towers else pytest.approx(tower_bytes, rel=0.01))


def test_e2b_is_planned_not_refused() -> None:
    planned = plan(model_info_from_config(E2B, name="google/gemma-4-E2B-it"), {"max_model_len": 8192}, L4)
    assert planned.verdict == "fits" and planned.weights.value / GIB == pytest.approx(5104.3e6 * 2 / GIB, rel=0.01)
    assert any("towers (~0.47B parameters)" in note for note in planned.notes)


def test_windowed_groups_reserve_two_in_flight_batches_from_0_27_as_the_mi300x_log_shows() -> None:
    # xbill9/gemma4-dev's MI300X boot log (vLLM 0.29.1, E2B-it, max_model_len 32768, 191.69 GiB: 16384 batched
    # tokens): 'Available KV cache memory: 155.04 GiB', 'Maximum concurrency for 32,768 tokens per request: 275.45x'.
    # With async scheduling each sliding group reserves min(511 + 2 x 16384, 32768) tokens: 1,025 blocks of 32.
    pages = _e2b_layout(max_model_len=32768, in_flight=2 * 16384)
    assert pages.blocks_per_request == 4 * 1025 + 2048
    assert pages.concurrency(int(155.04 * GIB)) == pytest.approx(275.45, abs=0.01)


@pytest.mark.parametrize(
    ("flags", "pp", "version", "batches"),
    [
        ({}, 1, "0.26.1", 1),  # before vllm#47728: one batch
        ({}, 1, "0.27.1", 2),  # async scheduling on by default: two
        ({"async_scheduling": False}, 1, "0.32.0", 1),
        ({}, 2, "0.32.0", 2),  # pipeline parallel on the V1 runner: async off, one batch per stage
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, 1, "0.32.0", 1),
        ({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3, "model": "x"}}, 1, "0.32.0", 2),
    ],
)
def test_concurrent_batches_follow_vllms_async_scheduling_default(
    flags: dict[str, Any], pp: int, version: str, batches: int
) -> None:
    assert concurrent_batches(flags, pp=pp, spec=speculative(flags), version=version) == batches


def test_a_config_without_tie_word_embeddings_takes_its_class_default() -> None:
    # gemma-3-1b-it's config.json names no tie_word_embeddings; vLLM's gemma3.py ties the LM head when the config
    # says so, and Gemma3TextConfig's default is true. Planned untied, a public A100 MIG startup of it (1.91 GiB of
    # weights logged) was planned 0.56 GiB over: the 262,144 x 1152 head counted twice. MistralConfig's default is false.
    pytest.importorskip("transformers", reason="the class defaults come from transformers, which vLLM installs")
    gemma = {"model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4}
    gemma.update({"num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144})
    assert model_info_from_config(gemma, name="google/gemma-3-1b-it").tie_word_embeddings
    mistral = {**gemma, "model_type": "mistral", "head_dim": 128}
    assert not model_info_from_config(mistral, name="mistral").tie_word_embeddings
    assert not model_info_from_config({**gemma, "tie_word_embeddings": False}, name="x").tie_word_embeddings


# google/gemma-4-26B-A4B-it's text config as published (hidden_size_per_layer_input 0: no per-layer inputs).
GEMMA4_26B_A4B_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 2,
    "head_dim": 256,
    "global_head_dim": 512,
    "attention_k_eq_v": True,
    "vocab_size": 262144,
    "max_position_embeddings": 262144,
    "sliding_window": 1024,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "hidden_size_per_layer_input": 0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
}


def test_gemma4_moe_layers_keep_their_dense_mlp_beside_the_experts() -> None:
    # vLLM's Gemma4DecoderLayer builds self.mlp (intermediate_size) in every layer and, with enable_moe_block, the
    # experts as well; transformers 5.19's Gemma4ForCausalLM of this config has 25,233,141,760 parameters (the router
    # scales and the extra norms, 0.002%, are not counted here). Without the dense MLP the count was 24.70B.
    info = model_info_from_config({"text_config": GEMMA4_26B_A4B_TEXT, "tie_word_embeddings": True}, name="g26")
    assert architecture_weight_bytes(info, 2) / 2 == pytest.approx(25_233_141_760, rel=1e-4)
    assert info.experts_per_token == 8  # Gemma 4 names it top_k_experts


def test_a_checkpoint_whose_ignore_list_names_attention_quantizes_only_the_experts() -> None:
    # nvidia/Gemma-4-26B-A4B-NVFP4 lists every layer's self_attn, dense mlp and router under "ignore"
    # (compressed-tensors style); vLLM 0.20.2 on an RTX 5090 logged "Model loading took 17.89 GiB" (search-index
    # file 56816929356, benchmarks/data/gpu_startups.json row c16c-5090-56816929356). Reading only
    # modules_to_not_convert for that, the plan quantized attention and the dense MLP too: 15.27 GiB (-15%).
    assert architecture_weight_bytes(model("nvidia/Gemma-4-26B-A4B-NVFP4"), 2) / GIB == pytest.approx(17.89, rel=0.03)
