"""The rules of 2026-12-03 (issue 24's fifth collection), each from vLLM's source and checked on a public log:
speculative decoding's share of a hybrid pool, the per-token-head KV layouts, the release from which the token line
is concurrency x max_model_len, the graph estimate that follows the number of capture sizes, and the Mamba-block
check that needs full CUDA graphs."""

from __future__ import annotations

from typing import Any

import pytest
from gpu_startups import model

from pytest_vllm_mem.plan.cudagraphs import capture_sizes, full_cudagraphs
from pytest_vllm_mem.plan.errors import PlanUnsupported
from pytest_vllm_mem.plan.layers import GDN, StateDims, gdn_state_shape
from pytest_vllm_mem.plan.memory_plan import GIB, Card, gpu_graphs, kv_bytes_per_token, plan
from pytest_vllm_mem.plan.speculative import mtp_layers, speculative
from pytest_vllm_mem.versions import default_utilization

RTX3090 = Card("cuda", "RTX 3090", int(23.56 * GIB), nvlink=False)
MAXQ = Card("cuda", "RTX PRO 6000 Blackwell Max-Q", int(95.59 * GIB), nvlink=False)
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}
# club-3090#91 (vLLM 0.20.1, 2x RTX 3090): the Lorbus AutoRound checkpoint at 262,144 tokens with MTP 3
DUAL = {
    "tensor_parallel_size": 2,
    "max_model_len": 262144,
    "quantization": "auto_round",
    "dtype": "float16",
    "kv_cache_dtype": "fp8_e5m2",
    "enable_prefix_caching": True,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 2,
}


def lorbus() -> Any:
    return model("Lorbus/Qwen3.6-27B-int4-AutoRound")


def test_the_speculative_config_is_read_as_a_dict_or_json_text() -> None:
    assert speculative({"speculative_config": MTP3}) == speculative(
        {"speculative_config": '{"method": "mtp", "num_speculative_tokens": 3}'}
    )
    spec = speculative({"speculative_config": MTP3})
    assert spec is not None and (spec.num_tokens, spec.draft_attention_layers) == (3, 1)
    dflash = speculative({"speculative_config": {"method": "dflash", "num_speculative_tokens": 7}})
    assert dflash is not None and (dflash.num_tokens, dflash.draft_attention_layers) == (7, 0)
    alias = speculative({"speculative_config": {"method": "gemma4_mtp", "num_speculative_tokens": 1}}, 2)
    assert alias is not None and alias.draft_attention_layers == 2  # every *_mtp alias is MTP
    assert speculative({}) is None and speculative({"speculative_config": "not json"}) is None
    assert mtp_layers({"text_config": {"mtp_num_hidden_layers": 2}}) == 2 and mtp_layers({}) == 1


def test_an_mtp_drafter_adds_a_full_attention_layer_and_three_padding_layers() -> None:
    # vLLM with MTP on Qwen3.6-27B (vllm#49011's and club-3090 PR #44's logs): 'Add 3 padding layers, may waste at
    # most 6.25% KV cache memory': 16 + 1 full-attention layers set the group size, 48 GDN layers fill 3 x 17
    planned = plan(lorbus(), {**DUAL, "speculative_config": MTP3}, RTX3090, vllm_version="0.20.1")
    assert any("3 linear_attention, 1 full group(s) of 17 layers" in note for note in planned.notes)
    without = plan(lorbus(), DUAL, RTX3090, vllm_version="0.20.1")
    assert any("group(s) of 16 layers" in note for note in without.notes)


def test_speculative_tokens_add_conv_rows_and_state_pages() -> None:
    # mamba_utils.gated_delta_net_state_shape: conv_kernel - 1 + num_spec rows; MambaSpec.num_speculative_blocks:
    # one page per speculative token on top of the 2 of prefix caching ("align")
    dims = StateDims(GDN, conv_kernel=4, num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128)
    assert gdn_state_shape(dims, 2, num_spec=3)[0] == (6, 5120)
    planned = plan(lorbus(), {**DUAL, "speculative_config": MTP3}, RTX3090, vllm_version="0.20.1")
    assert any("5 page(s) per request in each state group" in note for note in planned.notes)


def test_the_token_line_of_a_hybrid_is_concurrency_times_length_from_0_20() -> None:
    # kv_cache_utils._report_kv_cache_config: num_tokens = int(max_concurrency * max_model_len). club-3090#91's
    # v0.20.1 log: 'GPU KV cache size: 619,479 tokens', 'Maximum concurrency for 262,144 tokens per request: 2.36x'
    flags = {**DUAL, "speculative_config": MTP3}  # utilization: the release's default, as the log's run had
    planned = plan(lorbus(), flags, RTX3090, vllm_version="0.20.1", default_utilization=default_utilization("0.20.1"))
    assert planned.kv_tokens.value == int(planned.max_concurrency * 262144)
    assert abs(planned.kv_tokens.value / 619_479 - 1) < 0.02
    assert round(planned.max_concurrency, 2) == 2.35  # the log's 2.36x, to the block


