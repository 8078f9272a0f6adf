"""The plugin's session object: built in one go in pytest_configure, it owns what the hooks need (the session
state, the baseline gate, the report writer) and collects the test records as a registered plugin of its own, as
pytest-memray's Manager and pytest-xdist's DSession carry their hooks as methods."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pytest_vllm_mem.baseline.results import RECORD_PROPERTY, TestRecord
from pytest_vllm_mem.plugin.gate import Gate
from pytest_vllm_mem.plugin.report import ReportWriter, RunFacts
from pytest_vllm_mem.plugin.state import SessionState
from pytest_vllm_mem.tiers import Tier


def run_facts(state: SessionState) -> RunFacts:
    """What the reports say of where this process ran (read when they are written)."""
    device = state.known_device
    tier = state.tier.name if device is not None else state.tier_text
    return RunFacts(device, tier, state.known_vllm_version, tuple(state.leaked))


@dataclass
class PluginSession:
    """One pytest session's plugin: the state, the gate and the report writer, and the records collected from test
    reports (under pytest-xdist the controller sees the workers' records this way)."""

    state: SessionState
    gate: Gate
    report: ReportWriter
    records: list[TestRecord] = field(default_factory=list)

    @classmethod
    def build(cls, config: pytest.Config, state: SessionState) -> PluginSession:
        gate = Gate.from_config(config, state.settings)  # the session's one baseline store and tolerances
        report = ReportWriter(state.settings, gate, Path(config.rootpath), lambda: run_facts(state))
        return cls(state, gate, report)

    @property
    def tier(self) -> Tier:
        return self.state.tier

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == RECORD_PROPERTY and isinstance(value, str):
                self.records.append(TestRecord.from_dict(json.loads(value)))


session_key = pytest.StashKey[PluginSession]()
