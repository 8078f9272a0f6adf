"""The pytest adapter's session state: one SessionState in config.stash, built on the core Session (launch/pool.py).

It adds what only a pytest session has: the test records and the server behind each test (for the gate's advice, the
failure's log tail and the plot). The gate, the report writer and the record collector are the plugin session's
(plugin/session.py), built with this state in one go.
"""

from __future__ import annotations

import pytest

from pytest_vllm_mem.baseline.results import TestRecord
from pytest_vllm_mem.launch.launcher import RunningServer
from pytest_vllm_mem.launch.pool import Session
from pytest_vllm_mem.settings import Settings


class SessionState(Session):
    """Everything the plugin knows during one pytest session; created lazily, so runs without servers pay nothing."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.records: dict[str, TestRecord] = {}  # by test node id, this process's tests
        # The server each test used, by node id, while the test runs: a running server (here or on a cluster), or
        # the stopped one of a failed startup. Kept here rather than in the record, which is plain data (written to
        # JSON, sent by xdist).
        self.servers: dict[str, RunningServer] = {}
        self.leaked: list[int] = []  # pids of servers still running at session end (stopped then, and reported)
        # (pid, started_at, concurrency, prompt_len, max_tokens): the servers and load shapes warmed up already.
        self.warmed: set[tuple[int, float, int, int, int]] = set()


state_key = pytest.StashKey[SessionState]()