def test_per_token_head_kv_pages_carry_a_float32_scale_per_token_and_head() -> None:
    # v1/kv_cache_interface.py AttentionSpec: page = 2 x block x heads x head_size x 1 byte (int8/fp8; head_size // 2
    # for int4) + 2 x block x heads x 4 (float32 scales). Llama-3.1-8B: 32 layers, 8 KV heads of 128
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    per_layer = {"int8_per_token_head": 2 * 8 * (128 + 4), "int4_per_token_head": 2 * 8 * (64 + 4)}
    for name, page in per_layer.items():
        assert kv_bytes_per_token(llama, tp=1, model_dtype=2, kv_cache_dtype=name) == 32 * page
    assert kv_bytes_per_token(llama, tp=1, model_dtype=2, kv_cache_dtype="fp8_per_token_head") == 32 * 2 * 8 * 132


def test_an_int8_per_token_head_pool_holds_the_tokens_vllm_logged() -> None:
    # club-3090#446 (vLLM v0.22.0, 4x RTX 3090, TP 4, MTP 3): 'Available KV cache memory: 15.73 GiB',
    # 'GPU KV cache size: 1,746,661 tokens' with --kv-cache-dtype int8_per_token_head (was unsupported)
    flags = {
        "tensor_parallel_size": 4,
        "max_model_len": 262144,
        "quantization": "auto_round",
        "kv_cache_dtype": "int8_per_token_head",
        "speculative_config": MTP3,
        "kv_cache_memory_bytes": int(15.73 * GIB),
    }
    planned = plan(lorbus(), flags, RTX3090, vllm_version="0.22.0")
    assert abs(planned.kv_tokens.value / 1_746_661 - 1) < 0.02


def test_the_capture_sizes_are_vllms_defaults() -> None:
    # config/vllm.py: up to min(2 x max_num_seqs, 512, max_num_batched_tokens): [1, 2, 4], every 8 below 256, every 16
    assert capture_sizes(2, 8192) == [1, 2, 4]
    assert capture_sizes(16, 8192) == [1, 2, 4, 8, 16, 24, 32]
    assert len(capture_sizes(256, 8192)) == len(capture_sizes(1024, 8192)) == 51
    assert capture_sizes(256, 4) == [1, 2, 4]


def test_the_in_budget_graph_estimate_follows_the_number_of_capture_sizes() -> None:
    # club-3090 PR #44 (4x RTX 3090, TP 4, Qwen3.6-27B before 0.26): 'Profiling CUDA graph memory: PIECEWISE=7
    # (largest=32)', 'Estimated CUDA graph memory: 0.17 GiB total'
    estimate = gpu_graphs(lorbus(), eager=False, max_num_seqs=16, tp=4, in_budget=True)
    assert estimate.low <= int(0.17 * GIB) <= estimate.high
    assert estimate.value < gpu_graphs(lorbus(), eager=False, max_num_seqs=16, tp=4).value / 3


def test_the_mamba_block_check_needs_full_cuda_graphs() -> None:
    # config/compilation.py resolve_cudagraph_mode_and_sizes raises only when cudagraph_mode.has_full_cudagraphs()
    # (recipes#831: 'max_num_seqs (1024) exceeds available Mamba cache blocks (939)' under the default mode)
    pool = {"kv_cache_memory_bytes": 939 * 16 * 784 * 4 * 256 * 2 * 2 + 1000}
    info = model("Qwen/Qwen3.8-27B-FP8")
    assert plan(info, pool, MAXQ, vllm_version="0.27.0").verdict == "kv_cache_insufficient"
    piecewise = {**pool, "compilation_config": {"cudagraph_mode": "PIECEWISE"}}
    assert plan(info, piecewise, MAXQ, vllm_version="0.27.0").verdict == "fits"
    full = {**pool, "compilation_config": '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'}
    assert plan(info, full, MAXQ, vllm_version="0.27.0").verdict == "kv_cache_insufficient"
    assert not full_cudagraphs({"enforce_eager": True}) and full_cudagraphs({})


@pytest.mark.parametrize(
    "config",
    [
        {"method": "dflash", "model": "~/.cache/huggingface/qwen3.6-27b-dflash", "num_speculative_tokens": 5},
        {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3},
        {"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4},
        {"model": "some/draft", "num_speculative_tokens": 2},
    ],
)
def test_a_drafter_with_its_own_checkpoint_is_not_planned(config: dict[str, Any]) -> None:
    """Its weights and cache layers follow its own config.json: unsupported, saying which drafters are planned."""
    with pytest.raises(PlanUnsupported, match="drafter's weights and cache layers follow its own checkpoint"):
        plan(lorbus(), {**DUAL, "speculative_config": config}, RTX3090, vllm_version="0.24.0")


def test_weightless_and_mtp_drafters_are_planned() -> None:
    for config in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, MTP3):
        assert plan(lorbus(), {**DUAL, "speculative_config": config}, RTX3090, vllm_version="0.24.0").verdict
