"""`python -m pytest_vllm_mem plan`: the plan and ladder for one model, exit codes, bad input, calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_vllm_mem.cli.main import main
from pytest_vllm_mem.plan.calibration import CalibrationStore, calibration_key, from_startup
from pytest_vllm_mem.plan.known_models import KNOWN_CONFIGS
from pytest_vllm_mem.plan.memory_plan import GIB, Calibration, Card, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config

LLAMA2_7B = KNOWN_CONFIGS["meta-llama/Llama-2-7b-hf"]


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    return tmp_path


def test_plan_command_prints_terms_ladder_and_exit_code(
    llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            str(llama_folder),
            "--tier",
            "24gb",
            "--vllm-version",
            "0.33.0",
            "--flag",
            "gpu_memory_utilization=0.65",
            "--flag",
            "max_model_len=4096",
            "--json",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    assert code == 1 and "kv_cache_insufficient" in text and "longest context that fits" in text
    for rung in ("A-util0.7", "B-len2048", "C-eager", "D-combined"):
        assert rung in text
    document = json.loads(out_json.read_text())
    assert document["plan"]["verdict"] == "kv_cache_insufficient"
    assert [r["rung"] for r in document["ladder"]] == ["A-util0.7", "B-len2048", "C-eager", "D-combined"]
    assert (
        main(
            [
                "plan",
                "--model",
                str(llama_folder),
                "--tier",
                "24gb",
                "--flag",
                "max_model_len=2048",
                "--flag",
                "gpu_memory_utilization=0.8",
            ]
        )
        == 0
    )


def test_plan_command_bad_input_is_one_paragraph(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", str(tmp_path / "missing"), "--tier", "24gb"])
    assert exit_info.value.code == 2
    assert "never downloads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--model", "x", "--tier", "24"])
    assert "unit is required" in capsys.readouterr().err


def test_calibration_round_trip_makes_the_next_plan_exact(tmp_path: Path) -> None:
    info = model_info_from_config(LLAMA2_7B, name="llama")
    card = Card("cuda", "NVIDIA L4", int(22.03 * GIB))
    first = plan(info, {"gpu_memory_utilization": 0.9, "max_model_len": 4096}, card, vllm_version="0.33.0")
    logged = {"weights_gib": 12.55, "kv_cache_gib": 5.02, "graph_capture_gib": 0.61}
    cal = from_startup(first, logged)
    assert cal is not None
    store = CalibrationStore(tmp_path / "calibration.json")
    key = calibration_key("llama", "0.33.0", "NVIDIA L4")
    store.put(key, cal)
    again = plan(
        info,
        {"gpu_memory_utilization": 0.9, "max_model_len": 4096},
        card,
        vllm_version="0.33.0",
        calibration=store.get(key),
    )
    assert again.kv_bytes.low == again.kv_bytes.high
    assert again.kv_bytes.value / GIB == pytest.approx(5.02, abs=0.01)
    # Another utilization: the overheads carry over, the KV budget moves by exactly the extra requested memory.
    lower = plan(
        info,
        {"gpu_memory_utilization": 0.85, "max_model_len": 4096},
        card,
        vllm_version="0.33.0",
        calibration=store.find("llama", "0.33.0", {}),
    )
    assert lower.kv_bytes.value / GIB == pytest.approx(5.02 - 0.05 * 22.03, abs=0.01)
    assert store.get(calibration_key("llama", "0.32.0", "NVIDIA L4")) is None


def test_a_calibration_is_not_reused_across_pipeline_stages_or_expert_parallelism(tmp_path: Path) -> None:
    # One GPU of a 2-stage pipeline holds half the layers: a TP-1/PP-1 startup's weights and overheads are not its own
    # (a public RTX PRO 6000 pair logged 61.03 GiB of Qwen3-32B weights on one card and 30.52 per card at PP 2).
    store = CalibrationStore(tmp_path / "calibration.json")
    single = {"tensor_parallel_size": 1}
    store.put(calibration_key("qwen", "0.27.1", "RTX PRO 6000", single), Calibration(weights_bytes=61 * GIB))
    assert store.find("qwen", "0.27.1", single) is not None
    assert store.find("qwen", "0.27.1", {**single, "pipeline_parallel_size": 2}) is None
    assert store.find("qwen", "0.27.1", {**single, "enable_expert_parallel": True}) is None


def test_tuner_trials_decided_by_the_plan_do_not_spend_startups() -> None:
    from pytest_vllm_mem.tune.search import OK, TOO_LOW, Trial, search

    started: list[float] = []

    def trial(utilization: float) -> Trial:
        if utilization < 0.3:  # the plan is sure the KV cache cannot hold one sequence: no startup
            return Trial(utilization, "kv_cache_insufficient", TOO_LOW, phase="planned")
        started.append(utilization)
        return Trial(utilization, OK, OK, phase="")

    result = search(trial, low=0.05, high=0.5, resolution=0.05, max_startups=2, goal="lowest")
    assert result.best is not None and abs(result.best.utilization - 0.3) < 1e-9
    assert len(started) <= 2 and any(t.phase == "planned" for t in result.trials)
    assert len(result.trials) > 2  # more trials than the startup budget: the planned ones were free


def test_a_real_startup_becomes_the_sessions_calibration_and_is_kept_with_the_baselines(tmp_path: Path) -> None:
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.diagnosis.diagnose import StartupMemory
    from pytest_vllm_mem.plan.preflight import SessionPlan, SessionPlans, calibration_path, learn_from_startup

    info = model_info_from_config(LLAMA2_7B, name="llama")
    first = plan(info, {"gpu_memory_utilization": 0.9}, Card("cuda", "L4", int(22.03 * GIB)), vllm_version="0.33.0")
    launched = VLLMConfig("llama", gpu_memory_utilization=0.9)
    store = calibration_path(tmp_path / "baselines.json")
    state = SessionPlans()
    state.plans[launched] = SessionPlan(first, "llama|0.33.0|L4|", launched, lambda flags: first)
    memory = StartupMemory(weights_gib=12.55, kv_cache_gib=5.02, graph_capture_gib=0.61)
    learn_from_startup(state, launched, memory, None, store)
    assert state.calibrations["llama|0.33.0|L4|"].weights_bytes == int(12.55 * GIB)
    assert CalibrationStore(store).get("llama|0.33.0|L4|") == state.calibrations["llama|0.33.0|L4|"]
    store.unlink()  # without a store (no --vllm-update-baseline) nothing is written
    learn_from_startup(state, launched, memory, None)
    assert not store.exists()


def test_plan_command_refuses_bad_input_in_one_paragraph_and_configs_vllm_refuses_with_its_reason(
    llama_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_json = tmp_path / "calibration.txt"
    not_json.write_text("root:x:0:0:root:/root:/bin/bash\n")
    for argv, says in (
        (["--json", "/proc/x.json"], "cannot be written"),
        (["--vllm-version", "banana"], "is not a vLLM version"),
        (["--calibration", str(not_json)], "is not a calibration file"),
        (["--calibration", str(tmp_path / "absent.json")], "cannot be read as a calibration file"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--model", str(llama_folder), *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and says in err and "Traceback" not in err
        assert len([line for line in err.splitlines() if "error:" in line]) == 1
    # vLLM's own refusals are predictions (exit 1), with vLLM's reason
    code = main(["plan", "--model", str(llama_folder), "--flag", "tensor_parallel_size=3"])
    assert code == 1 and "must be divisible by tensor parallel size (3)" in capsys.readouterr().out
    code = main(["plan", "--model", str(llama_folder), "--flag", "quantization=bogus"])
    assert code == 1 and "Unknown quantization method: bogus" in capsys.readouterr().out
