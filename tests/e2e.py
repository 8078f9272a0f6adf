"""Helpers for end-to-end tests: run an inner pytest session (real vLLM CPU servers) in a subprocess and check that
none of its servers outlives it."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import psutil
import pytest

# Every inner session gets a unique token in its environment; servers inherit it, so leftovers are found by token
# (never by name: other vLLM processes on the machine are not ours).
TOKEN_VAR = "VLLM_MEM_TEST_TOKEN"
# pytester points HOME at a temporary folder; inner sessions share the real cache (tiny model, vLLM's compile cache,
# flag table) so that only the first server of the suite compiles cold.
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-vllm-mem"


def processes_with_token(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(TOKEN_VAR) == token:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def run_inner(pytester: pytest.Pytester, *args: str, env: dict[str, str] | None = None,
              timeout: float = 900) -> tuple[pytest.RunResult, dict]:
    """Run the inner session; returns its result and its results JSON. Fails if a server of it is left."""
    token = uuid.uuid4().hex
    results = pytester.path / f"results-{token[:8]}.json"
    old = {key: os.environ.get(key) for key in (TOKEN_VAR, *(env or {}))}
    os.environ.update({TOKEN_VAR: token, **(env or {})})
    try:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--vllm-results={results}",
                                               f"--vllm-cache-dir={CACHE_DIR}", *args,
                                               timeout=timeout)
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    leftovers = processes_with_token(token)
    for proc in leftovers:  # stop them (by pid) before failing, so one bug does not poison the rest of the suite
        proc.kill()
    assert not leftovers, f"vLLM processes outlived the pytest run: {[p.pid for p in leftovers]}"
    data = json.loads(results.read_text()) if results.exists() else {"tests": []}
    return result, data


def record(data: dict, name: str) -> dict:
    """The results-JSON record of the inner test whose id ends with `name`."""
    matches = [t for t in data["tests"] if t["test_id"].endswith(name)]
    assert matches, f"no record for {name} in {[t['test_id'] for t in data['tests']]}"
    return matches[0]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))
