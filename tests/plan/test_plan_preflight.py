"""`pytest --vllm-preflight`: every config planned on its tier in seconds, no server; plan beside measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_vllm_mem.plan.known_models import KNOWN_CONFIGS
from pytest_vllm_mem.plan.preflight import kv_cell, preflight_tier

LLAMA2_7B = KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]

SUITE = """
import pytest
from pytest_vllm_mem import VLLMConfig, VLLMStartupError

MODEL = {model!r}
FITS = VLLMConfig(MODEL, gpu_memory_utilization=0.8, max_model_len=2048)
TOO_LONG = VLLMConfig(MODEL, gpu_memory_utilization=0.65, max_model_len=4096)


@pytest.mark.vllm_tier("24gb")
@pytest.mark.parametrize("vllm_config", [FITS], ids=["fits"])
def test_serves(vllm_server, vllm_load):
    result = vllm_load(num_prompts=200, concurrency=16)
    assert result.ok and result.completed == 200


@pytest.mark.vllm_tier("24gb")
@pytest.mark.parametrize("vllm_config", [TOO_LONG], ids=["too-long"])
def test_too_long_serves(vllm_server, vllm_load):
    assert vllm_load().ok


@pytest.mark.vllm_tier("24gb")
def test_known_bad(vllm_start):
    with pytest.raises(VLLMStartupError) as error:
        vllm_start(TOO_LONG)
    assert error.value.kind == "kv_cache_insufficient"
    assert error.value.diagnosis.figures["longest_context"] < 4096


@pytest.mark.vllm_tier("8gb", max="8gb")
@pytest.mark.parametrize("vllm_config", [FITS], ids=["small"])
def test_small_card(vllm_server, vllm_load):
    assert vllm_load().ok
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, tmp_path: Path) -> pytest.Pytester:
    model = tmp_path / "llama-2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_7B))
    pytester.makepyfile(test_inner=SUITE.format(model=str(model)))
    return pytester


def test_preflight_plans_the_whole_matrix_without_a_server(suite: pytest.Pytester, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    markdown = tmp_path / "summary.md"
    run = suite.runpytest(
        "-p", "no:cacheprovider", "--vllm-preflight", f"--vllm-results={results}", f"--vllm-markdown={markdown}"
    )
    # 24gb: fits (planned), too long (fails with the predicted kind), the known-bad test passes as in a real run;
    # the 8gb-only test runs on its own tier (7.45 GiB: fp16 weights of 12.55 GiB do not fit).
    run.assert_outcomes(passed=2, failed=2)
    text = run.stdout.str()
    assert "predicted by the plan, not measured" in text and "longest context that fits" in text
    assert "weights_too_large" in text
    records = {r["test_id"].rsplit("::", 1)[-1]: r for r in json.loads(results.read_text())["tests"]}
    assert records["test_serves[fits]"]["outcome"] == "planned"
    assert records["test_serves[fits]"]["loads"] == [] and records["test_serves[fits]"]["server_pid"] is None
    assert records["test_serves[fits]"]["plan"]["verdict"] == "fits"
    assert records["test_too_long_serves[too-long]"]["failure"]["kind"] == "kv_cache_insufficient"
    assert records["test_small_card[small]"]["tier"] == "8gb"
    assert "plan " in markdown.read_text()
    assert "server_startups" not in text


def test_preflight_with_a_tier_given_plans_on_that_tier_only(suite: pytest.Pytester) -> None:
    run = suite.runpytest("-p", "no:cacheprovider", "--vllm-preflight", "--vllm-gpu=24gb")
    run.assert_outcomes(passed=2, failed=1, skipped=1)  # the 8gb-only test is skipped as on a 24gb runner


def test_preflight_tier_and_report_cell() -> None:
    assert preflight_tier("auto", "8gb", "8gb") == "8gb"
    assert preflight_tier("24gb", "8gb", None) == "24gb"
    assert preflight_tier("auto", None, None) == "auto"
    planned = {"kv_tokens": {"value": 103040}}
    assert kv_cell(108160, planned) == "108,160 (plan 103,040)"
    assert kv_cell(None, planned) == "plan 103,040"
    assert kv_cell(None, {"error": "no config.json"}) == "-"


def test_real_run_record_keeps_plan_beside_logged_figures() -> None:
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.plan.memory_plan import GIB, Card, plan
    from pytest_vllm_mem.plan.modelinfo import model_info_from_config
    from pytest_vllm_mem.plan.preflight import SessionPlan, SessionPlans, plan_record

    info = model_info_from_config(LLAMA2_7B, name="llama")
    result = plan(info, {"gpu_memory_utilization": 0.9}, Card("cuda", "L4", int(22.03 * GIB)), vllm_version="0.33.0")
    launched = VLLMConfig("llama", gpu_memory_utilization=0.9)
    state = SessionPlans(reports={launched: result.to_dict()})
    state.plans[launched] = SessionPlan(result, "key", launched, lambda flags: result)
    logged = {"weights_gib": 12.55, "kv_cache_gib": 5.0, "kv_cache_tokens": 10240, "kv_cache_blocks": 640}
    record = plan_record(state, launched, logged)
    assert record is not None and record["verdict"] == result.verdict
    side = record["vs_logged"]
    assert side["weights_gib"]["logged"] == 12.55
    assert side["kv_cache_tokens"]["planned"] == result.kv_tokens.value
    assert side["kv_cache_tokens"]["error"] == pytest.approx((result.kv_tokens.value - 10240) / 10240)
    assert side["kv_cache_blocks"]["planned"] == result.kv_blocks > 0  # the pool's blocks, beside /metrics' count
    assert plan_record(state, VLLMConfig("other"), logged) is None
