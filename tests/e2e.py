"""Helpers for end-to-end tests: run an inner pytest session (real vLLM CPU servers) in a subprocess and check that
none of its servers outlives it."""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

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


class SessionWatcher:
    """Remembers the process sessions of the token's processes while the inner run goes on. vLLM renames its engine
    and workers with setproctitle, which blanks their /proc/PID/environ: they carry no visible token, but they stay
    in the session of the API server that started them (its own, from start_new_session)."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.sessions: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for proc in processes_with_token(self.token):
                try:
                    self.sessions.add(os.getsid(proc.pid))
                except OSError:
                    continue

    def __enter__(self) -> SessionWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def leftovers(self) -> list[psutil.Process]:
        ours = {proc.pid: proc for proc in processes_with_token(self.token)}
        own_session = os.getsid(0)
        for proc in psutil.process_iter(["pid"]):
            try:  # a process may end between the listing and these reads: it is then no leftover
                session = os.getsid(proc.pid)
                alive = proc.status() != psutil.STATUS_ZOMBIE
            except (OSError, psutil.Error):
                continue
            if session in self.sessions and session != own_session and alive:
                ours[proc.pid] = proc
        return list(ours.values())


def run_inner(
    pytester: pytest.Pytester, *args: str, env: dict[str, str] | None = None, timeout: float = 900
) -> tuple[pytest.RunResult, dict[str, Any]]:
    """Run the inner session; returns its result and its results JSON. Fails if a server of it is left."""
    token = uuid.uuid4().hex
    results = pytester.path / f"results-{token[:8]}.json"
    old = {key: os.environ.get(key) for key in (TOKEN_VAR, *(env or {}))}
    os.environ.update({TOKEN_VAR: token, **(env or {})})
    watcher = SessionWatcher(token)
    try:
        with watcher:
            result = pytester.runpytest_subprocess(
                "-p",
                "no:cacheprovider",
                f"--vllm-results={results}",
                f"--vllm-cache-dir={CACHE_DIR}",
                *args,
                timeout=timeout,
            )
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    leftovers = watcher.leftovers()
    for proc in leftovers:  # stop them (by pid) before failing, so one bug does not poison the rest of the suite
        proc.kill()
    assert not leftovers, f"vLLM processes outlived the pytest run: {[p.pid for p in leftovers]}"
    data: dict[str, Any] = json.loads(results.read_text()) if results.exists() else {"tests": []}
    return result, data


def record(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The results-JSON record of the inner test whose id ends with `name`."""
    matches = [t for t in data["tests"] if t["test_id"].endswith(name)]
    assert matches, f"no record for {name} in {[t['test_id'] for t in data['tests']]}"
    found: dict[str, Any] = matches[0]
    return found


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data))
