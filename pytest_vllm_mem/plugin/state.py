"""The pytest adapter's session state: one SessionState in config.stash, built on the core Session (session.py).

It adds what only a pytest session has: the test records, the server behind each test (for the gate's advice, the
failure's log tail and the plot), the baseline gate, the report writer and the xdist record collector. Every
attribute is declared here; plugin.py sets the pytest-made ones (gate, report, collector) in pytest_configure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pytest_vllm_mem.baseline.results import TestRecord
from pytest_vllm_mem.launch.pool import Session
from pytest_vllm_mem.launch.server import VLLMServer
from pytest_vllm_mem.settings import Settings

if TYPE_CHECKING:
    from pytest_vllm_mem.plugin import RecordCollector
    from pytest_vllm_mem.plugin.gate import Gate
    from pytest_vllm_mem.plugin.report import ReportWriter


class SessionState(Session):
    """Everything the plugin knows during one pytest session; created lazily, so runs without servers pay nothing."""

    # Set by pytest_configure, which has the pytest config they read: the session's one baseline gate and store,
    # the report writer, and the collector of records from test reports (pytest-xdist).
    gate: Gate
    report: ReportWriter
    collector: RecordCollector

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.records: dict[str, TestRecord] = {}  # by test node id, this process's tests
        # The server each test used, by node id, while the test runs: a VLLMServer, or the stopped one of a failed
        # startup. Kept here rather than in the record, which is plain data (written to JSON, sent by xdist).
        self.servers: dict[str, VLLMServer] = {}
        self.leaked: list[int] = []  # pids of servers still running at session end (stopped then, and reported)


state_key = pytest.StashKey[SessionState]()
