from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.flagcheck import FlagCheckError, ParserTable, flag_problems, load_parser_table

TABLE = ParserTable(
    version="0.32.0",
    options={
        "--model": {"takes_value": True, "optional_value": False, "choices": None},
        "--max-model-len": {"takes_value": True, "optional_value": False, "choices": None},
        "--max-num-seqs": {"takes_value": True, "optional_value": False, "choices": None},
        "--enforce-eager": {"takes_value": False, "optional_value": False, "choices": None},
        "--no-enforce-eager": {"takes_value": False, "optional_value": False, "choices": None},
        "--dtype": {"takes_value": True, "optional_value": False,
                    "choices": ["auto", "half", "float16", "bfloat16", "float", "float32"]},
        "--hf-token": {"takes_value": True, "optional_value": True, "choices": None},
        "--collect-detailed-traces": {"takes_value": True, "optional_value": False,
                                      "choices": ["all", "model", "worker", "None"]},
    },
    defaults={"gpu_memory_utilization": 0.92},
)


def fake_interpreter(folder: Path, body: str) -> Path:
    """An executable standing in for --vllm-python: a shell script with `body`."""
    script = folder / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def test_a_valid_config_has_no_problems() -> None:
    config = VLLMConfig("m", max_model_len=64, enforce_eager=True, dtype="bfloat16", max_num_seqs=None,
                        no_enforce_eager=False)
    assert flag_problems(config, TABLE) == []


def test_unknown_flag_with_a_close_match() -> None:
    problems = flag_problems(VLLMConfig("m", max_modl_len=64), TABLE)
    assert problems == ["--max-modl-len is not a flag of vLLM 0.32.0 (did you mean --max-model-len?)"]


def test_unknown_flag_without_a_close_match() -> None:
    [problem] = flag_problems(VLLMConfig("m", swap_space=4), TABLE)
    assert problem == "--swap-space is not a flag of vLLM 0.32.0"


def test_bare_true_for_a_value_flag() -> None:
    [problem] = flag_problems(VLLMConfig("m", max_model_len=True), TABLE)
    assert "--max-model-len needs a value" in problem


def test_bare_true_for_an_optional_value_flag_is_fine() -> None:
    # --hf-token has nargs="?": a bare flag means "use the stored login token".
    assert flag_problems(VLLMConfig("m", hf_token=True), TABLE) == []
    assert flag_problems(VLLMConfig("m", hf_token="hf_x"), TABLE) == []


def test_a_value_for_an_on_off_flag() -> None:
    [problem] = flag_problems(VLLMConfig("m", enforce_eager="yes"), TABLE)
    assert "--enforce-eager is an on/off flag" in problem
    assert "enforce_eager=True or False" in problem and "'yes'" in problem


def test_a_choice_not_allowed() -> None:
    [problem] = flag_problems(VLLMConfig("m", dtype="fp7"), TABLE)
    assert problem.startswith("--dtype fp7 is not one of auto, half")


def test_list_values_are_checked_one_by_one() -> None:
    assert flag_problems(VLLMConfig("m", collect_detailed_traces=["model", "worker"]), TABLE) == []
    [problem] = flag_problems(VLLMConfig("m", collect_detailed_traces=["model", "gpu"]), TABLE)
    assert "model gpu is not one of" in problem


def test_every_problem_is_reported() -> None:
    config = VLLMConfig("m", max_modl_len=64, dtype="fp7", enforce_eager=1)
    assert len(flag_problems(config, TABLE)) == 3


def test_table_default() -> None:
    assert TABLE.default("gpu_memory_utilization", 0.9) == 0.92
    assert TABLE.default("missing", "fallback") == "fallback"


def test_a_broken_interpreter_is_a_flag_check_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-python"
    with pytest.raises(FlagCheckError, match="no-python"):
        load_parser_table(tmp_path, python=str(missing))


def test_real_table_from_the_installed_vllm_and_its_cache(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    table = load_parser_table(tmp_path)
    assert "--max-model-len" in table.options
    assert table.options["--max-model-len"]["takes_value"]
    assert not table.options["--enforce-eager"]["takes_value"]
    assert table.options["--hf-token"]["optional_value"]
    assert isinstance(table.default("gpu_memory_utilization"), float)
    [problem] = flag_problems(VLLMConfig("m", swap_space=4), table)
    assert problem.startswith("--swap-space is not a flag of vLLM")
    assert flag_problems(VLLMConfig("m", max_model_len=64, enforce_eager=True, hf_token=True), table) == []
    assert len(list(tmp_path.glob("vllm-options-*.json"))) == 1

    start = time.monotonic()
    cached = load_parser_table(tmp_path)
    assert time.monotonic() - start < 1.0
    assert cached == table


def test_a_broken_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake interpreter that prints a table (after some noise) stands in for vLLM.
    fake = tmp_path / "fake_python.py"
    fake.write_text(
        "import json, sys\n"
        "print('INFO some import-time chatter')\n"
        "print(json.dumps({'version': '9.9', 'options': {'--x': {'takes_value': True, 'choices': None}},"
        " 'defaults': {}}))\n"
    )
    script = fake_interpreter(tmp_path, f"exec {sys.executable} {fake}")
    cache_dir = tmp_path / "cache"
    table = load_parser_table(cache_dir, python=str(script))
    assert table.version == "9.9" and "--x" in table.options
    [cache] = cache_dir.glob("vllm-options-*.json")
    cache.write_text("{not json")
    assert load_parser_table(cache_dir, python=str(script)) == table


def test_an_interpreter_without_a_table_is_a_flag_check_error(tmp_path: Path) -> None:
    script = fake_interpreter(tmp_path, "echo nothing useful")
    with pytest.raises(FlagCheckError, match="printed no option table"):
        load_parser_table(tmp_path, python=str(script))


def test_a_failing_interpreter_is_a_flag_check_error(tmp_path: Path) -> None:
    script = fake_interpreter(tmp_path, "echo 'ModuleNotFoundError: No module named vllm' >&2\nexit 1")
    with pytest.raises(FlagCheckError, match="No module named vllm"):
        load_parser_table(tmp_path, python=str(script))
